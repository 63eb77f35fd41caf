r"""BLEU by source-length bucket for one or more systems, with counts per bucket.

Example (MLMHA/thesis En-De: subword counts, buckets [0,10) ... [50,inf))::

    python -m mlmha_fairseq.cli.length_buckets base.out m10.out --names Transformer M-10 \
        --source test.bpe.en --ref test.de --input-format generate
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.length_buckets import (
    CLOSED_SIDES,
    DEFAULT_EDGES,
    SUBWORD_NMT_SYMBOL,
    UNITS,
    bleu_by_length,
    make_buckets,
    source_lengths,
)
from mlmha_fairseq.evaluation.plotting import plot_length_buckets
from mlmha_fairseq.evaluation.scoring import load_hypotheses, load_references
from mlmha_fairseq.evaluation.text_io import read_lines, write_csv, write_json


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__, cli_support.protocols_epilog())
    parser.add_argument("systems", nargs="+", help="system files (plain text or fairseq-generate output)")
    parser.add_argument("--names", nargs="+", help="one name per system file")
    parser.add_argument("--source", required=True,
                        help="source file, one sentence per line; BPE-segmented for --unit subword")
    parser.add_argument("--unit", choices=UNITS, default="subword",
                        help="count subword tokens as given, or words after undoing BPE "
                             "(default: %(default)s)")
    parser.add_argument("--bpe-symbol", default=SUBWORD_NMT_SYMBOL,
                        help="BPE marker undone for --unit word (default: '%(default)s')")
    parser.add_argument("--edges", nargs="+", type=int, default=list(DEFAULT_EDGES),
                        help="bucket edges (default: %(default)s)")
    parser.add_argument("--closed", choices=CLOSED_SIDES, default="left",
                        help="left: [0,10),[10,20),...; right: [0,10],(10,20],... "
                             "(default: %(default)s)")
    cli_support.add_text_options(parser)
    cli_support.add_output_prefix(parser, "length_buckets")
    return parser


def length_buckets(parser, args) -> None:
    names = cli_support.system_names(parser, args.systems, args.names)
    protocol = cli_support.protocol_from_args(args)
    options = cli_support.text_options_from_args(args)
    systems = [(name, load_hypotheses(path, protocol, options)) for name, path in zip(names, args.systems)]
    generate_path = args.systems[0] if args.input_format == "generate" else None
    references = load_references(args.ref, generate_path, options)
    lengths = source_lengths(read_lines(args.source), args.unit, args.bpe_symbol)
    rows = bleu_by_length(lengths, references, systems, protocol, make_buckets(args.edges, args.closed))
    header = ["bucket", "count"] + names
    print("\t".join(header))
    for row in rows:
        print("\t".join([row["bucket"], str(row["count"])] + [f"{row[n]:.2f}" for n in names]))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"protocol": protocol.name, "unit": args.unit,
                                              "closed": args.closed, "rows": rows})
    plot_length_buckets(rows, names, protocol.metric.upper(), args.unit, args.output_prefix + ".png")


def main(argv=None) -> None:
    cli_support.run(build_parser(), length_buckets, argv)


if __name__ == "__main__":
    cli_support.command(main)
