"""The models and their presets as hydra configurations, for ``fairseq-hydra-train``.

A model of this package declares its options for ``fairseq-train`` (``add_args``: fairseq's
transformer options, the slot choices and the :class:`~.options.Option` declarations of its
mechanisms) and its defaults and presets as architecture functions. Those stay the one
declaration; from them come

* :func:`model_config`: one flat :class:`~fairseq.dataclass.FairseqDataclass` per model, a
  field per option with the option's help, type and choices and the model's default (its
  architecture function applied to nothing), stored in hydra's ``ConfigStore`` as the
  ``model`` group's option of the model's name, as fairseq's ``register_model`` stores a
  dataclass model;
* :func:`preset_config`: a preset as the ``model`` section of a hydra config (``_name`` and
  every option at the preset's value), which ``python -m mlmha_fairseq.cli.hydra_configs``
  writes to ``examples/hydra/model/<preset>.yaml``;
* :func:`namespace_of`: what the model is built from when ``fairseq-hydra-train`` (or a
  checkpoint it wrote) hands it a ``DictConfig``.

Why the models are not registered with ``register_model(name, dataclass=...)``: fairseq would
then convert fairseq-train's options into that dataclass too, so that checkpoints of the
command line would store a dict instead of the ``Namespace`` whose options
:mod:`mlmha_fairseq.compat` checks while unpickling, and it would register a no-op
architecture under the model's name in place of the one that completes and checks the options
typed on the command line (:func:`~.options.register_architecture`). fairseq builds a model
registered without a dataclass from a hydra ``cfg.model`` as well: it applies the
architecture function that ``_name`` names to it, then calls ``build_model``.

``fairseq-hydra-train`` composes its configuration before it imports ``common.user_dir``, so
hydra finds these models' options in the YAML files at compose time (which is why every file
lists every option), and the dataclass checks them when the model is built.
"""
import argparse
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Set, Type

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import merge_with_parent
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.models.transformer import TransformerConfig
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import UsageError

NAME = "_name"  # the key of a fairseq config section that names its model (here: the preset)
# Values no architecture sets, given to one option at a time to see which others take it.
_MARKERS = {int: 7919, float: 0.7919, str: "<mlmha_fairseq marker>"}


def option_actions(add_args: Callable) -> List[argparse.Action]:
    """The ``argparse`` actions of the options that ``add_args`` declares (no defaults:
    fairseq adds model options with ``argparse.SUPPRESS``, as here)."""
    parser = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    add_args(parser)
    return [action for action in parser._actions if action.option_strings]


def applied(architecture: Callable, **given) -> Dict[str, Any]:
    """The options an architecture function sets on a namespace holding ``given`` only."""
    args = argparse.Namespace(**given)
    architecture(args)
    return vars(args)


def _field_type(action: argparse.Action, default):
    if action.nargs == 0:  # store_true/store_false, and this package's flags (options.TypedOption)
        kind = bool
    elif action.choices is not None:
        kind = ChoiceEnum(list(action.choices))  # hydra refuses a value outside them
    elif action.type in (str, int, float):
        kind = action.type
    elif action.type is None:  # argparse's str, or fairseq's option whose declared default is an
        kind = str if default is None else type(default)  # interpolation (--decoder-output-dim)
    else:  # fairseq's list options (e.g. --adaptive-softmax-cutoff): the model parses them
        kind = Any
    return Optional[kind] if default is None else kind


