"""Every command-line option of this package for one architecture: its spellings, its
default in that preset, the mechanism it belongs to and its help.

Example::

    python -m mlmha_fairseq.cli.options --arch mlmha_transformer_iwslt
    python -m mlmha_fairseq.cli.options --arch ms_transformer_iwslt --format json

fairseq's own transformer options (sizes, dropout, ...) are left out: ``fairseq-train
--arch NAME --help`` lists them.
"""
import argparse
import json
from typing import Dict, List

from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel

import mlmha_fairseq  # noqa: F401 (registers the models)
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.hydra_configs import option_actions, package_presets
from mlmha_fairseq.models.options import option_of
from mlmha_fairseq.models.slots import SELECTABLE_SLOTS

DEFAULT_ARCH = "slot_transformer"


def package_archs() -> List[str]:
    return sorted(package_presets())


def _mechanism(dest: str, model_name: str) -> str:
    declared = option_of(dest)
    if declared is not None:
        return declared[0].name
    for slot in SELECTABLE_SLOTS:
        if slot.dest == dest:
            return f"the {slot.name} slot"
    return model_name


def list_options(arch: str) -> List[Dict[str, object]]:
    """One entry per option of the package that ``arch``'s model accepts."""
    if arch not in ARCH_MODEL_REGISTRY:
        raise UsageError(f"--arch {arch}: not an architecture of this package; choose one of "
                         f"{', '.join(package_archs())}")
    model = ARCH_MODEL_REGISTRY[arch]
    fairseq_dests = {action.dest for action in option_actions(TransformerModel.add_args)}
    args = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](args)
    rows = []
    for action in option_actions(model.add_args):
        if action.dest in fairseq_dests or action.help == argparse.SUPPRESS:
            continue
        default = getattr(args, action.dest, None)
        declared = option_of(action.dest)
        if default is None and declared is not None and declared[1].none_means is not None:
            default = declared[1].none_means(args)
        if action.nargs == 0 and action.const is False:  # a negation (--no-aux-fusion): given or not
            default = not default
        rows.append({"option": ", ".join(action.option_strings), "dest": action.dest,
                     "default": default, "mechanism": _mechanism(action.dest, model.__name__),
                     "help": action.help or ""})
    return rows


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="architecture (default: %(default)s)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="a table for reading or JSON for tools (default: %(default)s)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    rows = list_options(args.arch)
    if args.format == "json":
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        print(f"{row['option']}  (default: {row['default']}; {row['mechanism']})")
        print(f"    {row['help']}")


if __name__ == "__main__":
    cli_support.command(main)
