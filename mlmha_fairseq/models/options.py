"""The options of the mechanisms, declared once.

A mechanism declares its command-line options as :class:`Option` entries of a
:class:`Mechanism`, together with the switch that turns it on. From that one declaration
come the ``argparse`` options (:meth:`Mechanism.add_args`), the defaults for options a
user or an older checkpoint did not give (:meth:`Mechanism.set_defaults`: each default is
written once, in its :class:`Option`), the check that no option is set while its
mechanism is off (:func:`check_options`, run when a model is built) and the option listing
of ``python -m mlmha_fairseq.cli.options``. A mechanism with a ``parse`` function also turns
its option values into one frozen, validated object (:meth:`Mechanism.parsed`), built once per
model: its modules take their settings from that object, through their constructors.

An option is "set" when the user typed it on the command line, whatever its value, or when
its value differs from the option's default. Typed options are known only while fairseq's
parser runs (:func:`register_architecture`); a model built from stored arguments (a
checkpoint, which holds every default) is checked by value alone, so that such arguments pass,
and a preset that sets a default of a mechanism it does not turn on would be refused like a
user (none does: ``tests/test_options.py`` checks every preset).
"""
import argparse
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from fairseq.models import register_model_architecture

from ..errors import UsageError

_MISSING = object()
_PARSED = "_mlmha_fairseq_parsed_options"
_TYPED = "_mlmha_fairseq_typed_options"


@dataclass(frozen=True)
class Switch:
    """What turns a mechanism (or a part of it) on: its command-line spelling for error
    messages (e.g. ``--decoder-cross-attention multi-layer``) and a test of ``args``."""

    text: str
    is_on: Callable[[Any], bool]


@dataclass(frozen=True)
class Option:
    """One command-line option: its flag, further spellings (``aliases``), its default,
    its help and the remaining ``argparse`` settings (``type``, ``choices``, ``action``,
    ``metavar``). ``needs``: the switch this option depends on, when narrower than its
    mechanism's (e.g. the SA-only options of MLRF); ``is_switch``: the option turns its
    mechanism on itself, so the set-while-off check skips it; ``none_means``: for a default
    of None, the value it stands for in a model of ``args`` (shown by the option listing);
    ``inference_only``: the option changes how a trained model runs, not what its weights
    mean (an ablation for ``fairseq-generate --model-overrides``), so a checkpoint loaded with
    another value is no cause for a warning; ``negation``: for a flag, the spelling that sets it
    back (e.g. ``--no-aux-fusion``, for a preset that turns the flag on)."""

    flag: str
    default: Any
    help: str
    aliases: Tuple[str, ...] = ()
    argparse: Mapping[str, Any] = field(default_factory=dict)
    needs: Optional[Switch] = None
    is_switch: bool = False
    none_means: Optional[Callable[[Any], Any]] = None
    inference_only: bool = False
    negation: Optional[str] = None

    def __post_init__(self):
        if self.negation and not self.is_flag:
            raise ValueError(f"{self.flag}: only a flag has a negation")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def is_flag(self) -> bool:
        return self.argparse.get("action") in ("store_true", "store_false")


