"""Optimizer replicates reported as MultEval reports them (Clark et al. 2011, "Better
Hypothesis Testing for Statistical Machine Translation: Controlling for Optimizer
Instability").

Per system, every metric's mean and standard deviation over the replicates (training seeds)
and its per-seed values; s_sel, the spread that the choice of test set causes: the standard
deviation of the score over bootstrap resamples of the test set, averaged over the
replicates; and a p-value against the baseline from approximate randomization over the
replicates. Alongside, sacreBLEU's paired bootstrap for each seed. Beside MultEval's BLEU, chrF
and METEOR, the metrics 2026 papers report: sacreBLEU's chrF++ and TER (lower is better), and
COMET when a model is given (:mod:`~mlmha_fairseq.evaluation.comet`).

What comes from sacreBLEU: the scores and their signatures, the bootstrap resampler behind
s_sel, the paired bootstrap and the approximate randomization. What is written here, since
sacreBLEU has no notion of replicates: the mean/sd over seeds, the average of the bootstrap
deviations, and the concatenation of replicates that turns sacreBLEU's one-test-set AR into
MultEval's test over replicates (see :func:`replicate_ar_p_value`).
"""
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlmha_fairseq.evaluation.comet import NOT_GIVEN as COMET_NOT_GIVEN
from mlmha_fairseq.evaluation.comet import Comet
from mlmha_fairseq.evaluation.meteor import UNAVAILABLE, WordNet, corpus_meteor, load_wordnet
from mlmha_fairseq.evaluation.scoring import Protocol, build_metric, corpus_score, resolve_protocol
from mlmha_fairseq.evaluation.significance import (
    DEFAULT_AR_TRIALS, DEFAULT_SAMPLES, DEFAULT_SEED, _sacrebleu_seed, sacrebleu_paired, sentence_statistics,
    significance_mark,
)
from mlmha_fairseq.evaluation.text_io import write_text

METRICS = ("BLEU", "chrF", "METEOR", "chrF++", "TER", "COMET")
SACREBLEU_PROTOCOLS = {"BLEU": "sacrebleu", "chrF": "chrf", "chrF++": "chrf++", "TER": "ter"}


def mean_sd(values: Sequence[float]) -> Tuple[float, Optional[float]]:
    """Mean and sample standard deviation (n - 1, as MultEval's); sd is None for one value."""
    values = np.asarray(values, dtype=np.float64)
    return float(values.mean()), (float(values.std(ddof=1)) if len(values) > 1 else None)


def bootstrap_sd(hypotheses: Sequence[str], references: Sequence[Sequence[str]], protocol: Protocol,
                 n_samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED) -> float:
    """Standard deviation of the corpus score over ``n_samples`` bootstrap resamples of the
    test set, drawn by sacreBLEU's own resampler (the one behind its confidence intervals)."""
    from sacrebleu.significance import _bootstrap_resample

    metric = build_metric(protocol)
    stats = sentence_statistics(metric, hypotheses, references)
    with _sacrebleu_seed(seed):
        _seed, scores = _bootstrap_resample(stats.tolist(), metric, n_samples)
    return float(np.std([score.score for score in scores], ddof=1))


def s_sel(per_replicate_sd: Sequence[float]) -> float:
    """MultEval's s_sel: the bootstrap standard deviations of the replicates, averaged."""
    return float(np.mean(per_replicate_sd))


def replicate_ar_p_value(baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]],
                         references: Sequence[Sequence[str]], protocol: Protocol,
                         trials: int = DEFAULT_AR_TRIALS, seed: int = DEFAULT_SEED) -> float:
    """Two-sided approximate randomization over replicates, as MultEval runs it.

    MultEval (its StratifiedApproximateRandomizationTest over every optimizer run's
    sufficient statistics) concatenates the replicates: replicate r of the system is paired
    with replicate r of the baseline, giving one test set of R x N sentence pairs; each trial
    swaps every pair's two hypotheses with probability 1/2 (a pair is a stratum), scores the
    two concatenated pseudo-systems, and counts |difference| > the observed one;
    p = (count + 1) / (trials + 1). sacreBLEU's paired AR is the same test on one test set
    (it cites MultEval's code), so it runs here on the concatenation, the references repeated
    once per replicate.
    """
    if len(baseline) != len(system):
        raise ValueError("the baseline and the system need the same number of replicates (paired by seed)")
    concatenated_baseline = [line for replicate in baseline for line in replicate]
    concatenated_system = [line for replicate in system for line in replicate]
    repeated_references = [list(stream) * len(baseline) for stream in references]
    result, = sacrebleu_paired(concatenated_baseline, [("system", concatenated_system)], repeated_references,
                               protocol, "ar", trials, seed)
    return result.p_value


@dataclass
class ReplicateOptions:
    bootstrap_samples: int = DEFAULT_SAMPLES
    ar_trials: int = DEFAULT_AR_TRIALS
    seed: int = DEFAULT_SEED


