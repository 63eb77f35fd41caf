"""Write every preset of this package as the model section of a hydra config, for
fairseq-hydra-train: DIR/model/<preset>.yaml, each option with its help as a comment and the
preset's value (an option the preset takes from another, e.g. the decoder's width, as an
interpolation of that option). The repository's copies are examples/hydra/model/*.yaml;
tests/test_hydra.py checks that they are what this command writes.

Example::

    python -m mlmha_fairseq.cli.hydra_configs examples/hydra
    fairseq-hydra-train --config-dir examples/hydra --config-name translation \\
        task.data=data-bin/wmt14_en_de model=mlmha_transformer_wmt_en_de
"""
import dataclasses
import os
import textwrap
from typing import Dict

from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from omegaconf import OmegaConf

import mlmha_fairseq  # noqa: F401 (registers the models)
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.models.hydra_configs import NAME, model_config, package_presets, preset_config

GROUP = "model"
WIDTH = 100


def _comment(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), WIDTH, initial_indent="# ", subsequent_indent="# ",
                         break_on_hyphens=False)


def preset_yaml(arch: str) -> str:
    """The YAML text of preset ``arch`` (:func:`~mlmha_fairseq.models.hydra_configs.preset_config`)."""
    helps: Dict[str, str] = {field.name: field.metadata.get("help")
                             for field in dataclasses.fields(model_config(ARCH_MODEL_REGISTRY[arch]))}
    description = (ARCH_CONFIG_REGISTRY[arch].__doc__ or "").split("\n\n")[0]
    lines = [f"# @package {GROUP}",
             _comment(f"Preset {arch}{': ' + description if description else ''}"),
             "# Written by python -m mlmha_fairseq.cli.hydra_configs from the preset's architecture "
             "function; do not edit.",
             ""]
    for key, value in preset_config(arch).items():
        if key != NAME and helps.get(key):
            lines.append(_comment(helps[key]))
        lines.append(OmegaConf.to_yaml({key: value}).rstrip("\n"))
    return "\n".join(lines) + "\n"


def write_presets(directory: str):
    folder = os.path.join(directory, GROUP)
    os.makedirs(folder, exist_ok=True)
    for arch in package_presets():
        with open(os.path.join(folder, f"{arch}.yaml"), "w", encoding="utf-8") as out:
            out.write(preset_yaml(arch))


def build_parser():
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("directory", metavar="DIR",
                        help="the config directory (fairseq-hydra-train --config-dir); the files go "
                             "to DIR/model/")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    write_presets(args.directory)


if __name__ == "__main__":
    cli_support.command(main)