@dataclass(frozen=True)
class Mechanism:
    """A mechanism's name, its switch and its options; ``parse(cfg)``: the options of a
    model configuration as the mechanism's frozen options object, validated
    (:class:`~mlmha_fairseq.errors.UsageError` for a bad value). A mechanism without a switch
    (``None``) has no "off" in the models that declare it, only choices (e.g. the multi-source
    combination strategy): each of its options is a choice (``is_switch``) or needs a
    narrower switch of its own."""

    name: str
    switch: Optional[Switch]
    options: Tuple[Option, ...]
    slot_wide: bool = True  # options of every slot model; else added by one model's add_args
    parse: Optional[Callable[[Any], Any]] = None

    def __post_init__(self):
        unchecked = [option.flag for option in self.options
                     if self.switch is None and not option.is_switch and option.needs is None]
        if unchecked:
            raise ValueError(f"{self.name}: {', '.join(unchecked)} would be in effect with nothing to "
                             "turn it on: give the mechanism a switch or the option its own")

    def parsed(self, cfg):
        """``parse(cfg)``, computed once per model configuration: fairseq builds the encoder,
        the decoder and all their layers from one ``TransformerConfig``, and every filler of
        this mechanism asks for it. The object is kept on that configuration, which is the
        model's own copy (never written into ``args`` or a checkpoint)."""
        cache = vars(cfg).setdefault(_PARSED, {})
        if self.name not in cache:
            cache[self.name] = self.parse(cfg)
        return cache[self.name]

    def add_args(self, parser):
        for option in self.options:
            settings = dict(option.argparse)
            if option.is_flag:
                settings.update(nargs=0, const=settings.pop("action") == "store_true")
            parser.add_argument(option.flag, *option.aliases, dest=option.dest, help=option.help,
                                action=TypedOption, **settings)
            if option.negation:
                parser.add_argument(option.negation, dest=option.dest, nargs=0, const=not settings["const"],
                                    action=TypedOption, help=f"not {option.flag} (to switch off a preset's)")

    def set_defaults(self, args):
        """Fill the options ``args`` lacks (like fairseq's architecture functions)."""
        for option in self.options:
            setattr(args, option.dest, getattr(args, option.dest, option.default))

    def check(self, args, typed: Optional[Mapping[str, str]] = None):
        """A :class:`~mlmha_fairseq.errors.UsageError` naming the first option that is set
        while what it needs is off. ``typed``: the options the user typed, by ``dest``, with
        the spelling typed (:class:`TypedOption`); they count as set whatever their value."""
        typed = typed or {}
        for option in self.options:
            if option.is_switch:
                continue
            value = getattr(args, option.dest, _MISSING)
            if value is _MISSING or (value == option.default and option.dest not in typed):
                continue
            needs = option.needs or self.switch  # never None (__post_init__)
            if not needs.is_on(args):
                flag = typed.get(option.dest, option.flag)
                given = flag if option.is_flag else f"{flag} {value}"
                raise UsageError(f"{given} needs {needs.text}, which is off: the option applies to "
                                 f"{self.name} and would be ignored; turn it on or leave "
                                 f"{flag} out")


MECHANISMS: Dict[str, Mechanism] = {}


def register_mechanism(mechanism: Mechanism) -> Mechanism:
    if mechanism.name in MECHANISMS:
        raise ValueError(f"mechanism {mechanism.name!r} registered twice")
    MECHANISMS[mechanism.name] = mechanism
    return mechanism


def check_options(args, typed: Optional[Mapping[str, str]] = None):
    """Every mechanism's set-while-off check, for the options ``args`` has (``typed``: see
    :meth:`Mechanism.check`)."""
    for mechanism in MECHANISMS.values():
        mechanism.check(args, typed)


class TypedOption(argparse.Action):
    """argparse's ``store`` action (``store_true``/``store_false`` with ``nargs=0`` and
    ``const``) that also notes in the namespace which options were typed, and how. fairseq's
    parser gives model options no default (``argparse.SUPPRESS``), but the architecture
    function then fills every default into the same namespace, and a checkpoint stores them
    all: after parsing, a typed default and a default look alike. The note lives only until
    the architecture function of :func:`register_architecture` takes it off the namespace, so
    it never reaches a model's arguments or a checkpoint."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        typed = dict(getattr(namespace, _TYPED, None) or {})
        typed[self.dest] = option_string
        setattr(namespace, _TYPED, typed)


def _take_typed(args) -> Optional[Dict[str, str]]:
    typed = getattr(args, _TYPED, None)
    if typed is not None:
        delattr(args, _TYPED)
    return typed


def register_architecture(model_name: str, arch_name: str):
    """fairseq's ``register_model_architecture`` for the architectures of this package's
    models. fairseq calls the registered function on the parsed command line (and again on a
    model's stored arguments, where nothing was typed); on the command line, once the preset
    and the defaults are applied, an option the user typed while its mechanism is off is
    refused whatever its value (:class:`TypedOption`), before any data is read. The decorated
    function is returned as it is, for presets that call one another and for models that
    complete the options of older checkpoints with it."""

    def decorator(fn):
        @functools.wraps(fn)
        def architecture(args):
            typed = _take_typed(args)
            fn(args)
            if typed:
                check_options(args, typed)

        register_model_architecture(model_name, arch_name)(architecture)
        return fn

    return decorator


def option_of(dest: str) -> Optional[Tuple[Mechanism, Option]]:
    """The mechanism and declaration of the option stored as ``dest``, or None."""
    for mechanism in MECHANISMS.values():
        for option in mechanism.options:
            if option.dest == dest:
                return mechanism, option
    return None


def slot_wide_mechanisms() -> List[Mechanism]:
    return [mechanism for mechanism in MECHANISMS.values() if mechanism.slot_wide]
