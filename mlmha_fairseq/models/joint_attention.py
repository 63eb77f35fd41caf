"""Joint attention strategies: MLMHA and the layer-aggregation family (seed 000; thesis ch. 3).

Fills three slots of the slot Transformer:

* decoder cross-attention ``multi-layer`` (``--decoder-cross-attention multi-layer``): every
  decoder layer attends to the top-n encoder layers with :class:`MultiLayerMultiheadAttention`
  (variants M-00, M-01, M-10, M-11, ``--mlmha-variant``);
* encoder memory: the Source Feature Collector's taps for MLMHA, or one joint memory made by a
  layer aggregation (``--layer-aggregation s-agg|iter-s-agg|c-agg|iter-c-agg``) that replaces
  the top encoder layer for every decoder layer;
* Transparent Attention (``--layer-aggregation transparent``, Bapna et al. 2018): one learned
  mixture of all encoder states (embedding included) per decoder layer.

Presets: ``mlmha_transformer_iwslt``, ``mlmha_transformer_wmt_en_de``,
``layer_aggregation_transformer_iwslt``, ``layer_aggregation_transformer_wmt_en_de`` (pre-norm,
as the authors' code), and each with the suffix ``_post_norm`` (post-norm, as the equations).
"""
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from fairseq.models import register_model_architecture
from fairseq.modules import MultiheadAttention
from fairseq.utils import safe_getattr

from ..modules.layer_aggregation import (
    LAYER_AGGREGATION_CHOICES,
    TransparentCombination,
    build_layer_aggregation,
)
from ..modules.multi_layer_attention import MultiLayerMultiheadAttention, parse_variant
from ..modules.source_feature_collector import SourceFeatureCollector
from .presets import post_norm, thesis_base, thesis_pre_norm, thesis_small
from .slots import DECODER_CROSS_ATTENTION, ENCODER_MEMORY, register_options

MULTI_LAYER = "multi-layer"
TRANSPARENT = "transparent"
NO_AGGREGATION = "none"
MASK_ZERO, MASK_DROP = "zero", "drop"
VARIANTS = ("M-00", "M-01", "M-10", "M-11")

TAPS_KEY = "mlmha_taps"  # n x T x B x C, bottom to top
TRANSPARENT_KEY = "transparent_memories"  # M x T x B x C, one per decoder layer


def add_args(parser):
    """Options of MLMHA and layer aggregation (fairseq passes its model argument group)."""
    parser.add_argument("--mlmha-variant", choices=VARIANTS,
                       help="MLMHA with --decoder-cross-attention multi-layer: joint (M-0x) or "
                            "layer-specific (M-1x) attention weights, concatenated (M-x0) or "
                            "summed (M-x1) contexts")
    parser.add_argument("--mlmha-top-n", type=int, metavar="N",
                       help="number of top encoder layers collected for MLMHA and layer "
                            "aggregation, 1..encoder layers (default: all)")
    parser.add_argument("--mlmha-bias", action="store_true",
                       help="biases on the MLMHA projections (default: bias-free, as the "
                            "authors' code)")
    parser.add_argument("--mlmha-share-query", action="store_true",
                       help="one MLMHA query projection for all n collected layers (default: "
                            "one per layer, as the paper's parameter counts)")
    parser.add_argument("--mlmha-share-kv", action="store_true",
                       help="one MLMHA key and one value projection for all n collected layers "
                            "(default: one pair per layer, as the paper's parameter counts)")
    parser.add_argument("--mlmha-mask-encoder-layer", type=int, metavar="L",
                       help="ablation (inference): remove what encoder layer L (1..L) "
                            "contributes, e.g. fairseq-generate --model-overrides "
                            "\"{'mlmha_mask_encoder_layer': 3}\"")
    parser.add_argument("--mlmha-mask-mode", choices=(MASK_ZERO, MASK_DROP),
                       help="zero: replace the layer's collected state by zeros (the paper's "
                            "words); drop: remove its attention logits and context (the "
                            "bias-free reading; MLMHA only)")
    parser.add_argument("--layer-aggregation", choices=(NO_AGGREGATION, TRANSPARENT) + LAYER_AGGREGATION_CHOICES,
                       help="one joint encoder memory for all decoder layers (thesis §2.2; "
                            "linear-combination = s-agg, iterative-combination = iter-c-agg), "
                            "or transparent attention (one mixture per decoder layer)")


def set_defaults(args):
    args.mlmha_variant = getattr(args, "mlmha_variant", "M-00")
    args.mlmha_top_n = getattr(args, "mlmha_top_n", None)
    args.mlmha_bias = getattr(args, "mlmha_bias", False)
    args.mlmha_share_query = getattr(args, "mlmha_share_query", False)
    args.mlmha_share_kv = getattr(args, "mlmha_share_kv", False)
    args.mlmha_mask_encoder_layer = getattr(args, "mlmha_mask_encoder_layer", None)
    args.mlmha_mask_mode = getattr(args, "mlmha_mask_mode", MASK_ZERO)
    args.layer_aggregation = getattr(args, "layer_aggregation", NO_AGGREGATION)


