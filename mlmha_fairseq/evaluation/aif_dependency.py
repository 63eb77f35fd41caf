"""How much the Main-Decoder depends on the auxiliary information of AIF (thesis §4.5.5,
Figs. 4.7-4.8).

The *ind-decoder* is the Main-Decoder with every AIF matrix ``W^{a_i}_l`` set to zero (it
shares every other parameter). For each sentence, the Main-Decoder (with AIF) decodes
greedily, ``y^m``; both decoders are then fed the same prefixes ``y^m_{<t}`` and compared:

    D_{y_t} = KL( P_m(. | y^m_{<t}, x) || P_ind(. | y^m_{<t}, x) ),   D_Y = 1/|Y| sum_t D_{y_t}

averaged over sentences (Fig. 4.7a), and, per decoder layer l and head h, the
encoder-decoder attention distributions ``A^m_h, A^ind_h`` (Z x J):

    D^l_h = KL(A^m_h || A^ind_h),    D^l = 1/N_h sum_h D^l_h                      (Fig. 4.7b)

Readings [choice] (the thesis does not say): the KL of two Z x J matrices is taken row-wise (over source
positions) and averaged over the target positions of all sentences; ``|Y|`` counts every
predicted token, the final EOS included. Natural logarithms (nats). Teacher forcing the greedy
output gives the same distributions as stepping both decoders along it (the decoders are
causal; tests/test_multi_level_supervision.py checks incremental == full forward).
"""
import contextlib
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch

from mlmha_fairseq.evaluation.attention_statistics import recording_attention
from mlmha_fairseq.evaluation.plotting import BAR_FIGSIZE, pyplot, save_figure
from mlmha_fairseq.evaluation.text_io import InputError


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ``KL(p || q)`` in nats of distributions ``[..., K]`` -> ``[...]`` (0 log 0 = 0).

    Not ``F.kl_div``: it takes ``log q`` and gives NaN (0 * -inf) where ``p = q = 0``."""
    p, q = p.to(torch.float64), q.to(torch.float64)
    return (torch.special.xlogy(p, p) - torch.special.xlogy(p, q)).sum(dim=-1)


def check_aif_model(model) -> None:
    decoder = model.decoder
    if not getattr(decoder, "aux_fusion", False):
        raise InputError("the model has no AIF (train an ms_transformer with --aux-fusion)")


@contextlib.contextmanager
def ind_decoder(model):
    """Within the context, the Main-Decoder is the ind-decoder (AIF weights taken as zero)."""
    decoder = model.decoder
    zero_aif = decoder.zero_aif
    decoder.zero_aif = True
    try:
        yield model
    finally:
        decoder.zero_aif = zero_aif


def recording_cross_attention(model):
    """:func:`recording_attention` of every Main-Decoder layer's encoder-decoder attention."""
    return recording_attention([layer.encoder_attn for layer in model.decoder.layers])


def greedy_hypotheses(model, src_tokens, src_lengths, tgt_dict, max_len_a: float,
                      max_len_b: int) -> List[torch.Tensor]:
    """The Main-Decoder's greedy output ``y^m`` per sentence (fairseq's generator, beam 1;
    each ends with EOS)."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], tgt_dict, beam_size=1, max_len_a=max_len_a,
                                  max_len_b=max_len_b)
    hypotheses = generator.generate([model], {"net_input": {"src_tokens": src_tokens,
                                                            "src_lengths": src_lengths}})
    return [sentence[0]["tokens"] for sentence in hypotheses]


def teacher_forcing_inputs(hypotheses: Sequence[torch.Tensor], pad: int, eos: int
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs ``[EOS, y_1, ..., y_{|Y|-1}]`` (B x Z, right-padded) and the mask of
    the predicted positions (B x Z)."""
    from fairseq.data.data_utils import collate_tokens

    prev = collate_tokens(hypotheses, pad, eos, move_eos_to_beginning=True)
    lengths = torch.tensor([len(tokens) for tokens in hypotheses])
    mask = torch.arange(prev.size(1))[None, :] < lengths[:, None]
    return prev, mask


