r"""Paired significance tests of systems against a baseline, with a daggered results table.

Example::

    python -m mlmha_fairseq.cli.significance base.out m00.out m01.out \
        --names Transformer M-00 M-01 --input-format generate --protocol sacrebleu \
        --ref newstest2014.de --methods thesis compare-mt sacrebleu-bs
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.plotting import plot_significance
from mlmha_fairseq.evaluation.scoring import load_hypotheses, load_references
from mlmha_fairseq.evaluation.significance import (
    COMPARE_MT_SAMPLE_RATIO,
    DEFAULT_AR_TRIALS,
    DEFAULT_SAMPLES,
    DEFAULT_SEED,
    METHODS,
    THESIS_SAMPLE_SIZE,
    SignificanceOptions,
    compare_systems,
    significance_mark,
)
from mlmha_fairseq.evaluation.replicates import holm
from mlmha_fairseq.evaluation.text_io import write_csv, write_json

METHOD_HELP = """methods:
  thesis        thesis §3.3.2: N resamples of --sample-size pairs, p = 1 - win rate
  compare-mt    compare-mt's paired bootstrap (--sample-ratio of the test set), its BLEU
  sacrebleu-bs  sacreBLEU --paired-bs (Moses bootstrap-hypothesis-difference-significance)
  sacrebleu-ar  sacreBLEU --paired-ar (approximate randomization, --ar-trials)
marks: ‡ p < 0.01, † p < 0.05 (from --mark-method; with several systems, from its
  Holm-Bonferroni adjusted p-values over the systems, the column p (Holm))"""


def build_parser():
    epilog = METHOD_HELP + "\n\n" + cli_support.protocols_epilog()
    parser = cli_support.make_parser(__spec__.name, __doc__, epilog)
    parser.add_argument("systems", nargs="+",
                        help="system files, the BASELINE FIRST (plain text or fairseq-generate output)")
    parser.add_argument("--names", nargs="+", help="one name per system file")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["thesis"],
                        help="tests to run (default: thesis)")
    parser.add_argument("--mark-method", choices=METHODS,
                        help="method whose p-values give the daggers (default: the first of --methods)")
    parser.add_argument("--n-samples", type=cli_support.positive_int, default=DEFAULT_SAMPLES,
                        help="bootstrap resamples (default: %(default)s)")
    parser.add_argument("--sample-size", type=int, default=THESIS_SAMPLE_SIZE,
                        help="sentences per resample, thesis method (default: %(default)s)")
    parser.add_argument("--sample-ratio", type=float, default=COMPARE_MT_SAMPLE_RATIO,
                        help="fraction of the test set per resample, compare-mt (default: %(default)s)")
    parser.add_argument("--ar-trials", type=cli_support.positive_int, default=DEFAULT_AR_TRIALS,
                        help="approximate randomization trials (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed (default: %(default)s)")
    cli_support.add_text_options(parser)
    cli_support.add_output_prefix(parser, "significance")
    return parser


def holm_by_method(results):
    """{(system, method): p} adjusted by Holm-Bonferroni (Holm 1979, statsmodels' multipletests)
    over the systems each method compares with the baseline: one family per method, as each
    method is one way of asking the same questions."""
    adjusted = {}
    for method in dict.fromkeys(r.method for r in results):
        tested = [r for r in results if r.method == method]
        adjusted.update({(r.system, method): p for r, p in zip(tested, holm([r.p_value for r in tested]))})
    return adjusted


def _table(names, results, methods, mark_method, metric, adjusted=None):
    """The daggered table; with ``adjusted`` (several systems) a column p (Holm) of the mark
    method's adjusted p-values, which then give the marks."""
    by_key = {(r.system, r.method): r for r in results}
    first = by_key[(names[1], methods[0])]
    header = ["System", metric.upper(), "Δ"] + [f"p ({m})" for m in methods]
    header += [f"p (Holm, {mark_method})"] if adjusted else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines.append("| " + " | ".join([names[0], f"{first.baseline_score:.2f}", ""] + [""] * (len(header) - 3)) + " |")
    for name in names[1:]:
        marked = by_key[(name, mark_method)]
        mark = significance_mark(adjusted[(name, mark_method)]) if adjusted else marked.mark
        cells = [name, f"{marked.score:.2f}{mark}", f"{marked.delta:+.2f}"]
        cells += [f"{by_key[(name, m)].p_value:.4f}" for m in methods]
        cells += [f"{adjusted[(name, mark_method)]:.4f}"] if adjusted else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def significance(parser, args) -> None:
    if len(args.systems) < 2:
        parser.error("give a baseline and at least one system")
    names = cli_support.system_names(parser, args.systems, args.names)
    methods = list(dict.fromkeys(args.methods))
    mark_method = args.mark_method or methods[0]
    if mark_method not in methods:
        methods.append(mark_method)
    protocol = cli_support.protocol_from_args(args)
    options = cli_support.text_options_from_args(args)
    hyps = [load_hypotheses(path, protocol, options) for path in args.systems]
    generate_path = args.systems[0] if args.input_format == "generate" else None
    references = load_references(args.ref, generate_path, options)
    settings = SignificanceOptions(args.n_samples, args.sample_size, args.sample_ratio,
                                   args.ar_trials, args.seed)
    results, _samples = compare_systems(hyps[0], list(zip(names[1:], hyps[1:])), references,
                                        protocol, methods, settings)
    adjusted = holm_by_method(results) if len(names) > 2 else None
    print(_table(names, results, methods, mark_method, protocol.metric, adjusted))
    rows = [dict(r.as_row(), baseline=names[0], protocol=protocol.name) for r in results]
    if adjusted:
        for row in rows:
            row.update(p_holm=adjusted[(row["system"], row["method"])],
                       mark=significance_mark(adjusted[(row["system"], row["method"])]))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"protocol": protocol.name, "baseline": names[0],
                                              "results": rows})
    marked = [r for r in results if r.method == mark_method]
    baseline_score = marked[0].baseline_score
    plot_significance(names, [baseline_score] + [r.score for r in marked],
                      [None] + [None if r.ci_low is None else (r.ci_low, r.ci_high) for r in marked],
                      [""] + [significance_mark(adjusted[(r.system, r.method)]) if adjusted else r.mark
                              for r in marked], protocol.metric.upper(), mark_method,
                      args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), significance, argv)


if __name__ == "__main__":
    cli_support.command(main)