@dataclass
class SystemRow:
    """One system's replicates: per-seed scores and their summary."""

    name: str
    seeds: List[int]
    scores: Dict[str, List[Optional[float]]]  # metric -> per seed (METEOR, COMET None when unavailable)
    s_sel: float
    ar_p_value: Optional[float] = None  # BLEU, against the baseline over the shared seeds
    ar_seeds: List[int] = field(default_factory=list)
    bootstrap_p_values: Dict[int, float] = field(default_factory=dict)  # seed -> sacreBLEU paired bootstrap
    extra: Dict[str, List[float]] = field(default_factory=dict)  # column title -> per seed

    def summary(self, metric: str) -> Tuple[Optional[float], Optional[float]]:
        values = self.scores[metric]
        if not values or any(value is None for value in values):
            return None, None
        return mean_sd(values)

    def bleu_over(self, seeds: Sequence[int]) -> float:
        """Mean BLEU over ``seeds`` (a subset of this row's)."""
        return mean_sd([score for seed, score in zip(self.seeds, self.scores["BLEU"]) if seed in seeds])[0]

    def delta(self, baseline: "SystemRow") -> Optional[float]:
        """Mean BLEU minus the baseline's over the seeds both have, the runs the AR test pairs:
        while a grid is partial, a system with fewer seeds is not compared with the baseline's
        other seeds. None without a shared seed."""
        if not self.ar_seeds:
            return None
        return self.bleu_over(self.ar_seeds) - baseline.bleu_over(self.ar_seeds)


@dataclass
class ReplicateReport:
    baseline: str
    rows: List[SystemRow]
    signatures: Dict[str, str]
    meteor_note: str
    settings: Dict
    extra_columns: List[str] = field(default_factory=list)  # titles of the extra columns, in order
    comet_note: str = COMET_NOT_GIVEN

    def as_dict(self) -> Dict:
        rows = []
        for row in self.rows:
            record = asdict(row)
            record["mean"] = {metric: row.summary(metric)[0] for metric in METRICS}
            record["sd"] = {metric: row.summary(metric)[1] for metric in METRICS}
            record["mark"] = significance_mark(row.ar_p_value) if row.ar_p_value is not None else ""
            rows.append(record)
        return {"baseline": self.baseline, "systems": rows, "signatures": self.signatures,
                "meteor": self.meteor_note, "comet": self.comet_note, "settings": self.settings}


def build_report(systems: Sequence[Tuple[str, Dict[int, List[str]]]], references: Sequence[Sequence[str]],
                 options: Optional[ReplicateOptions] = None, wordnet: Optional[WordNet] = None,
                 extra: Optional[Dict[str, Dict[str, Dict[int, float]]]] = None,
                 comet: Optional[Comet] = None, sources: Optional[Sequence[str]] = None) -> ReplicateReport:
    """Scores, s_sel and tests of ``systems`` = [(name, {seed: hypotheses})], the first the
    baseline. ``extra`` = {column: {system: {seed: value}}} is carried into the tables.
    ``comet``: a COMET model, which reads ``sources`` and the first reference stream."""
    options = options or ReplicateOptions()
    wordnet = wordnet or load_wordnet()
    if comet is not None and sources is None:
        raise ValueError("COMET needs the source sentences")
    protocols = {metric: resolve_protocol(name) for metric, name in SACREBLEU_PROTOCOLS.items()}
    bleu = protocols["BLEU"]
    signatures = {}
    rows = []
    baseline_name, baseline_runs = systems[0]
    for name, runs in systems:
        seeds = sorted(runs)
        scores = {metric: [] for metric in METRICS}
        deviations = []
        for seed in seeds:
            for metric, protocol in protocols.items():
                result = corpus_score(runs[seed], references, protocol)
                signatures[metric] = result.signature
                scores[metric].append(result.score)
            scores["METEOR"].append(corpus_meteor(runs[seed], references, wordnet))
            scores["COMET"].append(None if comet is None else comet.score(sources, runs[seed], references[0]).score)
            deviations.append(bootstrap_sd(runs[seed], references, bleu, options.bootstrap_samples, options.seed))
        row = SystemRow(name, seeds, scores, s_sel(deviations))
        row.extra = {title: [values[name][seed] for seed in seeds]
                     for title, values in (extra or {}).items() if name in values}
        if name != baseline_name:
            shared = [seed for seed in seeds if seed in baseline_runs]
            if shared:
                row.ar_seeds = shared
                row.ar_p_value = replicate_ar_p_value([baseline_runs[s] for s in shared], [runs[s] for s in shared],
                                                      references, bleu, options.ar_trials, options.seed)
                for seed in shared:
                    result, = sacrebleu_paired(baseline_runs[seed], [(name, runs[seed])], references, bleu, "bs",
                                               options.bootstrap_samples, options.seed)
                    row.bootstrap_p_values[seed] = result.p_value
        rows.append(row)
    meteor_note = ("nltk meteor_score (exact, stem, WordNet 3.0 synonyms; no paraphrases), mean sentence score x 100"
                   if wordnet.reader is not None else f"{UNAVAILABLE}: {wordnet.reason}")
    comet_note = (COMET_NOT_GIVEN if comet is None
                  else f"unbabel-comet, model {comet.directory}, system score (mean segment score) x 100")
    return ReplicateReport(baseline_name, rows, signatures, meteor_note, asdict(options), list(extra or {}),
                           comet_note)