class DependencyAccumulator:
    """Corpus sums of ``D_Y`` (per sentence) and of the row-wise attention KL per
    (layer, head)."""

    def __init__(self, layers: int, heads: int):
        self.sentence_divergences: List[float] = []
        self.token_divergences: List[List[float]] = []
        self.hypotheses: List[List[int]] = []
        self.attention_total = np.zeros((layers, heads))
        self.attention_rows = 0

    def update(self, hypotheses: Sequence[torch.Tensor], output_kl: torch.Tensor,
               attention_kl: torch.Tensor, mask: torch.Tensor):
        """``output_kl``: B x Z; ``attention_kl``: layers x heads x B x Z; ``mask``: B x Z."""
        self.hypotheses.extend(tokens.tolist() for tokens in hypotheses)
        for row, keep in zip(output_kl, mask):
            values = row[keep]
            self.token_divergences.append(values.tolist())
            self.sentence_divergences.append(values.mean().item())
        self.attention_total += (attention_kl * mask).sum(dim=(-2, -1)).numpy()
        self.attention_rows += int(mask.sum())

    def output_divergence(self) -> float:
        """``D_Y`` averaged over sentences (Fig. 4.7a)."""
        return float(np.mean(self.sentence_divergences))

    def head_divergence(self) -> np.ndarray:
        """``D^l_h``, layers x heads."""
        return self.attention_total / self.attention_rows

    def layer_divergence(self) -> np.ndarray:
        """``D^l`` per decoder layer (Fig. 4.7b)."""
        return self.head_divergence().mean(axis=1)

    def table(self) -> List[Dict]:
        """One row per decoder layer (1-based) and head (1-based)."""
        return [{"layer": layer + 1, "head": head + 1, "attention_kl": float(value)}
                for (layer, head), value in np.ndenumerate(self.head_divergence())]


def _teacher_forced(model, src_tokens, src_lengths, prev) -> Tuple[torch.Tensor, torch.Tensor]:
    """Output probabilities (B x Z x V) and cross-attention (layers x heads x B x Z x J)."""
    with recording_cross_attention(model) as records:
        logits = model(src_tokens, src_lengths, prev)[0]
    return logits.softmax(dim=-1), torch.stack(records)


def aif_dependency(model, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], tgt_dict,
                   max_len_a: float = 1.0, max_len_b: int = 20) -> DependencyAccumulator:
    """Decode ``(src_tokens, src_lengths)`` batches greedily with the AIF Main-Decoder and
    accumulate its divergence from the ind-decoder."""
    check_aif_model(model)
    model.eval()
    first = model.decoder.layers[0].encoder_attn
    accumulator = DependencyAccumulator(len(model.decoder.layers), first.num_heads)
    with torch.no_grad():
        for src_tokens, src_lengths in batches:
            hypotheses = greedy_hypotheses(model, src_tokens, src_lengths, tgt_dict, max_len_a, max_len_b)
            prev, mask = teacher_forcing_inputs(hypotheses, tgt_dict.pad(), tgt_dict.eos())
            main_probs, main_attention = _teacher_forced(model, src_tokens, src_lengths, prev)
            with ind_decoder(model):
                ind_probs, ind_attention = _teacher_forced(model, src_tokens, src_lengths, prev)
            accumulator.update(hypotheses, kl_divergence(main_probs, ind_probs),
                               kl_divergence(main_attention, ind_attention), mask)
    if not accumulator.sentence_divergences:
        raise InputError("no sentences to analyse")
    return accumulator


def plot_aif_dependency(models: Dict[str, DependencyAccumulator], path: str) -> None:
    """(a) ``D_Y`` per model; (b) ``D^l`` over the decoder layers per model (Fig. 4.7)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, (left, right) = plt.subplots(1, 2, figsize=(2 * BAR_FIGSIZE[0], BAR_FIGSIZE[1]))
    names = list(models)
    left.bar(range(len(names)), [models[name].output_divergence() for name in names])
    left.set_xticks(range(len(names)))
    left.set_xticklabels(names)
    left.set_ylabel("KL(P_m || P_ind) per token (nats)")
    left.set_title("(a) output distributions", fontsize="medium")
    for name, accumulator in models.items():
        divergence = accumulator.layer_divergence()
        right.plot(range(1, len(divergence) + 1), divergence, marker="o", label=name)
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("decoder layer")
    right.set_ylabel("KL(A_m || A_ind) (nats)")
    right.set_title("(b) encoder-decoder attention", fontsize="medium")
    right.legend(fontsize="small")
    save_figure(figure, path)
