"""Dual Contextual (DC) module in the slot Transformer (thesis ch. 5).

Fills the encoder and decoder self-attention slots with :class:`DualContextual` in the
layers that ``--dc-encoder-layers`` / ``--dc-decoder-layers`` name (``none``, ``all``, or
1-based layers and ranges such as ``1-3`` or ``1,3,5-6``: the thesis' ``[i-j]`` subsets).
These two options alone decide where DC sits; they are ``none`` in ``slot_transformer`` and
the presets set the thesis' recommendation, Enc-DC:

| thesis name | options |
|---|---|
| Enc-DC | ``--dc-encoder-layers all`` (presets' default) |
| Dec-DC | ``--dc-encoder-layers none --dc-decoder-layers all`` |
| Full-DC | ``--dc-encoder-layers all --dc-decoder-layers all`` |
| Enc-DC [i-j] (Table 5.6) | ``--dc-encoder-layers i-j`` |

The encoder convolution is centred ("same"), the decoder's causal. LayerNorm placement
follows the layer: post-norm (fairseq's default, the thesis' Eqs. 5.4-5.7) or, with
``--encoder-normalize-before`` / ``--decoder-normalize-before``, the pre-norm variant
(see :mod:`mlmha_fairseq.modules.dual_contextual`).

Presets: ``dc_transformer_iwslt``, ``dc_transformer_wmt_en_de`` (Table 5.1).
"""
from dataclasses import dataclass
from types import MappingProxyType
from typing import FrozenSet, Mapping

from ..errors import UsageError
from ..modules.dual_contextual import DualContextual
from .layer_selection import ALL_LAYERS, NO_LAYERS, parse_layers
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .presets import thesis_base, thesis_small
from .slots import DECODER_SELF_ATTENTION, ENCODER_SELF_ATTENTION

DUAL_CONTEXTUAL = "dual-contextual"
DEFAULT_KERNEL_SIZE = 2  # the parameter counts of thesis Table 5.2 fit f = 2


def _on(args, side: str) -> bool:
    return (getattr(args, f"dc_{side}_layers", NO_LAYERS) or NO_LAYERS).strip().lower() != NO_LAYERS


@dataclass(frozen=True)
class DCOptions:
    """Where the Dual Contextual module sits (0-based layers per stack) and its kernel width,
    validated."""

    layers: Mapping[str, FrozenSet[int]]  # "encoder"/"decoder" -> layers
    kernel_size: int

    @classmethod
    def from_cfg(cls, cfg) -> "DCOptions":
        if cfg.dc_kernel_size < 1:
            raise UsageError(f"--dc-kernel-size {cfg.dc_kernel_size}: the convolution width must be >= 1")
        layers = {side: parse_layers(getattr(cfg, f"dc_{side}_layers"), getattr(cfg, side).layers,
                                     f"--dc-{side}-layers", side)
                  for side in ("encoder", "decoder")}
        return cls(MappingProxyType(layers), cfg.dc_kernel_size)


DUAL_CONTEXTUAL_MODULE = register_mechanism(Mechanism(
    "the Dual Contextual module",
    Switch("--dc-encoder-layers or --dc-decoder-layers", lambda args: _on(args, "encoder") or _on(args, "decoder")), (
        Option("--dc-encoder-layers", NO_LAYERS, "encoder layers whose self-attention is the Dual "
               "Contextual module: none, all, or 1-based layers/ranges like 1-3 or 1,3,5-6 "
               "(Enc-DC: all)", argparse=dict(metavar="LAYERS"), is_switch=True),
        Option("--dc-decoder-layers", NO_LAYERS, "decoder layers with the (causal) Dual Contextual "
               "module: none, all, or layers/ranges (Dec-DC: all)", argparse=dict(metavar="LAYERS"),
               is_switch=True),
        Option("--dc-kernel-size", DEFAULT_KERNEL_SIZE, "width f of the local unit's convolution "
               f"(default {DEFAULT_KERNEL_SIZE}, read from the thesis' parameter counts; f in 2..4 "
               "was best in its sweep)", argparse=dict(type=int, metavar="F")),
    ), parse=DCOptions.from_cfg))


def _build(cfg, side: str, layer_idx: int, embed_dim: int):
    """The DC module for ``layer_idx`` of ``side`` ("encoder"/"decoder"), or None."""
    if not DUAL_CONTEXTUAL_MODULE.switch.is_on(cfg):
        return None
    options = DUAL_CONTEXTUAL_MODULE.parsed(cfg)
    if layer_idx not in options.layers[side]:
        return None
    return DualContextual(
        embed_dim, getattr(cfg, side).attention_heads, options.kernel_size,
        causal=side == "decoder", dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
    )


@ENCODER_SELF_ATTENTION.register(DUAL_CONTEXTUAL,
                                 given_by=lambda cfg: f"--dc-encoder-layers {cfg.dc_encoder_layers}")
def build_encoder_dual_contextual(cfg, layer_idx, embed_dim):
    return _build(cfg, "encoder", layer_idx, embed_dim)


@DECODER_SELF_ATTENTION.register(DUAL_CONTEXTUAL,
                                 given_by=lambda cfg: f"--dc-decoder-layers {cfg.dc_decoder_layers}")
def build_decoder_dual_contextual(cfg, layer_idx, embed_dim):
    module = _build(cfg, "decoder", layer_idx, embed_dim)
    if module is not None and cfg.cross_self_attention:
        raise UsageError("--dc-decoder-layers: the Dual Contextual module is a self-attention "
                         "and cannot attend to the encoder (--cross-self-attention)")
    return module


@register_architecture("slot_transformer", "dc_transformer_iwslt")
def dc_transformer_iwslt(args):
    """Enc-DC on the IWSLT tasks (Table 5.1): d=256, 4 heads, 4+4 layers, FFN 1024 (the
    table's 512 is read as a typo: its baselines are ch. 3's, trained with 1024)."""
    args.dc_encoder_layers = getattr(args, "dc_encoder_layers", ALL_LAYERS)
    thesis_small(args)


@register_architecture("slot_transformer", "dc_transformer_wmt_en_de")
def dc_transformer_wmt_en_de(args):
    """Enc-DC on WMT'14 En-De (Table 5.1): the base Transformer, d=512, 8 heads, FFN 2048,
    6+6 layers (fairseq's defaults)."""
    args.dc_encoder_layers = getattr(args, "dc_encoder_layers", ALL_LAYERS)
    thesis_base(args)