def mean_sd_text(values: Sequence[Optional[float]], plus_minus: str = " ± ") -> str:
    """``mean ± sd`` with two decimals; the mean alone for one value (no sd of one seed)."""
    if not values or any(value is None for value in values):
        return UNAVAILABLE
    mean, sd = mean_sd(values)
    return f"{mean:.2f}" if sd is None else f"{mean:.2f}{plus_minus}{sd:.2f}"


def _cells(report: ReplicateReport, row: SystemRow, plus_minus: str, extra_titles: Sequence[str],
           missing: str) -> List[str]:
    baseline = report.rows[0]
    bleu = mean_sd_text(row.scores["BLEU"], plus_minus)
    is_baseline = row is baseline
    mark = "" if is_baseline or row.ar_p_value is None else significance_mark(row.ar_p_value)
    difference = None if is_baseline else row.delta(baseline)
    delta = "" if difference is None else f"{difference:+.2f}"
    p_ar = "" if is_baseline or row.ar_p_value is None else f"{row.ar_p_value:.3f}"
    p_bs = "" if is_baseline else ", ".join(f"{row.bootstrap_p_values[s]:.3f}" for s in row.ar_seeds)
    cells = [row.name, bleu + mark, delta, f"{row.s_sel:.2f}", p_ar, p_bs,
             *(mean_sd_text(row.scores[metric], plus_minus) for metric in METRICS if metric != "BLEU"),
             ", ".join(f"{score:.2f}" for score in row.scores["BLEU"]), ", ".join(str(s) for s in row.seeds)]
    cells += [mean_sd_text(row.extra[title], plus_minus) if title in row.extra else missing for title in extra_titles]
    return cells


HEADERS = ["system", "BLEU", "Δ", "s_sel", "p (AR)", "p (paired bootstrap, per seed)", "chrF", "METEOR",
           "chrF++", "TER", "COMET", "BLEU per seed", "seeds"]


def _footnote(report: ReplicateReport, budget: str) -> str:
    seeds = sorted({len(row.seeds) for row in report.rows})
    count = " or ".join(map(str, seeds))
    return (f"{budget}; mean ± sd over {count} training seed(s) (optimizer replicates); Δ: mean BLEU minus "
            f"{report.baseline}'s over the seeds both have; s_sel: test-set bootstrap sd of BLEU "
            f"({report.settings['bootstrap_samples']} resamples) averaged over the seeds; p (AR): approximate "
            f"randomization over the replicates ({report.settings['ar_trials']} trials, MultEval, "
            f"Clark et al. 2011), † p<0.05, ‡ p<0.01; "
            f"p (paired bootstrap): sacreBLEU's, per seed in the order of 'seeds'. "
            f"BLEU {report.signatures.get('BLEU', '')}; chrF {report.signatures.get('chrF', '')}; "
            f"METEOR: {report.meteor_note}; chrF++ {report.signatures.get('chrF++', '')}; "
            f"TER (lower is better) {report.signatures.get('TER', '')}; COMET: {report.comet_note}.")


def markdown_table(report: ReplicateReport, budget: str) -> str:
    titles = report.extra_columns
    header = HEADERS + titles
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(report, row, " ± ", titles, "—")) + " |" for row in report.rows]
    return "\n".join(lines + ["", _footnote(report, budget)])


def _latex_escape(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                          ("$", r"\$"), ("{", r"\{"), ("}", r"\}"), ("±", r"$\pm$"), ("Δ", r"$\Delta$"),
                          ("†", r"$^\dagger$"), ("‡", r"$^\ddagger$"), ("—", "--")):
        text = text.replace(char, escaped)
    return text


def latex_table(report: ReplicateReport, budget: str) -> str:
    titles = report.extra_columns
    header = HEADERS + titles
    lines = [r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}", r"\hline",
             " & ".join(_latex_escape(h) for h in header) + r" \\", r"\hline"]
    lines += [" & ".join(_latex_escape(cell) for cell in _cells(report, row, " ± ", titles, "—")) + r" \\"
              for row in report.rows]
    lines += [r"\hline", r"\end{tabular}", "% " + _footnote(report, budget)]
    return "\n".join(lines) + "\n"


REPORT_EXTENSIONS = (".md", ".tex", ".json", ".png")  # what write_report writes for a table


def write_report(report: ReplicateReport, prefix: str, budget: str, title: str = "") -> str:
    """``prefix``.md/.tex/.json/.png, each written atomically; returns the Markdown table."""
    from mlmha_fairseq.evaluation.plotting import plot_replicates

    table = markdown_table(report, budget)
    write_text(prefix + ".md", (f"## {title}\n\n" if title else "") + table + "\n")
    write_text(prefix + ".tex", latex_table(report, budget))
    write_text(prefix + ".json", json.dumps(dict(report.as_dict(), budget=budget), indent=2,
                                                   ensure_ascii=False) + "\n")
    plot_replicates([row.name for row in report.rows], [row.scores["BLEU"] for row in report.rows], "BLEU",
                    title, prefix + ".png")
    return table
