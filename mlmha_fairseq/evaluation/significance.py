"""Paired significance tests between a baseline and one or more systems.

Methods (as the papers test significance):

- ``thesis``: the thesis protocol, paired bootstrap resampling (Koehn 2004) with
  ``n_samples`` resamples of ``sample_size`` sentence pairs drawn with replacement
  (thesis: 1,000 resamples of 1,000 sentences); p = 1 - win rate of the better system.
  Written by hand because no library offers a fixed sample size with this p-value.
- ``compare-mt``: compare-mt's ``eval_with_paired_bootstrap`` (resamples of
  ``sample_ratio`` x test size, default 0.5), its BLEU on whitespace tokens; the paper's tool.
- ``sacrebleu-bs``: sacreBLEU's paired bootstrap (Moses
  ``bootstrap-hypothesis-difference-significance.pl``, full test-set size resamples).
- ``sacrebleu-ar``: sacreBLEU's paired approximate randomization (MultEval's test).

The thesis and sacreBLEU methods test the protocol's metric (BLEU, chrF, chrF++ or TER, for
which lower is better); compare-mt's method tests BLEU only.

Marks: ``‡`` for p < 0.01 and ``†`` for p < 0.05 (the MLMHA paper and thesis; MMA prints
``††`` for p < 0.01).
"""
import contextlib
import logging
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlmha_fairseq.evaluation.scoring import Protocol, build_metric
from mlmha_fairseq.evaluation.text_io import InputError, check_same_length

logger = logging.getLogger(__name__)

METHODS = ("thesis", "compare-mt", "sacrebleu-bs", "sacrebleu-ar")
DEFAULT_SAMPLES = 1000
DEFAULT_AR_TRIALS = 10000
THESIS_SAMPLE_SIZE = 1000
COMPARE_MT_SAMPLE_RATIO = 0.5
DEFAULT_SEED = 12345
CONFIDENCE = 0.95
SIGNIFICANCE_MARKS = ((0.01, "‡"), (0.05, "†"))


@dataclass
class PairedResult:
    """One system compared with the baseline by one method.

    ``ci_low``/``ci_high`` bound the system's score over the resamples (95%), when the
    method gives them.
    """

    method: str
    system: str
    score: float
    baseline_score: float
    p_value: float
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None

    @property
    def delta(self) -> float:
        return self.score - self.baseline_score

    @property
    def mark(self) -> str:
        return significance_mark(self.p_value)

    def as_row(self) -> Dict:
        row = asdict(self)
        row.update(delta=self.delta, mark=self.mark)
        return row


def significance_mark(p_value: float) -> str:
    """``‡`` if p < 0.01, ``†`` if p < 0.05, else an empty string."""
    for threshold, mark in SIGNIFICANCE_MARKS:
        if p_value < threshold:
            return mark
    return ""


def sentence_statistics(metric, hypotheses: Sequence[str],
                        references: Sequence[Sequence[str]]) -> np.ndarray:
    """Per-sentence sufficient statistics (n-gram matches/totals and lengths for BLEU),
    through the same sacreBLEU internals its own significance module uses."""
    return np.array(metric._extract_corpus_statistics(list(hypotheses), references),
                    dtype=np.float64)


def score_from_statistics(metric, summed: np.ndarray) -> float:
    """The corpus score of summed sufficient statistics."""
    return metric._compute_score_from_stats(summed.tolist()).score


def _interval(scores: np.ndarray) -> Tuple[float, float]:
    tail = 100 * (1 - CONFIDENCE) / 2
    return float(np.percentile(scores, tail)), float(np.percentile(scores, 100 - tail))


@dataclass
class BootstrapSamples:
    """Resampled corpus scores of the baseline and a system over the same indices."""

    baseline: np.ndarray
    system: np.ndarray


