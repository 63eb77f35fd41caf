"""Dual Contextual (DC) module in the slot Transformer (thesis ch. 5; spec §4).

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
``--encoder-normalize-before`` / ``--decoder-normalize-before``, the spec's pre-norm variant
(see :mod:`mlmha_fairseq.modules.dual_contextual`).

Presets: ``dc_transformer_iwslt``, ``dc_transformer_wmt_en_de`` (Table 5.1).
"""
from fairseq.models import register_model_architecture
from fairseq.utils import safe_getattr

from ..modules.dual_contextual import DualContextual
from .layer_selection import ALL_LAYERS, NO_LAYERS, parse_layers
from .presets import thesis_base, thesis_small
from .slots import DECODER_SELF_ATTENTION, ENCODER_SELF_ATTENTION, register_options

DUAL_CONTEXTUAL = "dual-contextual"
DEFAULT_KERNEL_SIZE = 2  # spec §4.1: the parameter counts of Table 5.2 fit f = 2


def add_args(parser):
    """Options of the Dual Contextual module (fairseq passes its model argument group)."""
    parser.add_argument("--dc-encoder-layers", metavar="LAYERS",
                        help="encoder layers whose self-attention is the Dual Contextual "
                             "module: none, all, or 1-based layers/ranges like 1-3 or 1,3,5-6 "
                             "(Enc-DC: all)")
    parser.add_argument("--dc-decoder-layers", metavar="LAYERS",
                        help="decoder layers with the (causal) Dual Contextual module: none, "
                             "all, or layers/ranges (Dec-DC: all)")
    parser.add_argument("--dc-kernel-size", type=int, metavar="F",
                        help=f"width f of the local unit's convolution (default "
                             f"{DEFAULT_KERNEL_SIZE}, read from the thesis' parameter counts; "
                             "f in 2..4 was best in its sweep)")


def set_defaults(args):
    args.dc_encoder_layers = getattr(args, "dc_encoder_layers", NO_LAYERS)
    args.dc_decoder_layers = getattr(args, "dc_decoder_layers", NO_LAYERS)
    args.dc_kernel_size = getattr(args, "dc_kernel_size", DEFAULT_KERNEL_SIZE)


register_options(add_args, set_defaults)


def _kernel_size(cfg) -> int:
    kernel_size = safe_getattr(cfg, "dc_kernel_size")
    if kernel_size is None:
        return DEFAULT_KERNEL_SIZE
    if kernel_size < 1:
        raise ValueError(f"--dc-kernel-size {kernel_size}: the convolution width must be >= 1")
    return kernel_size


def _build(cfg, side: str, layer_idx: int, embed_dim: int):
    """The DC module for ``layer_idx`` of ``side`` ("encoder"/"decoder"), or None."""
    option = f"--dc-{side}-layers"
    value = safe_getattr(cfg, f"dc_{side}_layers") or NO_LAYERS
    if layer_idx not in parse_layers(value, getattr(cfg, side).layers, option, side):
        return None
    return DualContextual(
        embed_dim, getattr(cfg, side).attention_heads, _kernel_size(cfg),
        causal=side == "decoder", dropout=cfg.dropout, attention_dropout=cfg.attention_dropout,
    )


@ENCODER_SELF_ATTENTION.register(DUAL_CONTEXTUAL)
def build_encoder_dual_contextual(cfg, layer_idx, embed_dim):
    return _build(cfg, "encoder", layer_idx, embed_dim)


@DECODER_SELF_ATTENTION.register(DUAL_CONTEXTUAL)
def build_decoder_dual_contextual(cfg, layer_idx, embed_dim):
    module = _build(cfg, "decoder", layer_idx, embed_dim)
    if module is not None and cfg.cross_self_attention:
        raise ValueError("--dc-decoder-layers: the Dual Contextual module is a self-attention "
                         "and cannot attend to the encoder (--cross-self-attention)")
    return module


@register_model_architecture("slot_transformer", "dc_transformer_iwslt")
def dc_transformer_iwslt(args):
    """Enc-DC on the IWSLT tasks (Table 5.1): d=256, 4 heads, 4+4 layers, FFN 1024 (the
    table's 512 is read as a typo, errata 9: its baselines are ch. 3's, trained with 1024)."""
    args.dc_encoder_layers = getattr(args, "dc_encoder_layers", ALL_LAYERS)
    thesis_small(args)


@register_model_architecture("slot_transformer", "dc_transformer_wmt_en_de")
def dc_transformer_wmt_en_de(args):
    """Enc-DC on WMT'14 En-De (Table 5.1): the base Transformer, d=512, 8 heads, FFN 2048,
    6+6 layers (fairseq's defaults)."""
    args.dc_encoder_layers = getattr(args, "dc_encoder_layers", ALL_LAYERS)
    thesis_base(args)
