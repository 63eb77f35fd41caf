r"""Average the parameters of fairseq checkpoints (this package's models included).

Examples::

    python -m mlmha_fairseq.cli.average_checkpoints --inputs ck/checkpoint9.pt ck/checkpoint10.pt \
        --output ck/averaged.pt
    python -m mlmha_fairseq.cli.average_checkpoints --input-dir ck --num-epoch-checkpoints 10 \
        --output ck/checkpoint_last10_avg.pt
"""
import logging

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.checkpoint_averaging import (
    average_checkpoints,
    last_checkpoints,
    save_checkpoint,
)
from mlmha_fairseq.output_files import refuse_overwriting_inputs

logger = logging.getLogger(__name__)


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--inputs", nargs="+", help="checkpoint files; non-parameter entries are "
                                                    "taken from the last one")
    source.add_argument("--input-dir", help="directory of checkpointN.pt / checkpoint_E_U.pt files")
    count = parser.add_mutually_exclusive_group()
    count.add_argument("--num-epoch-checkpoints", type=int,
                       help="with --input-dir: average the last N epoch checkpoints")
    count.add_argument("--num-update-checkpoints", type=int,
                       help="with --input-dir: average the last N update checkpoints")
    parser.add_argument("--checkpoint-upper-bound", type=int,
                        help="with --input-dir: ignore checkpoints after this epoch/update")
    parser.add_argument("--output", required=True, help="averaged checkpoint to write")
    return parser


def _paths(parser, args):
    if args.inputs:
        return args.inputs
    if args.num_epoch_checkpoints is not None:
        return last_checkpoints(args.input_dir, args.num_epoch_checkpoints, "epoch",
                                args.checkpoint_upper_bound)
    if args.num_update_checkpoints is not None:
        return last_checkpoints(args.input_dir, args.num_update_checkpoints, "update",
                                args.checkpoint_upper_bound)
    parser.error("--input-dir needs --num-epoch-checkpoints or --num-update-checkpoints")


def average(parser, args) -> None:
    paths = _paths(parser, args)
    refuse_overwriting_inputs(args.output, paths)  # --input-dir's files too
    logger.info("averaging %d checkpoints: %s", len(paths), ", ".join(paths))
    save_checkpoint(average_checkpoints(paths), args.output)
    logger.info("wrote %s", args.output)


def main(argv=None) -> None:
    cli_support.run(build_parser(), average, argv)


if __name__ == "__main__":
    cli_support.command(main)