register_options(add_args, set_defaults)


def _uses_multi_layer_attention(cfg) -> bool:
    return DECODER_CROSS_ATTENTION.selected(cfg) == MULTI_LAYER


def _aggregation(cfg) -> str:
    return safe_getattr(cfg, "layer_aggregation", NO_AGGREGATION)


def _top_n(cfg) -> int:
    """n of the Source Feature Collector, validated against the encoder depth."""
    num_layers = cfg.encoder.layers
    top_n = safe_getattr(cfg, "mlmha_top_n") or num_layers
    if not 1 <= top_n <= num_layers:
        raise ValueError(f"--mlmha-top-n {top_n} needs 1 <= n <= {num_layers} (the encoder layers)")
    return top_n


def _masked_tap(cfg) -> Optional[int]:
    """Tap index (0..n-1) of --mlmha-mask-encoder-layer, or None."""
    layer = safe_getattr(cfg, "mlmha_mask_encoder_layer")
    if layer is None:
        return None
    num_layers, top_n = cfg.encoder.layers, _top_n(cfg)
    first = num_layers - top_n + 1
    if not first <= layer <= num_layers:
        raise ValueError(
            f"--mlmha-mask-encoder-layer {layer}: only encoder layers {first}..{num_layers} "
            f"are collected (--mlmha-top-n {top_n})"
        )
    return layer - first


def _build_collector(cfg) -> SourceFeatureCollector:
    collector = SourceFeatureCollector(_top_n(cfg), cfg.encoder.embed_dim, cfg.encoder.normalize_before)
    if safe_getattr(cfg, "mlmha_mask_mode", MASK_ZERO) == MASK_ZERO and _masked_tap(cfg) is not None:
        collector.zeroed_layer = cfg.mlmha_mask_encoder_layer
    return collector


class CollectedTaps(nn.Module):
    """Encoder memory for MLMHA: the Source Feature Collector's taps (spec A.3.1)."""

    output_keys = (TAPS_KEY,)

    def __init__(self, collector: SourceFeatureCollector):
        super().__init__()
        self.collector = collector

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        taps = self.collector(encoder_out["encoder_states"], encoder_out["encoder_out"][0])
        return {TAPS_KEY: [taps]}


class AggregatedMemory(nn.Module):
    """Encoder memory from a layer aggregation: ``H^a`` replaces the top encoder layer
    as every decoder layer's keys and values (thesis §2.2)."""

    output_keys = ("encoder_out",)

    def __init__(self, collector: SourceFeatureCollector, aggregation: nn.Module):
        super().__init__()
        self.collector = collector
        self.aggregation = aggregation

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        taps = self.collector(encoder_out["encoder_states"], encoder_out["encoder_out"][0])
        return {"encoder_out": [self.aggregation(taps)]}


class TransparentMemories(nn.Module):
    """Encoder memory for Transparent Attention: one mixture of the L+1 encoder states
    (embedding output, layers 1..L) per decoder layer. [choice] In pre-norm the top state
    is the normalised encoder output, as every other decoder memory of this package."""

    output_keys = (TRANSPARENT_KEY,)

    def __init__(self, num_states: int, num_decoder_layers: int):
        super().__init__()
        self.combination = TransparentCombination(num_states, num_decoder_layers)

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        states = encoder_out["encoder_states"][:-1] + encoder_out["encoder_out"]
        return {TRANSPARENT_KEY: [self.combination(torch.stack(states))]}


