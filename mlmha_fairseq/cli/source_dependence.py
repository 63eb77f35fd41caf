r"""How much each model uses its source: the validation NLL (bits per target token) of the
references given their own source and given another sentence's source, the gain between them,
and, for hypothesis files, how alike the outputs are (distinct lines, the largest group with
the same first words). Examples::

    python -m mlmha_fairseq.cli.source_dependence transformer.pt mlrf.pt --names Transformer MLRF \
        --data-bin corpus/data-bin --split valid --output-prefix results/source_dependence
    python -m mlmha_fairseq.cli.source_dependence mlrf.pt --data-bin corpus/data-bin \
        --hypotheses runs/mlrf/seed1/hypotheses.txt

writes ``PREFIX.json`` and ``PREFIX.csv`` (one row per model) and prints a table.
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.model_loading import load_model
from mlmha_fairseq.evaluation.source_dependence import (
    DEFAULT_MAX_TOKENS,
    PREFIX_WORDS,
    hypothesis_diversity,
    source_dependence,
)
from mlmha_fairseq.evaluation.text_io import InputError, read_lines, write_csv, write_json


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoints", nargs="+", help="fairseq checkpoints (translation task)")
    parser.add_argument("--names", nargs="+", help="one name per checkpoint")
    parser.add_argument("--data-bin", help="the data-bin to read the split from (default: the checkpoint's)")
    parser.add_argument("--split", default="valid", help="binarized split (default: %(default)s)")
    parser.add_argument("--hypotheses", nargs="+", default=[],
                        help="one plain-text hypothesis file per checkpoint, for the diversity columns "
                             "(default: none)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the derangements (default: %(default)s)")
    parser.add_argument("--max-tokens", type=cli_support.positive_int, default=DEFAULT_MAX_TOKENS,
                        help="tokens per batch (default: %(default)s)")
    cli_support.add_output_prefix(parser, "source_dependence")
    return parser


def run(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    if args.hypotheses and len(args.hypotheses) != len(args.checkpoints):
        parser.error(f"--hypotheses has {len(args.hypotheses)} files for {len(args.checkpoints)} checkpoints")
    rows = []
    for index, (name, checkpoint) in enumerate(zip(names, args.checkpoints)):
        model, task = load_model(checkpoint, args.data_bin)
        try:
            task.load_dataset(args.split)
        except FileNotFoundError as error:
            raise InputError(f"--split {args.split}: {error}") from error
        row = {"model": name, "checkpoint": checkpoint,
               **source_dependence(model, task, args.split, args.seed, args.max_tokens).as_dict()}
        if args.hypotheses:
            row.update(hypothesis_diversity(read_lines(args.hypotheses[index])))
        rows.append(row)
    header = "| model | NLL, own source | NLL, other source | gain (bits/token) |"
    lines = [header, "|---|---|---|---|"] + [
        f"| {row['model']} | {row['nll_true_bits_per_token']:.3f} | {row['nll_deranged_bits_per_token']:.3f} | "
        f"{row['gain_bits_per_token']:.3f} |" for row in rows]
    if args.hypotheses:
        lines[0] += f" distinct hypotheses | largest group, same first {PREFIX_WORDS} words |"
        lines[1] += "---|---|"
        for i, row in enumerate(rows, start=2):
            lines[i] += (f" {row['distinct']} of {row['hypotheses']} | "
                         f"{row[f'largest_same_first_{PREFIX_WORDS}_words']} ({row['that_prefix']!r}) |")
    print("\n".join(lines))
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"split": args.split, "seed": args.seed, "models": rows})


def main(argv=None) -> None:
    cli_support.run(build_parser(), run, argv)


if __name__ == "__main__":
    cli_support.command(main)
