r"""Float16 headroom of checkpoints on real batches: per module the largest |activation| and
|gradient| against float16's largest value (65,504) and the smallest nonzero |activation|
against its smallest subnormal (2^-24); per layer the gradient norm.

The training loss is the checkpoint's own criterion, teacher-forced, on batches of a
binarized split (see mlmha_fairseq.evaluation.numerics for what each number is). Example, a
checkpoint of an --fp16 run that stopped at the minimum loss scale beside the Transformer's::

    python -m mlmha_fairseq.cli.numerics mlrf/checkpoint_last.pt transformer/checkpoint_last.pt \
        --names mlrf transformer --data-bin data-bin --split valid --max-batches 20 \
        --output-prefix results/numerics

writes PREFIX.csv (one row per checkpoint and module), PREFIX.json (the modules and the
gradient norm per layer) and PREFIX.png (headroom per module, gradient norm per layer).
"""
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.model_loading import load_model_and_state
from mlmha_fairseq.evaluation.numerics import (
    FP16_MAX, FP16_SMALLEST_SUBNORMAL, plot_numerics, probe_numerics,
)
from mlmha_fairseq.evaluation.source_dependence import DEFAULT_MAX_TOKENS
from mlmha_fairseq.evaluation.text_io import InputError, write_csv, write_json

DEFAULT_SPLIT = "valid"
DEFAULT_MAX_BATCHES = 10


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoints", nargs="+", help="fairseq checkpoints of this package's models")
    parser.add_argument("--names", nargs="+", help="one name per checkpoint (default: the file names)")
    parser.add_argument("--data-bin", help="binarized data directory with the dictionaries and --split "
                                           "(default: the one stored in the checkpoint)")
    parser.add_argument("--split", default=DEFAULT_SPLIT, help="the split whose batches are probed "
                                                               "(default: %(default)s)")
    parser.add_argument("--max-batches", type=cli_support.positive_int, default=DEFAULT_MAX_BATCHES,
                        help="probe at most N batches, in the split's order (default: %(default)s)")
    parser.add_argument("--max-tokens", type=cli_support.positive_int, default=DEFAULT_MAX_TOKENS,
                        help="tokens per batch, as fairseq-train's --max-tokens (default: %(default)s)")
    cli_support.add_output_prefix(parser, "numerics")
    return parser


def samples(task, split: str, max_tokens: int):
    """The split's batches as fairseq-train builds them (by length), in a fixed order."""
    try:
        task.load_dataset(split)
    except FileNotFoundError as error:
        raise InputError(f"--split {split}: {error}") from error
    return task.get_batch_iterator(dataset=task.dataset(split), max_tokens=max_tokens, required_batch_size_multiple=1,
                                   ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)


def numerics(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    rows, results, models = [], {}, {}
    for name, checkpoint in zip(names, args.checkpoints):
        model, task, state = load_model_and_state(checkpoint, args.data_bin)
        criterion = task.build_criterion(state["cfg"]["criterion"])
        probed = probe_numerics(model, criterion, samples(task, args.split, args.max_tokens), args.max_batches)
        models[name] = probed
        rows.extend(dict(model=name, **row) for row in probed.module_rows())
        results[name] = {"checkpoint": checkpoint, "batches": probed.batches, "modules": probed.module_rows(),
                         "layer_gradient_norms": probed.layer_rows()}
        least = probed.least_headroom()
        print(f"{name}: {probed.batches} batches; least float16 headroom: {least['module']} (activation "
              f"{_bits(least['activation_headroom_log2'])}, gradient {_bits(least['gradient_headroom_log2'])})")
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"split": args.split, "fp16_max": FP16_MAX,
                                              "fp16_smallest_subnormal": FP16_SMALLEST_SUBNORMAL,
                                              "models": results})
    plot_numerics(models, args.output_prefix + ".png")


def _bits(headroom) -> str:
    return "none recorded" if headroom is None else f"{headroom:.1f} bits"


def main(argv=None) -> None:
    cli_support.run(build_parser(), numerics, argv)


if __name__ == "__main__":
    cli_support.command(main)
