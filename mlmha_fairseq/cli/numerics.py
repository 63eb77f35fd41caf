r"""Float16 headroom of checkpoints on real batches: per module the largest |activation|,
|gradient| and |parameter gradient| against float16's largest value (65,504) and the smallest
nonzero |activation| against its smallest subnormal (2^-24); per layer the gradient norm.

The training loss is the checkpoint's own criterion, teacher-forced, on batches of a
binarized split (see mlmha_fairseq.evaluation.numerics for what each number is). Example, a
checkpoint of an --fp16 run that stopped at the minimum loss scale beside the Transformer's::

    python -m mlmha_fairseq.cli.numerics mlrf/checkpoint_last.pt transformer/checkpoint_last.pt \
        --names mlrf transformer --data-bin data-bin --split valid --max-batches 20 \
        --output-prefix results/numerics

writes PREFIX.csv (one row per checkpoint and module), PREFIX.json (the modules and the
gradient norm per layer) and PREFIX.png (headroom per module, gradient norm per layer).

A save directory instead of a checkpoint stands for a run's series: its update checkpoints
(checkpoint_EPOCH_UPDATE.pt, kept with --keep-interval-updates -1) in update order, and
PREFIX-over-training.png draws each run's least headroom against the updates::

    python -m mlmha_fairseq.cli.numerics mlrf/checkpoints transformer/checkpoints \
        --names mlrf transformer --data-bin data-bin --output-prefix results/numerics
"""
import os
from typing import Dict, List, Tuple

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.checkpoint_averaging import CHECKPOINT_PATTERNS
from mlmha_fairseq.evaluation.model_loading import load_model_and_state, trained_updates
from mlmha_fairseq.evaluation.numerics import (
    FP16_MAX, FP16_SMALLEST_SUBNORMAL, Numerics, plot_headroom_over_training, plot_numerics, probe_numerics,
)
from mlmha_fairseq.evaluation.source_dependence import DEFAULT_MAX_TOKENS
from mlmha_fairseq.evaluation.text_io import InputError, write_csv, write_json

DEFAULT_SPLIT = "valid"
DEFAULT_MAX_BATCHES = 10


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("checkpoints", nargs="+",
                        help="fairseq checkpoints of this package's models, or save directories (a run's "
                             "update checkpoints, probed in update order)")
    parser.add_argument("--names", nargs="+", help="one name per checkpoint or directory (default: the file "
                                                   "names)")
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


def interval_checkpoints(directory: str) -> List[str]:
    """A save directory's update checkpoints (``checkpoint_EPOCH_UPDATE.pt``) in update order."""
    from fairseq.checkpoint_utils import checkpoint_paths

    newest_first = checkpoint_paths(directory, CHECKPOINT_PATTERNS["update"])
    if not newest_first:
        raise InputError(f"{directory}: no update checkpoints (checkpoint_EPOCH_UPDATE.pt, kept by fairseq-train's "
                         "--save-interval-updates N --keep-interval-updates -1)")
    return list(reversed(newest_first))


def probe_checkpoint(args, name: str, checkpoint: str) -> Tuple[Numerics, Dict]:
    """The probe of one checkpoint and its JSON entry; prints the least headroom."""
    model, task, state = load_model_and_state(checkpoint, args.data_bin)
    criterion = task.build_criterion(state["cfg"]["criterion"])
    probed = probe_numerics(model, criterion, samples(task, args.split, args.max_tokens), args.max_batches)
    update = trained_updates(state)
    least = probed.least_headroom()
    print(f"{name} (update {update}): {probed.batches} batches; least float16 headroom: {least['module']} "
          f"(activation {_bits(least['activation_headroom_log2'])}, gradient "
          f"{_bits(least['gradient_headroom_log2'])}, parameter gradient "
          f"{_bits(least['parameter_gradient_headroom_log2'])})", flush=True)
    return probed, {"checkpoint": checkpoint, "update": update, "batches": probed.batches,
                    "modules": probed.module_rows(), "layer_gradient_norms": probed.layer_rows()}


def numerics(parser, args) -> None:
    names = cli_support.system_names(parser, args.checkpoints, args.names)
    checkpoints = {name: interval_checkpoints(path) if os.path.isdir(path) else [path]
                   for name, path in zip(names, args.checkpoints)}
    rows, results, models, series = [], {}, {}, {}
    for name, path in zip(names, args.checkpoints):
        probes = [probe_checkpoint(args, name, checkpoint) for checkpoint in checkpoints[name]]
        rows.extend(dict(model=name, **row, update=result["update"]) for _probed, result in probes
                    for row in result["modules"])
        if os.path.isdir(path):
            results[name] = {"run": path, "checkpoints": [result for _probed, result in probes]}
            series[name] = [(result["update"], probed) for probed, result in probes]
        else:
            models[name], results[name] = probes[0]
    write_csv(args.output_prefix + ".csv", rows)
    write_json(args.output_prefix + ".json", {"split": args.split, "fp16_max": FP16_MAX,
                                              "fp16_smallest_subnormal": FP16_SMALLEST_SUBNORMAL,
                                              "models": results})
    if models:
        plot_numerics(models, args.output_prefix + ".png")
    if series:
        plot_headroom_over_training(series, args.output_prefix + "-over-training.png")


def _bits(headroom) -> str:
    return "none recorded" if headroom is None else f"{headroom:.1f} bits"


def main(argv=None) -> None:
    cli_support.run(build_parser(), numerics, argv)


if __name__ == "__main__":
    cli_support.command(main)