def thesis_bootstrap(baseline: Sequence[str], system: Sequence[str],
                     references: Sequence[Sequence[str]], protocol: Protocol,
                     name: str = "system", n_samples: int = DEFAULT_SAMPLES,
                     sample_size: int = THESIS_SAMPLE_SIZE,
                     seed: int = DEFAULT_SEED) -> Tuple[PairedResult, BootstrapSamples]:
    """The thesis' paired bootstrap: ``n_samples`` test sets of ``sample_size`` pairs drawn
    with replacement; the better system (on the full test set) wins a resample when its
    score is strictly higher; p = 1 - wins / n_samples. For TER, where lower is better, this
    counts the same resamples: those in which the two systems keep their full-test-set order.

    Ties count as losses for both systems (compare-mt's counting quirk, which also counts
    wins as ties, is not copied), so identical systems get p = 1.
    """
    if sample_size < 1 or n_samples < 1:
        raise InputError("the number of resamples and the sample size must be positive")
    if sample_size > len(baseline):
        logger.warning("thesis method: the sample size %d exceeds the test set (%d sentences): "
                       "resamples larger than the test set understate the score's variance and "
                       "overstate significance; pass --sample-size %d or less",
                       sample_size, len(baseline), len(baseline))
    metric = build_metric(protocol)
    base_stats = sentence_statistics(metric, baseline, references)
    sys_stats = sentence_statistics(metric, system, references)
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, len(base_stats), size=(n_samples, sample_size))
    base_scores = np.array([score_from_statistics(metric, s) for s in base_stats[indices].sum(1)])
    sys_scores = np.array([score_from_statistics(metric, s) for s in sys_stats[indices].sum(1)])
    base_full = score_from_statistics(metric, base_stats.sum(0))
    sys_full = score_from_statistics(metric, sys_stats.sum(0))
    if sys_full >= base_full:
        wins = np.sum(sys_scores > base_scores)
    else:
        wins = np.sum(base_scores > sys_scores)
    low, high = _interval(sys_scores)
    result = PairedResult("thesis", name, sys_full, base_full, 1.0 - wins / n_samples, low, high)
    return result, BootstrapSamples(base_scores, sys_scores)


@contextlib.contextmanager
def _sacrebleu_seed(seed: int):
    """sacreBLEU's PairedTest reads its seed from the SACREBLEU_SEED environment variable."""
    previous = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = previous


def sacrebleu_paired(baseline: Sequence[str], systems: Sequence[Tuple[str, Sequence[str]]],
                     references: Sequence[Sequence[str]], protocol: Protocol,
                     test_type: str = "bs", n_samples: int = DEFAULT_SAMPLES,
                     seed: int = DEFAULT_SEED) -> List[PairedResult]:
    """sacreBLEU's paired bootstrap (``bs``) or approximate randomization (``ar``) test.

    Both tests compare absolute differences, so they hold for TER (lower is better) as they are.
    sacreBLEU counts resampled statistics strictly greater than the observed difference,
    so a system identical to the baseline gets p = 1/(n+1), i.e. "significant"; identical
    hypotheses are reported with p = 1 instead.
    """
    from sacrebleu.significance import PairedTest

    metric = build_metric(protocol)
    named = [("baseline", list(baseline))] + [(n, list(h)) for n, h in systems]
    with _sacrebleu_seed(seed):
        test = PairedTest(named, {protocol.metric: metric}, [list(r) for r in references],
                          test_type=test_type, n_samples=n_samples)
        _signatures, scores = test()
    metric_results = next(v for k, v in scores.items() if k != "System")
    base_result = metric_results[0]
    method = f"sacrebleu-{test_type}"
    results = []
    for (name, hyps), res in zip(systems, metric_results[1:]):
        p_value = 1.0 if list(hyps) == list(baseline) else res.p_value
        low = high = None
        if res.mean is not None and res.ci is not None:
            low, high = res.mean - res.ci, res.mean + res.ci
        results.append(PairedResult(method, name, res.score, base_result.score, p_value, low, high))
    return results