@functools.lru_cache(maxsize=None)
def model_config(model_class: Type) -> Type[FairseqDataclass]:
    """The model's options as a flat dataclass, derived from its ``add_args`` (help, type,
    choices) and its ``complete_options`` (defaults; fairseq's ``TransformerConfig`` for the
    options no architecture function sets, which is where fairseq-train takes them from too)."""
    defaults = applied(model_class.complete_options)
    transformer = TransformerConfig()
    fields = {}
    for action in option_actions(model_class.add_args):
        if action.dest in fields:  # e.g. --no-aux-fusion, a second spelling of aux_fusion
            continue
        default = defaults[action.dest] if action.dest in defaults else getattr(transformer, action.dest)
        help_text = None if action.help == argparse.SUPPRESS else action.help
        fields[action.dest] = (action.dest, _field_type(action, default),
                               dataclasses.field(default=default, metadata={"help": help_text}))
    for dest, default in defaults.items():
        # set by the architecture function without an option (decoder_input_dim): fairseq
        # applies that function to a hydra config too, before the model checks it here
        fields.setdefault(dest, (dest, Optional[type(default)], dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{model_class.__name__}Config", list(fields.values()),
                                      bases=(FairseqDataclass,))


def register_model_config(name: str, model_class: Type):
    """Store the model's dataclass in hydra's ``ConfigStore`` as fairseq's ``register_model``
    stores a dataclass model's: a program that imports this package and composes a config
    (hydra's ``compose``) selects it with ``model=<name>`` and sees every option's default."""
    node = model_config(model_class)()
    node._name = name
    ConfigStore.instance().store(name=name, group="model", node=node, provider="mlmha_fairseq")


def namespace_of(model_class: Type, cfg) -> argparse.Namespace:
    """``cfg.model`` of a hydra config (``fairseq-hydra-train``, or a checkpoint it wrote),
    checked against the model's dataclass, as the ``Namespace`` that fairseq-train gives a
    model: fairseq's ``TransformerConfig.from_namespace`` keeps only the fields of a
    ``DictConfig`` that it declares, so this package's options would be lost. An option the
    model does not have, or a value of the wrong type, is a :class:`UsageError`."""
    config = model_config(model_class)
    known = {field.name for field in dataclasses.fields(config)}
    unknown = sorted(set(cfg.keys()) - known)
    if unknown:
        raise UsageError(f"model.{unknown[0]}: not an option of {model_class.__name__}; its options: "
                         "python -m mlmha_fairseq.cli.options --arch " + str(cfg.get(NAME)))
    try:
        checked = merge_with_parent(config(), cfg)
    except OmegaConfBaseException as error:  # a value of the wrong type, or not among the choices
        raise UsageError(f"model.{error.key}: {error.msg.splitlines()[0]}") from None
    return argparse.Namespace(**OmegaConf.to_container(checked, resolve=True, enum_to_str=True))


def _takes_from(architecture: Callable, values: Dict[str, Any]) -> Dict[str, str]:
    """``{option: the option whose value it takes}`` in an architecture function (e.g. the
    decoder's width takes the encoder's), found by giving each numeric or text option in turn
    a value no architecture sets and seeing which others take it. Of several sources, the
    nearest: ``decoder_output_dim`` takes ``decoder_embed_dim``, which takes
    ``encoder_embed_dim``."""
    sources: Dict[str, Set[str]] = {}
    for source, value in values.items():
        marker = _MARKERS.get(type(value))
        if marker is None:
            continue
        for dest, got in applied(architecture, **{source: marker}).items():
            if dest != source and type(got) is type(marker) and got == marker:
                sources.setdefault(dest, set()).add(source)
    return {dest: next(source for source in found if found - {source} <= sources.get(source, set()))
            for dest, found in sources.items()}


def preset_config(arch: str) -> Dict[str, Any]:
    """Preset ``arch`` as the ``model`` section of a hydra config: ``_name`` (the preset,
    whose architecture function fairseq applies before building the model) and every option of
    its model at the preset's value. An option the preset takes from another is the
    interpolation ``${model.<other>}``, so that overriding the other on the command line
    carries over as it does with fairseq-train (``model.encoder_embed_dim=256`` resizes the
    decoder too)."""
    architecture = ARCH_CONFIG_REGISTRY[arch]
    values = applied(architecture)
    config = {NAME: arch}
    for field in dataclasses.fields(model_config(ARCH_MODEL_REGISTRY[arch])):
        if field.name != NAME:
            config[field.name] = values.get(field.name, field.default)
    for dest, source in _takes_from(architecture, values).items():
        config[dest] = f"${{model.{source}}}"
    return config


def _ours(model_class: Type) -> bool:
    return model_class.__module__.startswith("mlmha_fairseq.")


def package_models() -> Dict[str, Type]:
    """This package's models by name."""
    return {name: model for name, model in MODEL_REGISTRY.items() if _ours(model)}


def package_presets() -> List[str]:
    """Every architecture of this package's models, in registration order."""
    return [arch for arch, model in ARCH_MODEL_REGISTRY.items() if _ours(model)]
