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

Every comparison of a table (each system against the baseline, and a mechanism against its
budget-matched baseline, see :mod:`mlmha_fairseq.experiments.matching`) is one test of a
family: the p-values are adjusted for it by Holm's step-down method (Holm 1979), through
statsmodels' ``multipletests``, and the marks follow the adjusted ones. Each difference in
BLEU, chrF and COMET is given with the accuracy with which a difference of that size agrees
with human judgements of the system pair, from ``mt_thresholds`` (Kocmi et al. 2024,
"Navigating the Metrics Maze: Reconciling Score Magnitudes and Accuracies").
"""
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlmha_fairseq.evaluation.comet import NOT_GIVEN as COMET_NOT_GIVEN
from mlmha_fairseq.evaluation.comet import Comet, comet_signature, thresholds_metric
from mlmha_fairseq.evaluation.meteor import UNAVAILABLE, WordNet, corpus_meteor, load_wordnet
from mlmha_fairseq.evaluation.scoring import Protocol, build_metric, corpus_score, resolve_protocol
from mlmha_fairseq.evaluation.significance import (
    DEFAULT_AR_TRIALS, DEFAULT_SAMPLES, DEFAULT_SEED, _sacrebleu_seed, sacrebleu_paired, sentence_statistics,
    significance_mark,
)
from mlmha_fairseq.evaluation.text_io import write_text

METRICS = ("BLEU", "chrF", "METEOR", "chrF++", "TER", "COMET")
SACREBLEU_PROTOCOLS = {"BLEU": "sacrebleu", "chrF": "chrf", "chrF++": "chrf++", "TER": "ter"}
# the differences given with the human accuracy of Kocmi et al. 2024 (mt_thresholds' names;
# COMET's depends on the model: :func:`~mlmha_fairseq.evaluation.comet.thresholds_metric`)
ACCURACY_METRICS = {"BLEU": "bleu", "chrF": "chrf", "COMET": None}
# what the runner measures of each run's training (:func:`mlmha_fairseq.experiments.grid.training_costs`)
COST_COLUMNS = ("params", "train time (s)", "tokens/s")


def holm(p_values: Sequence[float]) -> List[float]:
    """Holm-Bonferroni adjusted p-values (Holm 1979) of one family of tests, by statsmodels'
    ``multipletests(method="holm")``: the k-th smallest of m p-values times (m - k + 1), made
    monotone and capped at 1. Holm controls the family-wise error rate as Bonferroni does,
    without assuming the tests independent, and rejects at least as often."""
    if not p_values:
        return []
    from statsmodels.stats.multitest import multipletests

    return [float(p) for p in multipletests(list(p_values), method="holm")[1]]


def human_accuracy(delta: Optional[float], metric: Optional[str]) -> Optional[float]:
    """The estimated accuracy (%) with which a metric difference of ``delta`` agrees with human
    judgements of which of two systems is better (Kocmi et al. 2024, ``mt_thresholds.accuracy``;
    ``metric`` is mt_thresholds' name, e.g. ``bleu``, ``chrf``, ``comet22``). The model is fitted
    on absolute differences: the sign of ``delta`` says which system the metric prefers, the
    accuracy how often humans agree. None without a difference or for a metric mt_thresholds
    does not know."""
    if delta is None or metric is None:
        return None
    import mt_thresholds

    if metric not in mt_thresholds.METRICS:
        return None
    return float(mt_thresholds.accuracy(abs(delta), metric))


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
    ar_p_holm: Optional[float] = None  # ar_p_value adjusted over the table's comparisons (Holm)
    costs: Dict[str, List[Optional[float]]] = field(default_factory=dict)  # COST_COLUMNS title -> per seed

    def summary(self, metric: str) -> Tuple[Optional[float], Optional[float]]:
        values = self.scores[metric]
        if not values or any(value is None for value in values):
            return None, None
        return mean_sd(values)

    def mean_over(self, seeds: Sequence[int], metric: str) -> Optional[float]:
        """Mean ``metric`` over ``seeds`` (a subset of this row's); None where it is unavailable."""
        values = [score for seed, score in zip(self.seeds, self.scores[metric]) if seed in seeds]
        if not values or any(value is None for value in values):
            return None
        return mean_sd(values)[0]

    def delta(self, baseline: "SystemRow", metric: str = "BLEU", seeds: Optional[Sequence[int]] = None
              ) -> Optional[float]:
        """Mean ``metric`` minus the baseline's over the seeds both have (``seeds``, by default
        the runs the AR test against the baseline pairs): while a grid is partial, a system with
        fewer seeds is not compared with the baseline's other seeds. None without a shared seed
        (or a value of the metric)."""
        seeds = self.ar_seeds if seeds is None else seeds
        if not seeds:
            return None
        mine, theirs = self.mean_over(seeds, metric), baseline.mean_over(seeds, metric)
        return None if mine is None or theirs is None else mine - theirs


@dataclass
class Comparison:
    """One test of the table's family: ``system`` against ``against`` (the baseline, or a
    mechanism's budget-matched baseline) over the seeds both have."""

    system: str
    against: str
    seeds: List[int]
    p_value: float  # approximate randomization over the replicates, BLEU
    deltas: Dict[str, Optional[float]]  # ACCURACY_METRICS -> mean difference over ``seeds``
    accuracy: Dict[str, Optional[float]]  # ACCURACY_METRICS -> human accuracy (%) of that difference
    p_holm: Optional[float] = None  # adjusted over the table's comparisons

    @property
    def mark(self) -> str:
        return significance_mark(self.p_holm if self.p_holm is not None else self.p_value)


@dataclass
class ReplicateReport:
    baseline: str
    rows: List[SystemRow]
    signatures: Dict[str, str]
    meteor_note: str
    settings: Dict
    extra_columns: List[str] = field(default_factory=list)  # titles of the extra columns, in order
    comet_note: str = COMET_NOT_GIVEN
    comparisons: List[Comparison] = field(default_factory=list)  # the family Holm adjusts over
    cost_columns: List[str] = field(default_factory=list)  # COST_COLUMNS shown (the runner's)
    comet_metric: Optional[str] = None  # mt_thresholds' name of the COMET model, if it has one
    named_pairs: bool = False  # the family has pairs the grid names (build_report's ``pairs``)

    def as_dict(self) -> Dict:
        rows = []
        for row in self.rows:
            record = asdict(row)
            record["mean"] = {metric: row.summary(metric)[0] for metric in METRICS}
            record["sd"] = {metric: row.summary(metric)[1] for metric in METRICS}
            record["mark"] = _row_mark(row)
            rows.append(record)
        comparisons = [dict(asdict(comparison), mark=comparison.mark) for comparison in self.comparisons]
        return {"baseline": self.baseline, "systems": rows, "comparisons": comparisons,
                "multiple_comparisons": f"Holm-Bonferroni over the {len(self.comparisons)} comparisons "
                                        "(statsmodels multipletests, method='holm'); marks follow p_holm",
                "human_accuracy": ACCURACY_NOTE, "signatures": self.signatures,
                "meteor": self.meteor_note, "comet": self.comet_note, "settings": self.settings}


ACCURACY_NOTE = ("estimated accuracy (%) with which a difference of this size agrees with human judgements "
                 "(Kocmi et al. 2024, mt_thresholds.accuracy of |Δ|)")


def _row_mark(row: SystemRow) -> str:
    """The row's mark against the baseline: from its Holm-adjusted p-value (its raw one in a
    report of earlier versions, which had none)."""
    p_value = row.ar_p_holm if row.ar_p_holm is not None else row.ar_p_value
    return "" if p_value is None else significance_mark(p_value)


def compare(system: SystemRow, against: SystemRow, seeds: Sequence[int], p_value: float,
            comet_metric: Optional[str]) -> Comparison:
    """The comparison of ``system`` with ``against`` over ``seeds``: its differences and their
    human accuracy (Kocmi et al. 2024); ``p_value`` is the AR test's."""
    deltas = {metric: system.delta(against, metric, seeds) for metric in ACCURACY_METRICS}
    names = dict(ACCURACY_METRICS, COMET=comet_metric)
    return Comparison(system.name, against.name, list(seeds), p_value, deltas,
                      {metric: human_accuracy(delta, names[metric]) for metric, delta in deltas.items()})


def build_report(systems: Sequence[Tuple[str, Dict[int, List[str]]]], references: Sequence[Sequence[str]],
                 options: Optional[ReplicateOptions] = None, wordnet: Optional[WordNet] = None,
                 extra: Optional[Dict[str, Dict[str, Dict[int, float]]]] = None,
                 comet: Optional[Comet] = None, sources: Optional[Sequence[str]] = None,
                 matched: Optional[Dict[str, str]] = None,
                 costs: Optional[Dict[str, Dict[int, Dict[str, Optional[float]]]]] = None,
                 pairs: Sequence[Tuple[str, str]] = ()) -> ReplicateReport:
    """Scores, s_sel and tests of ``systems`` = [(name, {seed: hypotheses})], the first the
    baseline. ``extra`` = {column: {system: {seed: value}}} is carried into the tables.
    ``comet``: a COMET model, which reads ``sources`` and the first reference stream.
    ``matched`` = {system: its budget-matched baseline}: each such system is also compared with
    that one (both among ``systems``); ``pairs`` = [(system, against)]: further comparisons the
    grid names (an experiment config's ``comparisons``). ``costs`` = {system: {seed:
    {COST_COLUMNS title: value}}}: the training measures of each run, columns of the tables.
    Every comparison's p-value is also given Holm-adjusted over all of them."""
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
        if costs is not None:
            row.costs = {title: [costs.get(name, {}).get(seed, {}).get(title) for seed in seeds]
                         for title in COST_COLUMNS}
        rows.append(row)
    comet_metric = None if comet is None else thresholds_metric(comet.directory)
    by_name = {row.name: row for row in rows}
    comparisons = [compare(row, rows[0], row.ar_seeds, row.ar_p_value, comet_metric)
                   for row in rows[1:] if row.ar_p_value is not None]
    for name, reference in [*(matched or {}).items(), *pairs]:
        if name not in by_name or reference not in by_name:
            continue  # a partial grid: one of the two has no finished run yet
        system, against = by_name[name], by_name[reference]
        shared = [seed for seed in system.seeds if seed in against.seeds]
        if shared:
            runs = dict(systems)
            p_value = replicate_ar_p_value([runs[reference][s] for s in shared], [runs[name][s] for s in shared],
                                           references, bleu, options.ar_trials, options.seed)
            comparisons.append(compare(system, against, shared, p_value, comet_metric))
    for comparison, adjusted in zip(comparisons, holm([c.p_value for c in comparisons])):
        comparison.p_holm = adjusted
        if comparison.against == baseline_name:
            by_name[comparison.system].ar_p_holm = adjusted
    meteor_note = ("nltk meteor_score (exact, stem, WordNet 3.0 synonyms; no paraphrases), mean sentence score x 100"
                   if wordnet.reader is not None else f"{UNAVAILABLE}: {wordnet.reason}")
    comet_note = (COMET_NOT_GIVEN if comet is None
                  else f"unbabel-comet, model {comet.directory} ({comet_signature(comet.directory)}), system score "
                       "(mean segment score) x 100")
    return ReplicateReport(baseline_name, rows, signatures, meteor_note, asdict(options), list(extra or {}),
                           comet_note, comparisons, list(COST_COLUMNS) if costs is not None else [], comet_metric,
                           bool(pairs))


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
    mark = "" if is_baseline else _row_mark(row)
    difference = None if is_baseline else row.delta(baseline)
    delta = "" if difference is None else f"{difference:+.2f}"
    p_ar = "" if is_baseline or row.ar_p_value is None else f"{row.ar_p_value:.3f}"
    p_holm = "" if is_baseline or row.ar_p_holm is None else f"{row.ar_p_holm:.3f}"
    p_bs = "" if is_baseline else ", ".join(f"{row.bootstrap_p_values[s]:.3f}" for s in row.ar_seeds)
    cells = [row.name, bleu + mark, delta, f"{row.s_sel:.2f}", p_ar, p_holm, p_bs,
             *(mean_sd_text(row.scores[metric], plus_minus) for metric in METRICS if metric != "BLEU"),
             ", ".join(f"{score:.2f}" for score in row.scores["BLEU"]), ", ".join(str(s) for s in row.seeds)]
    cells += [mean_sd_text(row.extra[title], plus_minus) if title in row.extra else missing for title in extra_titles]
    cells += [_cost_text(title, row.costs.get(title, []), plus_minus, missing) for title in report.cost_columns]
    return cells


def _cost_text(title: str, values: Sequence[Optional[float]], plus_minus: str, missing: str) -> str:
    """A training measure over the seeds: the parameter count once (the same for every seed),
    seconds and tokens/s as whole numbers, mean ± sd."""
    known = [value for value in values if value is not None]
    if not known:
        return missing
    if title == "params":
        counts = sorted({int(value) for value in known})
        return " / ".join(f"{count:,}" for count in counts)
    mean, sd = mean_sd(known)
    return f"{mean:,.0f}" if sd is None else f"{mean:,.0f}{plus_minus}{sd:,.0f}"


HEADERS = ["system", "BLEU", "Δ", "s_sel", "p (AR)", "p (Holm)", "p (paired bootstrap, per seed)", "chrF", "METEOR",
           "chrF++", "TER", "COMET", "BLEU per seed", "seeds"]


def _footnote(report: ReplicateReport, budget: str) -> str:
    seeds = sorted({len(row.seeds) for row in report.rows})
    count = " or ".join(map(str, seeds))
    costs = (" params: trained parameters as fairseq-train counts them (its log's \"num. shared model params\"); "
             "train time: seconds of fairseq-train (its \"done training in\", summed over the attempts of a "
             "resumed run), tokens/s: fairseq's wps (target tokens per second) averaged over its log lines; "
             "mean ± sd over the seeds."
             if report.cost_columns else "")
    return (f"{budget}; mean ± sd over {count} training seed(s) (optimizer replicates); Δ: mean BLEU minus "
            f"{report.baseline}'s over the seeds both have; s_sel: test-set bootstrap sd of BLEU "
            f"({report.settings['bootstrap_samples']} resamples) averaged over the seeds; p (AR): approximate "
            f"randomization over the replicates ({report.settings['ar_trials']} trials, MultEval, "
            f"Clark et al. 2011); p (Holm): p (AR) adjusted by Holm-Bonferroni over the "
            f"{len(report.comparisons)} comparison(s) of this report (statsmodels multipletests; Holm 1979); "
            f"† p<0.05, ‡ p<0.01 from the Holm-adjusted p; "
            f"p (paired bootstrap): sacreBLEU's, per seed in the order of 'seeds'. "
            f"BLEU {report.signatures.get('BLEU', '')}; chrF {report.signatures.get('chrF', '')}; "
            f"METEOR: {report.meteor_note}; chrF++ {report.signatures.get('chrF++', '')}; "
            f"TER (lower is better) {report.signatures.get('TER', '')}; COMET: {report.comet_note}.{costs}")


COMPARISON_HEADERS = ["system", "against", "seeds", "Δ BLEU", "human acc. (BLEU)", "Δ chrF", "human acc. (chrF)",
                      "Δ COMET", "human acc. (COMET)", "p (AR)", "p (Holm)"]


def _comparison_cells(comparison: Comparison) -> List[str]:
    cells = [comparison.system, comparison.against, ", ".join(map(str, comparison.seeds))]
    for metric in ACCURACY_METRICS:
        delta, accuracy = comparison.deltas.get(metric), comparison.accuracy.get(metric)
        cells += ["n/a" if delta is None else f"{delta:+.2f}", "n/a" if accuracy is None else f"{accuracy:.0f}%"]
    cells += [f"{comparison.p_value:.3f}", "" if comparison.p_holm is None else f"{comparison.p_holm:.3f}{comparison.mark}"]
    return cells


def _comparison_footnote(report: ReplicateReport) -> str:
    comet = (f"COMET as mt_thresholds' {report.comet_metric}" if report.comet_metric else
             "COMET n/a (no COMET model given, or one mt_thresholds has no thresholds for)")
    others = ("a mechanism against its budget-matched baseline, and each pair the grid names" if report.named_pairs
              else "and a mechanism against its budget-matched baseline")
    return (f"Every comparison of the table, the family of the Holm adjustment: each system against "
            f"{report.baseline}, {others}. Δ: mean difference over "
            f"the seeds both have; human acc.: {ACCURACY_NOTE} ({comet}); p (AR) and p (Holm) as above, "
            f"† p<0.05, ‡ p<0.01 from the Holm-adjusted p.")


def markdown_table(report: ReplicateReport, budget: str) -> str:
    """The table of the systems with its footnote, then (when there is any) the table of the
    comparisons with theirs."""
    titles = report.extra_columns
    header = HEADERS + titles + report.cost_columns
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(report, row, " ± ", titles, "—")) + " |" for row in report.rows]
    lines += ["", _footnote(report, budget)]
    if report.comparisons:
        lines += ["", "| " + " | ".join(COMPARISON_HEADERS) + " |", "|" + "---|" * len(COMPARISON_HEADERS)]
        lines += ["| " + " | ".join(_comparison_cells(c)) + " |" for c in report.comparisons]
        lines += ["", _comparison_footnote(report)]
    return "\n".join(lines)


def _latex_escape(text: str) -> str:
    for char, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                          ("$", r"\$"), ("{", r"\{"), ("}", r"\}"), ("±", r"$\pm$"), ("Δ", r"$\Delta$"),
                          ("†", r"$^\dagger$"), ("‡", r"$^\ddagger$"), ("—", "--")):
        text = text.replace(char, escaped)
    return text


def _latex_tabular(header: Sequence[str], rows: Sequence[Sequence[str]], footnote: str) -> List[str]:
    lines = [r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}", r"\hline",
             " & ".join(_latex_escape(h) for h in header) + r" \\", r"\hline"]
    lines += [" & ".join(_latex_escape(cell) for cell in row) + r" \\" for row in rows]
    return lines + [r"\hline", r"\end{tabular}", "% " + footnote]


def latex_table(report: ReplicateReport, budget: str) -> str:
    titles = report.extra_columns
    lines = _latex_tabular(HEADERS + titles + report.cost_columns,
                           [_cells(report, row, " ± ", titles, "—") for row in report.rows], _footnote(report, budget))
    if report.comparisons:
        lines += [""] + _latex_tabular(COMPARISON_HEADERS, [_comparison_cells(c) for c in report.comparisons],
                                       _comparison_footnote(report))
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
