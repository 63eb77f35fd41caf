"""GNMT length penalty (Wu et al. 2016): ``score(Y) = log P(Y|X) / lp(Y)`` with
``lp(Y) = ((5 + |Y|) / 6) ** alpha``.

The MLMHA paper and the thesis decode with it (alpha 0.6 En-De, 1.1 IWSLT), and so does
Libovický et al. 2018 (alpha 1.0). fairseq's
``--lenpen`` divides by ``|Y| ** lenpen`` instead.

Why re-ranking is exact for fairseq's beam search: in ``SequenceGenerator._generate`` the
search ranks candidates by their cumulative log-probability; ``len_penalty`` is used only in
``finalize_hypos``, where it divides the score stored with a hypothesis that just emitted EOS
(``eos_scores /= (step + 1) ** len_penalty``), and a sentence stops once ``beam`` hypotheses
are finalised or ``max_len`` is reached. So the SET of finalised hypotheses does not depend
on ``len_penalty``: decoding with ``len_penalty = 0`` (raw sums) and re-ranking that set by
the GNMT score gives what fairseq would give with a GNMT ``finalize_hypos``.

Not reproduced: TF-official's beam search also uses the penalty in its early-stopping test,
and Neural Monkey (Libovický et al.'s toolkit) applies it at every step; both can change which
hypotheses are found. ``|Y|`` counts the final EOS, as fairseq's own ``--lenpen`` does
(``step + 1`` tokens) and as TF-official's ``i + 1`` does.
"""
from typing import Dict, List

from fairseq.sequence_generator import SequenceGenerator

GNMT_LENGTH_OFFSET = 5.0
GNMT_LENGTH_SCALE = GNMT_LENGTH_OFFSET + 1.0


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """``((5 + length) / 6) ** alpha`` (Wu et al. 2016, Eq. 14)."""
    return ((GNMT_LENGTH_OFFSET + length) / GNMT_LENGTH_SCALE) ** alpha


def rerank_gnmt(hypos: List[Dict], alpha: float) -> List[Dict]:
    """Re-score and sort one sentence's finalised hypotheses by the GNMT score.

    Each ``hypo["score"]`` must be the unnormalised sum of log-probabilities (fairseq with
    ``len_penalty=0``); ``|Y|`` is ``len(hypo["tokens"])``, EOS included. The sort is stable.
    """
    rescored = [dict(h, score=h["score"] / gnmt_length_penalty(len(h["tokens"]), alpha))
                for h in hypos]
    return sorted(rescored, key=lambda h: float(h["score"]), reverse=True)


class GNMTSequenceGenerator(SequenceGenerator):
    """fairseq's SequenceGenerator ranking finished hypotheses by the GNMT score.

    Any ``len_penalty`` passed in (fairseq's ``--lenpen``) is replaced by 0 so that the
    scores to re-rank are raw log-probability sums.
    """

    def __init__(self, models, tgt_dict, gnmt_alpha: float, **kwargs):
        kwargs["len_penalty"] = 0.0
        kwargs["normalize_scores"] = True
        super().__init__(models, tgt_dict, **kwargs)
        self.gnmt_alpha = gnmt_alpha

    def _generate(self, sample, prefix_tokens=None, constraints=None, bos_token=None):
        finalized = super()._generate(sample, prefix_tokens=prefix_tokens,
                                      constraints=constraints, bos_token=bos_token)
        return [rerank_gnmt(hypos, self.gnmt_alpha) for hypos in finalized]