@contextlib.contextmanager
def _numpy_global_seed(seed: int):
    """compare-mt draws from numpy's global RNG; seed it and restore the state afterwards."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def compare_mt_bootstrap(baseline: Sequence[str], system: Sequence[str],
                         references: Sequence[Sequence[str]], protocol: Protocol,
                         name: str = "system", n_samples: int = DEFAULT_SAMPLES,
                         sample_ratio: float = COMPARE_MT_SAMPLE_RATIO,
                         seed: int = DEFAULT_SEED) -> PairedResult:
    """compare-mt's paired bootstrap with its BLEU on the protocol's tokens (sacreBLEU's
    tokenizer and casing applied first), p = 1 - max(win ratios) as compare-mt reports it.

    compare-mt's BLEU differs from multi-bleu.perl on short sentences: every sentence
    contributes an n-gram denominator of at least 1, and zero precisions are skipped.
    """
    from compare_mt import scorers, sign_utils

    if protocol.metric != "bleu":
        raise InputError("the compare-mt method supports BLEU only")
    if len(references) != 1:
        raise InputError("the compare-mt method supports a single reference only")
    metric = build_metric(protocol)

    def tokens(lines):
        return [metric._preprocess_segment(line).split() for line in lines]

    ref = tokens(references[0])
    outs = [tokens(baseline), tokens(system)]
    scorer = scorers.BleuScorer()
    with _numpy_global_seed(seed):
        wins, sys_stats = sign_utils.eval_with_paired_bootstrap(
            ref, outs, None, scorer, compare_directions=[(0, 1)], num_samples=n_samples,
            sample_ratio=sample_ratio)
    base_full = scorer.score_corpus(ref, outs[0])[0]
    sys_full = scorer.score_corpus(ref, outs[1])[0]
    base_wins, sys_wins, _ties = wins[0]
    return PairedResult("compare-mt", name, sys_full, base_full, 1.0 - max(base_wins, sys_wins),
                        sys_stats[1]["lower_bound"], sys_stats[1]["upper_bound"])


@dataclass
class SignificanceOptions:
    """Settings shared by the methods."""

    n_samples: int = DEFAULT_SAMPLES
    sample_size: int = THESIS_SAMPLE_SIZE
    sample_ratio: float = COMPARE_MT_SAMPLE_RATIO
    ar_trials: int = DEFAULT_AR_TRIALS
    seed: int = DEFAULT_SEED


def compare_systems(baseline: Sequence[str], systems: Sequence[Tuple[str, Sequence[str]]],
                    references: Sequence[Sequence[str]], protocol: Protocol,
                    methods: Sequence[str], options: Optional[SignificanceOptions] = None
                    ) -> Tuple[List[PairedResult], Dict[str, BootstrapSamples]]:
    """Run every method for every system against the baseline.

    Returns the results and, for the thesis method, the resampled scores per system.
    """
    options = options or SignificanceOptions()
    check_same_length([("baseline", baseline)] + [(n, h) for n, h in systems]
                      + [(f"references #{i + 1}", r) for i, r in enumerate(references)])
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise InputError(f"unknown methods: {', '.join(sorted(unknown))}")
    results, samples = [], {}
    for method in methods:
        logger.info("significance: %s on %d systems", method, len(systems))
        if method == "thesis":
            for name, hyps in systems:
                result, samples[name] = thesis_bootstrap(
                    baseline, hyps, references, protocol, name, options.n_samples,
                    options.sample_size, options.seed)
                results.append(result)
        elif method == "compare-mt":
            results.extend(
                compare_mt_bootstrap(baseline, hyps, references, protocol, name,
                                     options.n_samples, options.sample_ratio, options.seed)
                for name, hyps in systems)
        elif method == "sacrebleu-bs":
            results.extend(sacrebleu_paired(baseline, systems, references, protocol, "bs",
                                            options.n_samples, options.seed))
        else:
            results.extend(sacrebleu_paired(baseline, systems, references, protocol, "ar",
                                            options.ar_trials, options.seed))
    return results, samples
