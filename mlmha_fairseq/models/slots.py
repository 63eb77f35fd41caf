"""Slots: the places of the Transformer where this package's mechanisms plug in.

Every mechanism of the papers changes one of a few places of the standard Transformer
(papers are presets, mechanisms are slots). Each place is a
:class:`Slot`. A mechanism registers a *filler* for a slot: a function of the model
configuration (and of where it is built, e.g. the layer index) that returns a module,
or ``None`` when the configuration does not ask for that mechanism there. When no filler
claims a slot, the model keeps fairseq's own module, so with every option off the model
is exactly fairseq's transformer. Two fillers claiming an exclusive slot is a
configuration error, reported with both names. The encoder memory slot is not exclusive:
each mechanism adds its own named entries to the encoder output (see
:func:`check_distinct_outputs`).

Mechanisms declare their command-line options in :mod:`mlmha_fairseq.models.options`; the
slot-wide ones are added here, so that ``fairseq-train --arch slot_transformer --help``
lists every option of every slot.
"""
import argparse
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.nn as nn
from fairseq.utils import safe_getattr

from ..errors import UsageError
from .options import slot_wide_mechanisms

Filler = Callable[..., Optional[nn.Module]]


DEFAULT = "standard"


class Slot:
    """A named place of the model that mechanisms can fill.

    A slot with an ``option`` (e.g. ``--decoder-cross-attention``) is chosen by the user:
    fillers registered with ``selectable=True`` are the option's choices besides
    ``standard`` (fairseq's module) and are built only when chosen. Other fillers are
    built for every configuration and claim the slot by returning a module; they read
    their own mechanism's options (e.g. ``--layer-aggregation``). A slot is exclusive
    when it is read with :meth:`build` (one filler at most) and not when it is read with
    :meth:`build_all` (the encoder memory slot).
    """

    def __init__(self, name: str, option: Optional[str] = None):
        self.name = name
        self.option = option
        self._fillers: Dict[str, Filler] = {}
        self._selectable: List[str] = []
        self._given_by: Dict[str, Callable[[Any], str]] = {}

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    def register(self, filler_name: str, selectable: bool = False,
                 given_by: Optional[Callable[[Any], str]] = None):
        """Decorator registering ``fn(cfg, **context) -> Optional[nn.Module]`` under a name.
        ``given_by(cfg)``: the options that turn the filler on, as the user types them, for
        the message that refuses two fillers of one slot (default: ``--slot-option NAME`` for a
        selectable filler, else the filler's name)."""
        if selectable and self.option is None:
            raise ValueError(f"the {self.name} slot has no option to select {filler_name!r}")

        def wrapper(fn: Filler) -> Filler:
            if filler_name in self._fillers or filler_name == DEFAULT:
                raise ValueError(f"{self.name}: filler {filler_name!r} registered twice")
            self._fillers[filler_name] = fn
            if selectable:
                self._selectable.append(filler_name)
            if given_by is not None:
                self._given_by[filler_name] = given_by
            return fn

        return wrapper

    def given_by(self, filler_name: str, cfg) -> str:
        """The command-line options that turned ``filler_name`` on for ``cfg``."""
        if filler_name in self._given_by:
            return self._given_by[filler_name](cfg)
        return f"{self.option} {filler_name}" if filler_name in self._selectable else filler_name

    @property
    def choices(self) -> List[str]:
        return [DEFAULT] + self._selectable

    def add_option(self, parser):
        """The slot's choice."""
        parser.add_argument(self.option, choices=self.choices,
                            help=f"what fills the {self.name} slot ({DEFAULT}: fairseq's module)")

    def selected(self, cfg) -> str:
        return (safe_getattr(cfg, self.dest) or DEFAULT) if self.option else DEFAULT

    def build_all(self, cfg, **context) -> Dict[str, nn.Module]:
        """The modules of every filler that claims this slot for ``cfg``, by filler name."""
        selected = self.selected(cfg)
        claimed = {}
        for name, fn in self._fillers.items():
            if name in self._selectable and name != selected:
                continue
            module = fn(cfg, **context)
            if module is not None:
                claimed[name] = module
        return claimed

    def build(self, cfg, **context) -> Optional[nn.Module]:
        """The module of the one filler that claims this exclusive slot for ``cfg``, or None."""
        return next(iter(self.build_one(cfg, **context).values()), None)

    def build_one(self, cfg, **context) -> Dict[str, nn.Module]:
        """:meth:`build` by filler name: ``{}`` or ``{name: module}``, for a caller that also
        checks the module's outputs against another slot's (:func:`check_distinct_outputs`)."""
        claimed = self.build_all(cfg, **context)
        if len(claimed) > 1:
            raise UsageError(
                f"the {self.name} slot{_where(context)} is claimed by several mechanisms "
                f"({', '.join(self.given_by(name, cfg) for name in claimed)}): choose one"
            )
        return claimed


def _where(context) -> str:
    if "layer_idx" in context:
        return f" of layer {context['layer_idx'] + 1}"
    return ""


ENCODER_SELF_ATTENTION = Slot("encoder self-attention", "--encoder-self-attention")
DECODER_SELF_ATTENTION = Slot("decoder self-attention")  # DC claims it (--dc-decoder-layers); none selects it
DECODER_CROSS_ATTENTION = Slot("decoder cross-attention", "--decoder-cross-attention")
# Not exclusive: read with build_all, never build. Its fillers are called with num_layers and
# reaches_decoder (False for a multi-source model's secondary encoders, whose entries other
# than the top layer and its mask the decoder never reads).
ENCODER_MEMORY = Slot("encoder memory")
ENCODER_LAYER_INPUTS = Slot("encoder layer inputs")  # DLCL: what each encoder layer reads
DECODER_OUTPUT = Slot("decoder output")
SELECTABLE_SLOTS = (ENCODER_SELF_ATTENTION, DECODER_CROSS_ATTENTION)

