"""Remove the auxiliary decoders from an MS-l checkpoint for deployment.

Without AIF the auxiliary decoders "can be discarded after training" (thesis
§4.2).

Example::

    python -m mlmha_fairseq.cli.strip_aux_decoders checkpoints/checkpoint_best.pt deploy.pt
    fairseq-generate data-bin --user-dir mlmha_fairseq --path deploy.pt ...

The output holds the main model only (its parameters, and the options with
``aux_decoder_layers = 'none'``), so it loads strictly and decodes exactly as the input
checkpoint. The optimizer state is dropped: it belonged to the auxiliary decoders too (to
fine-tune a stripped model, pass ``--reset-optimizer``). Checkpoints with AIF are refused:
their Main-Decoder reads the auxiliary decoders' states at every step.
"""
import logging
import os
from typing import Dict

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.checkpoint_averaging import save_checkpoint
from mlmha_fairseq.evaluation.model_loading import checkpoint_errors
from mlmha_fairseq.evaluation.text_io import InputError
from mlmha_fairseq.models.multi_level_supervision import NO_AUX
from mlmha_fairseq.models.slot_transformer import recorded_options

logger = logging.getLogger(__name__)
# Parameter-name parts of the auxiliary decoders and of their encoder memories.
AUX_PARAMETER_PARTS = ("aux_decoders", "aux_layer_norms")


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("input", help="checkpoint of an ms_transformer model without --aux-fusion")
    parser.add_argument("output", help="checkpoint to write (must differ from the input)")
    return parser


def _model_options(state: dict):
    """The model options of a checkpoint: ``cfg.model`` (or the legacy ``args``)."""
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return cfg["model"]
    if state.get("args") is not None:
        return state["args"]
    raise InputError("the checkpoint stores no model options")


def _is_aux_parameter(name: str) -> bool:
    return any(part in name.split(".") for part in AUX_PARAMETER_PARTS)


def strip_aux_decoders(state: dict) -> Dict[str, int]:
    """Remove the auxiliary decoders from a checkpoint ``state`` (in place); returns the
    number of removed tensors and of kept ones."""
    options = _model_options(state)
    if getattr(options, "aux_decoder_layers", None) in (None, NO_AUX):
        raise InputError("the checkpoint has no auxiliary decoders (not an ms_transformer "
                         "model with --aux-decoder-layers)")
    if getattr(options, "aux_fusion", False):
        raise InputError("the checkpoint uses AIF (--aux-fusion): its main decoder needs the "
                         "auxiliary decoders at inference, they cannot be stripped")
    removed = [name for name in state["model"] if _is_aux_parameter(name)]
    for name in removed:
        del state["model"][name]
    options.aux_decoder_layers = NO_AUX
    options.decode_from = "main"
    recorded = recorded_options(state["model"])
    if recorded is not None:  # else every load of the stripped checkpoint warns of other options
        recorded["aux_decoder_layers"] = NO_AUX
    state.pop("last_optimizer_state", None)
    return {"removed": len(removed), "kept": len(state["model"])}


def strip_aux_decoders_cli(parser, args) -> None:
    from fairseq.checkpoint_utils import load_checkpoint_to_cpu

    if not os.path.isfile(args.input):
        raise InputError(f"checkpoint not found: {args.input}")
    with checkpoint_errors(args.input):
        state = load_checkpoint_to_cpu(args.input)
    counts = strip_aux_decoders(state)
    save_checkpoint(state, args.output)
    logger.info("removed %d auxiliary tensors, kept %d: %s", counts["removed"], counts["kept"],
                args.output)


def main(argv=None) -> None:
    cli_support.run(build_parser(), strip_aux_decoders_cli, argv)


if __name__ == "__main__":
    cli_support.command(main)
