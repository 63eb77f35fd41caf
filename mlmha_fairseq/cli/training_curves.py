"""Training and validation curves (e.g. accuracy, MLRF paper Figure 4) from fairseq-train logs.

Train with ``--log-format json`` (and, for accuracy, ``--criterion label_smoothed_cross_entropy
--label-smoothing 0 --report-accuracy``), keep the log (``--log-file`` or the captured
output), then::

    python -m mlmha_fairseq.cli.training_curves baseline.log both_fnn_sa.log \
        --names Transformer Both-FNN-SA --output-prefix results/accuracy
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.plotting import plot_training_curves
from mlmha_fairseq.evaluation.text_io import write_csv, write_json
from mlmha_fairseq.evaluation.training_curves import X_AXES, read_log_curves


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", help="fairseq-train logs written with --log-format json")
    parser.add_argument("--names", nargs="+", help="one name per log")
    parser.add_argument("--stat", default="accuracy",
                        help="the logged statistic to plot, e.g. accuracy, loss, nll_loss, ppl "
                             "(default: %(default)s)")
    parser.add_argument("--x-axis", choices=X_AXES, default="updates",
                        help="against update steps (training values of every --log-interval, "
                             "as Figure 4) or epochs (the epoch summaries) (default: %(default)s)")
    cli_support.add_output_prefix(parser, "training_curves")
    return parser


def training_curves(parser, args) -> None:
    names = cli_support.system_names(parser, args.logs, args.names)
    runs = {name: read_log_curves(path, args.stat, args.x_axis) for name, path in zip(names, args.logs)}
    rows = [{"run": name, "split": split, args.x_axis: x, args.stat: value}
            for name, curves in runs.items() for split, points in curves.items()
            for x, value in points]
    for name, curves in runs.items():
        last = {split: points[-1] for split, points in curves.items() if points}
        print(name + "".join(f"\t{split} at {x:g} {args.x_axis}: {value:g}"
                             for split, (x, value) in last.items()))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"stat": args.stat, "x_axis": args.x_axis, "runs": runs})
    plot_training_curves(runs, args.stat, args.x_axis, args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), training_curves, argv)


if __name__ == "__main__":
    cli_support.command(main)