class TransparentCrossAttention(MultiheadAttention):
    """fairseq's cross-attention of decoder layer j over its own mixture z_j: the layers
    receive all M mixtures (``M x T x B x C``) and pick theirs."""

    memory_key = TRANSPARENT_KEY

    def __init__(self, layer_idx: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_idx = layer_idx

    def forward(self, query, key, value, *args, **kwargs):
        if key is not None:  # None at later incremental steps: keys are cached
            key = value = key[self.layer_idx]
        return super().forward(query, key, value, *args, **kwargs)


@DECODER_CROSS_ATTENTION.register(MULTI_LAYER, selectable=True)
def build_multi_layer_attention(cfg, layer_idx, embed_dim):
    if cfg.encoder.embed_dim != embed_dim:
        raise ValueError("--decoder-cross-attention multi-layer needs --encoder-embed-dim == --decoder-embed-dim")
    joint_weights, concat_contexts = parse_variant(safe_getattr(cfg, "mlmha_variant", "M-00"))
    attention = MultiLayerMultiheadAttention(
        embed_dim, cfg.decoder.attention_heads, _top_n(cfg), joint_weights, concat_contexts,
        dropout=cfg.attention_dropout, bias=safe_getattr(cfg, "mlmha_bias", False),
        share_query=safe_getattr(cfg, "mlmha_share_query", False),
        share_kv=safe_getattr(cfg, "mlmha_share_kv", False),
    )
    attention.memory_key = TAPS_KEY
    if safe_getattr(cfg, "mlmha_mask_mode", MASK_ZERO) == MASK_DROP:
        attention.dropped_layer_index = _masked_tap(cfg)
    return attention


@DECODER_CROSS_ATTENTION.register("transparent attention")
def build_transparent_cross_attention(cfg, layer_idx, embed_dim):
    if _aggregation(cfg) != TRANSPARENT:
        return None
    return TransparentCrossAttention(
        layer_idx, embed_dim, cfg.decoder.attention_heads,
        kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
        dropout=cfg.attention_dropout, encoder_decoder_attention=True,
    )


@ENCODER_MEMORY.register("mlmha_taps")
def build_collected_taps(cfg, num_layers):
    return CollectedTaps(_build_collector(cfg)) if _uses_multi_layer_attention(cfg) else None


@ENCODER_MEMORY.register("layer_aggregation")
def build_aggregated_memory(cfg, num_layers):
    name = _aggregation(cfg)
    if name in (NO_AGGREGATION, TRANSPARENT):
        return None
    if safe_getattr(cfg, "mlmha_mask_mode", MASK_ZERO) == MASK_DROP and _masked_tap(cfg) is not None:
        raise ValueError("--mlmha-mask-mode drop applies to MLMHA only; use zero with --layer-aggregation")
    aggregation = build_layer_aggregation(
        name, _top_n(cfg), cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim,
        cfg.dropout, cfg.activation_dropout,
    )
    return AggregatedMemory(_build_collector(cfg), aggregation)


@ENCODER_MEMORY.register("transparent_attention")
def build_transparent_memories(cfg, num_layers):
    if _aggregation(cfg) != TRANSPARENT:
        return None
    return TransparentMemories(num_layers + 1, cfg.decoder.layers)


@register_model_architecture("slot_transformer", "mlmha_transformer_iwslt")
def mlmha_transformer_iwslt(args):
    """MLMHA, IWSLT Es-En / En-Vi (spec A.5): n = L = 4, M-00; pre-norm with a LayerNorm
    per collected layer, as the authors' released code, which most likely produced the
    published scores."""
    args.decoder_cross_attention = getattr(args, "decoder_cross_attention", MULTI_LAYER)
    args.mlmha_variant = getattr(args, "mlmha_variant", "M-00")
    thesis_pre_norm(args)
    thesis_small(args)


@register_model_architecture("slot_transformer", "mlmha_transformer_wmt_en_de")
def mlmha_transformer_wmt_en_de(args):
    """MLMHA, WMT'14 En-De (spec A.5): n = L = 6, M-10; pre-norm as ``mlmha_transformer_iwslt``."""
    args.decoder_cross_attention = getattr(args, "decoder_cross_attention", MULTI_LAYER)
    args.mlmha_variant = getattr(args, "mlmha_variant", "M-10")
    thesis_pre_norm(args)
    thesis_base(args)


@register_model_architecture("slot_transformer", "layer_aggregation_transformer_iwslt")
def layer_aggregation_transformer_iwslt(args):
    """Layer aggregation (thesis §2.2) on the small IWSLT Transformer, Iter-C-Agg, n = L;
    pre-norm with a LayerNorm per collected layer, as the authors' code."""
    args.layer_aggregation = getattr(args, "layer_aggregation", "iter-c-agg")
    thesis_pre_norm(args)
    thesis_small(args)


@register_model_architecture("slot_transformer", "layer_aggregation_transformer_wmt_en_de")
def layer_aggregation_transformer_wmt_en_de(args):
    """Layer aggregation (thesis §2.2) on the base Transformer, Iter-C-Agg, n = L; pre-norm."""
    args.layer_aggregation = getattr(args, "layer_aggregation", "iter-c-agg")
    thesis_pre_norm(args)
    thesis_base(args)


# The same presets with post-norm layers, as the thesis' equations are written (Eqs. 2.10-2.11,
# 3.6); they are what the presets above built before they followed the authors' code.
@register_model_architecture("slot_transformer", "mlmha_transformer_iwslt_post_norm")
def mlmha_transformer_iwslt_post_norm(args):
    post_norm(args)
    mlmha_transformer_iwslt(args)


@register_model_architecture("slot_transformer", "mlmha_transformer_wmt_en_de_post_norm")
def mlmha_transformer_wmt_en_de_post_norm(args):
    post_norm(args)
    mlmha_transformer_wmt_en_de(args)


@register_model_architecture("slot_transformer", "layer_aggregation_transformer_iwslt_post_norm")
def layer_aggregation_transformer_iwslt_post_norm(args):
    post_norm(args)
    layer_aggregation_transformer_iwslt(args)


@register_model_architecture("slot_transformer", "layer_aggregation_transformer_wmt_en_de_post_norm")
def layer_aggregation_transformer_wmt_en_de_post_norm(args):
    post_norm(args)
    layer_aggregation_transformer_wmt_en_de(args)