# The stages of the decoder layer (SlotTransformerDecoderLayer), exclusive, empty by default.
# Their fillers are called with layer_idx, embed_dim and the decoder's layer context (keywords
# of the model, e.g. the multi-source model's sources; a filler reads those it needs). A module
# is called through the method named after its stage, so that its own forward keeps its meaning
# (AIF's z^f, a combination of n memories), with the layer's per-call extras (LayerInput).
# ``module.after_self_attention(x, extras) -> x``, between self- and cross-attention; the layer
# keeps the module as its ``layer_attribute`` (e.g. AIF's ``aux_fusion``).
DECODER_AFTER_SELF_ATTENTION = Slot("decoder after self-attention")
# ``module.cross_attention_sublayer(x, encoder_out, encoder_padding_mask, incremental_state,
# extras, need_weights, need_head_weights) -> (x, attn)``: the whole sublayer, residuals and
# LayerNorms included. The layer keeps it as ``encoder_attn``, where fairseq's cross-attention
# is, without ``encoder_attn_layer_norm``; filled together with the decoder cross-attention slot,
# an error naming both.
DECODER_CROSS_ATTENTION_SUBLAYER = Slot("decoder cross-attention sublayer")
# ``module.feed_forward(x) -> x``: the whole sublayer in place of fairseq's (its fc1, fc2 and
# LayerNorms are dropped); the layer keeps it as its ``layer_attribute``.
DECODER_FEED_FORWARD = Slot("decoder feed-forward")
# The stages of the encoder layer (SlotTransformerEncoderLayer), the same contracts with an
# empty ``extras`` (the encoder has no per-call inputs); fillers are called with layer_idx and
# embed_dim. A filled feed-forward stage gives no ``fc_result`` (fairseq's ``return_fc``).
ENCODER_AFTER_SELF_ATTENTION = Slot("encoder after self-attention")
ENCODER_FEED_FORWARD = Slot("encoder feed-forward")


def one_module(place: str, cfg, context, *fills: Tuple[Slot, Dict[str, nn.Module]]) -> Optional[nn.Module]:
    """The one module among the exclusive slots of one ``place`` of a layer (the decoder
    cross-attention and its whole sublayer), or None; ``fills``: ``(slot, slot.build_one(cfg,
    **context))`` of each slot. Two mechanisms filling that place cannot be combined."""
    claimed = [(slot, name, module) for slot, modules in fills for name, module in modules.items()]
    if len(claimed) > 1:
        raise UsageError(
            f"the {place}{_where(context)} is claimed by several mechanisms "
            f"({', '.join(slot.given_by(name, cfg) for slot, name, _ in claimed)}): choose one"
        )
    return claimed[0][2] if claimed else None


def check_distinct_outputs(cfg, *fills: Tuple[Slot, Dict[str, nn.Module]]):
    """The encoder's modules declare the ``encoder_out`` entries they write (``output_keys``):
    the encoder memory modules, and a layer-inputs module that makes ``encoder_out`` itself
    (DLCL). ``fills``: ``(slot, {filler name: module})`` of each slot; two mechanisms writing
    one entry cannot be combined."""
    producers: Dict[str, Tuple[Slot, str]] = {}
    for slot, modules in fills:
        for name, module in modules.items():
            for key in module.output_keys:
                if key in producers:
                    given = [by.given_by(producer, cfg) for by, producer in (producers[key], (slot, name))]
                    raise UsageError(
                        f"the encoder output {key!r} is written by several mechanisms "
                        f"({', '.join(given)}): choose one"
                    )
                producers[key] = (slot, name)


_MODEL_HOOKS: List[Callable[[nn.Module, nn.Module], None]] = []


def register_model_hook(hook: Callable[[nn.Module, nn.Module], None]):
    """Register ``hook(encoder, decoder)``, run on every slot model once it is built
    (before any checkpoint is loaded into it), for what spans the encoder and decoder
    slots: e.g. one module shared by an encoder filler and a decoder filler, which the
    slots build separately."""
    _MODEL_HOOKS.append(hook)
    return hook


def apply_model_hooks(encoder: nn.Module, decoder: nn.Module):
    for hook in _MODEL_HOOKS:
        hook(encoder, decoder)


def add_slot_args(parser):
    """The slot choices and every slot-wide mechanism's options."""
    for slot in SELECTABLE_SLOTS:
        slot.add_option(parser)
    # The first release offered the decoder self-attention slot as an option, whose only value
    # was ever "standard" (DC claims the slot through --dc-decoder-layers): accepted, unlisted,
    # so that those command lines keep working.
    parser.add_argument("--decoder-self-attention", choices=(DEFAULT,), help=argparse.SUPPRESS)
    for mechanism in slot_wide_mechanisms():
        mechanism.add_args(parser)


def set_slot_defaults(args):
    """Every slot at fairseq's module, every mechanism off (unless already set)."""
    for slot in SELECTABLE_SLOTS:
        setattr(args, slot.dest, getattr(args, slot.dest, DEFAULT))
    for mechanism in slot_wide_mechanisms():
        mechanism.set_defaults(args)
