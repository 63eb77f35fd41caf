"""Joint attention strategies: MLMHA and the layer-aggregation family (Ampomah et al. 2020;
thesis ch. 3).

Fills three slots of the slot Transformer:

* decoder cross-attention ``multi-layer`` (``--decoder-cross-attention multi-layer``): every
  decoder layer attends to the top-n encoder layers with :class:`MultiLayerMultiheadAttention`
  (variants M-00, M-01, M-10, M-11, ``--mlmha-variant``);
* encoder memory: the Source Feature Collector's taps for MLMHA, or one joint memory made by a
  layer aggregation (``--layer-aggregation s-agg|iter-s-agg|c-agg|iter-c-agg``) that replaces
  the top encoder layer for every decoder layer;
* Transparent Attention (``--layer-aggregation transparent``, Bapna et al. 2018): one learned
  mixture of all encoder states (embedding included) per decoder layer;
* encoder layer inputs: DLCL (``--dlcl-encoder``, Wang et al. 2019): every encoder layer reads a
  learned linear combination of the embedding output and all layers below it, and the encoder's
  output (every decoder layer's memory) is the same combination over all of them.

Presets: ``mlmha_transformer_iwslt``, ``mlmha_transformer_wmt_en_de``,
``layer_aggregation_transformer_iwslt``, ``layer_aggregation_transformer_wmt_en_de`` (pre-norm,
as the authors' code), and each with the suffix ``_post_norm`` (post-norm, as the equations);
``dlcl_transformer_wmt_en_de`` and ``dlcl_transformer_iwslt`` (pre-norm, deeper encoders).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from fairseq.modules import MultiheadAttention

from ..errors import UsageError
from ..modules.dynamic_layer_combination import DynamicLinearCombination
from ..modules.layer_aggregation import (
    ITER_C_AGG,
    LAYER_AGGREGATION_CHOICES,
    TransparentCombination,
    build_layer_aggregation,
)
from ..modules.multi_layer_attention import M_00, M_10, VARIANTS, MultiLayerMultiheadAttention, parse_variant
from ..modules.source_feature_collector import SourceFeatureCollector
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .presets import post_norm, set_sizes, thesis_base, thesis_pre_norm, thesis_small
from .slots import DECODER_CROSS_ATTENTION, ENCODER_LAYER_INPUTS, ENCODER_MEMORY

MULTI_LAYER = "multi-layer"
TRANSPARENT = "transparent"
NO_AGGREGATION = "none"
MASK_ZERO, MASK_DROP = "zero", "drop"

TAPS_KEY = "mlmha_taps"  # n x T x B x C, bottom to top
TRANSPARENT_KEY = "transparent_memories"  # M x T x B x C, one per decoder layer


def _uses_multi_layer_attention(args) -> bool:
    return DECODER_CROSS_ATTENTION.selected(args) == MULTI_LAYER


def _aggregates(args) -> bool:
    return getattr(args, "layer_aggregation", NO_AGGREGATION) in LAYER_AGGREGATION_CHOICES


@dataclass(frozen=True)
class MLMHAOptions:
    """The MLMHA cross-attention of every decoder layer (Ampomah et al. 2020, Table 1 for the
    variant), validated once."""

    joint_weights: bool  # M-0x: one weight distribution over all collected layers' keys
    concat_contexts: bool  # M-x0: the n contexts concatenated (and projected), else summed
    bias: bool
    share_query: bool
    share_kv: bool

    @classmethod
    def from_cfg(cls, cfg) -> "MLMHAOptions":
        joint_weights, concat_contexts = parse_variant(cfg.mlmha_variant)
        return cls(joint_weights, concat_contexts, cfg.mlmha_bias, cfg.mlmha_share_query, cfg.mlmha_share_kv)


MLMHA = register_mechanism(Mechanism(
    "MLMHA", Switch(f"--decoder-cross-attention {MULTI_LAYER}", _uses_multi_layer_attention), (
        Option("--mlmha-variant", M_00, "MLMHA: joint (M-0x) or layer-specific (M-1x) attention "
               "weights, concatenated (M-x0) or summed (M-x1) contexts (Ampomah et al. 2020, "
               "Table 1)", argparse=dict(choices=VARIANTS)),
        Option("--mlmha-bias", False, "biases on the MLMHA projections (default: bias-free, as the "
               "authors' code)", argparse=dict(action="store_true")),
        Option("--mlmha-share-query", False, "one MLMHA query projection for all n collected "
               "layers (default: one per layer, as the paper's parameter counts)",
               argparse=dict(action="store_true")),
        Option("--mlmha-share-kv", False, "one MLMHA key and one value projection for all n "
               "collected layers (default: one pair per layer, as the paper's parameter counts)",
               argparse=dict(action="store_true")),
    ), parse=MLMHAOptions.from_cfg))

LAYER_AGGREGATION = register_mechanism(Mechanism(
    "layer aggregation", None, (
        Option("--layer-aggregation", NO_AGGREGATION,
               "one joint encoder memory for all decoder layers (thesis §3.2.1; "
               "linear-combination = s-agg, iterative-combination = iter-c-agg), or transparent "
               "attention (Bapna et al. 2018: one mixture per decoder layer)",
               argparse=dict(choices=(NO_AGGREGATION, TRANSPARENT) + LAYER_AGGREGATION_CHOICES),
               is_switch=True),
    )))


@dataclass(frozen=True)
class DLCLOptions:
    """The encoder stack DLCL combines: its layers and width, and where its LayerNorms go
    (pre-norm: on each layer output; post-norm: after each sum; Wang et al. 2019, §3)."""

    num_layers: int
    embed_dim: int
    normalize_before: bool

    @classmethod
    def from_cfg(cls, cfg) -> "DLCLOptions":
        if cfg.encoder.layers < 1:
            raise UsageError(f"--dlcl-encoder needs at least one encoder layer, got --encoder-layers "
                             f"{cfg.encoder.layers}")
        return cls(cfg.encoder.layers, cfg.encoder.embed_dim, cfg.encoder.normalize_before)


DLCL = register_mechanism(Mechanism(
    "DLCL", Switch("--dlcl-encoder", lambda args: bool(getattr(args, "dlcl_encoder", False))), (
        Option("--dlcl-encoder", False, "dynamic linear combination of layers (Wang et al. 2019): "
               "every encoder layer reads a learned weighted sum of the embedding output and all "
               "layers below it, the encoder output is the weighted sum of all of them",
               argparse=dict(action="store_true"), is_switch=True),
    ), parse=DLCLOptions.from_cfg))


@dataclass(frozen=True)
class CollectedLayers:
    """Which encoder layers MLMHA or layer aggregation collects, and the masked one."""

    num_layers: int  # of the encoder
    top_n: int
    masked_layer: Optional[int]  # encoder layer number (1..L), or None
    mask_mode: str

    @classmethod
    def from_cfg(cls, cfg) -> "CollectedLayers":
        num_layers = cfg.encoder.layers
        top_n = num_layers if cfg.mlmha_top_n is None else cfg.mlmha_top_n
        if not 1 <= top_n <= num_layers:
            raise UsageError(f"--mlmha-top-n {top_n} needs 1 <= n <= {num_layers} (the encoder layers)")
        layer = cfg.mlmha_mask_encoder_layer
        first = num_layers - top_n + 1
        if layer is not None and not first <= layer <= num_layers:
            raise UsageError(
                f"--mlmha-mask-encoder-layer {layer}: only encoder layers {first}..{num_layers} "
                f"are collected (--mlmha-top-n {top_n})"
            )
        return cls(num_layers, top_n, layer, cfg.mlmha_mask_mode)

    @property
    def masked_tap(self) -> Optional[int]:
        """Tap index (0..n-1) of the masked layer, or None."""
        return None if self.masked_layer is None else self.masked_layer - (self.num_layers - self.top_n + 1)

    def collector(self, cfg) -> SourceFeatureCollector:
        zeroed = self.masked_layer if self.mask_mode == MASK_ZERO else None
        return SourceFeatureCollector(self.top_n, cfg.encoder.embed_dim, cfg.encoder.normalize_before,
                                      zeroed_layer=zeroed)


_MASKED = Switch("--mlmha-mask-encoder-layer (--mask-encoder-layer)",
                 lambda args: getattr(args, "mlmha_mask_encoder_layer", None) is not None)

COLLECTED_LAYERS = register_mechanism(Mechanism(
    "the collected encoder layers of MLMHA and layer aggregation",
    Switch(f"--decoder-cross-attention {MULTI_LAYER} or --layer-aggregation "
           f"{'|'.join(LAYER_AGGREGATION_CHOICES)}",
           lambda args: _uses_multi_layer_attention(args) or _aggregates(args)), (
        Option("--mlmha-top-n", None, "number n of top encoder layers that MLMHA attends to or "
               "layer aggregation combines, 1..encoder layers (default: all)",
               aliases=("--top-encoder-layers",), argparse=dict(type=int, metavar="N"),
               none_means=lambda args: args.encoder_layers),
        Option("--mlmha-mask-encoder-layer", None, "ablation (inference) of MLMHA or layer "
               "aggregation: remove what encoder layer L (1..L) contributes, e.g. fairseq-generate "
               "--model-overrides \"{'mlmha_mask_encoder_layer': 3}\"",
               aliases=("--mask-encoder-layer",), argparse=dict(type=int, metavar="L"), inference_only=True),
        Option("--mlmha-mask-mode", MASK_ZERO, "zero: replace the masked layer's collected state "
               "by zeros (the paper's words); drop: remove its attention logits and context (the "
               "bias-free reading; MLMHA only)", aliases=("--mask-encoder-layer-mode",),
               argparse=dict(choices=(MASK_ZERO, MASK_DROP)), needs=_MASKED, inference_only=True),
    ), parse=CollectedLayers.from_cfg))


class CollectedTaps(nn.Module):
    """Encoder memory for MLMHA: the Source Feature Collector's taps (Ampomah et al. 2020,
    §4)."""

    output_keys = (TAPS_KEY,)

    def __init__(self, collector: SourceFeatureCollector):
        super().__init__()
        self.collector = collector

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        taps = self.collector(encoder_out["encoder_states"], encoder_out["encoder_out"][0])
        return {TAPS_KEY: [taps]}


class AggregatedMemory(nn.Module):
    """Encoder memory from a layer aggregation: ``H^a`` replaces the top encoder layer
    as every decoder layer's keys and values (thesis §3.2.1)."""

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
        raise UsageError("--decoder-cross-attention multi-layer needs --encoder-embed-dim == --decoder-embed-dim")
    layers, options = COLLECTED_LAYERS.parsed(cfg), MLMHA.parsed(cfg)
    return MultiLayerMultiheadAttention(
        embed_dim, cfg.decoder.attention_heads, layers.top_n, options.joint_weights, options.concat_contexts,
        dropout=cfg.attention_dropout, bias=options.bias,
        share_query=options.share_query, share_kv=options.share_kv,
        dropped_layer_index=layers.masked_tap if layers.mask_mode == MASK_DROP else None,
        memory_key=TAPS_KEY,
    )


@DECODER_CROSS_ATTENTION.register("transparent attention",
                                  given_by=lambda cfg: f"--layer-aggregation {TRANSPARENT}")
def build_transparent_cross_attention(cfg, layer_idx, embed_dim):
    if cfg.layer_aggregation != TRANSPARENT:
        return None
    return TransparentCrossAttention(
        layer_idx, embed_dim, cfg.decoder.attention_heads,
        kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim,
        dropout=cfg.attention_dropout, encoder_decoder_attention=True,
    )


@ENCODER_MEMORY.register(TAPS_KEY, given_by=lambda cfg: f"--decoder-cross-attention {MULTI_LAYER}")
def build_collected_taps(cfg, num_layers, **encoder_context):
    if not _uses_multi_layer_attention(cfg):
        return None
    return CollectedTaps(COLLECTED_LAYERS.parsed(cfg).collector(cfg))


@ENCODER_MEMORY.register("layer_aggregation",
                         given_by=lambda cfg: f"--layer-aggregation {cfg.layer_aggregation}")
def build_aggregated_memory(cfg, num_layers, **encoder_context):
    if not _aggregates(cfg):
        return None
    layers = COLLECTED_LAYERS.parsed(cfg)
    if layers.mask_mode == MASK_DROP and layers.masked_layer is not None:
        raise UsageError("--mlmha-mask-mode drop applies to MLMHA only; use zero with --layer-aggregation")
    aggregation = build_layer_aggregation(
        cfg.layer_aggregation, layers.top_n, cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim,
        cfg.dropout, cfg.activation_dropout,
    )
    return AggregatedMemory(layers.collector(cfg), aggregation)


@ENCODER_MEMORY.register("transparent_attention", given_by=lambda cfg: f"--layer-aggregation {TRANSPARENT}")
def build_transparent_memories(cfg, num_layers, **encoder_context):
    if cfg.layer_aggregation != TRANSPARENT:
        return None
    return TransparentMemories(num_layers + 1, cfg.decoder.layers)


class DLCLEncoderLayerInputs(DynamicLinearCombination):
    """DLCL as the encoder's layer inputs. Its last row makes ``encoder_out``, the memory every
    decoder layer attends to, so a mechanism that replaces ``encoder_out`` is refused with it."""

    output_keys = ("encoder_out",)


@ENCODER_LAYER_INPUTS.register("dlcl", given_by=lambda cfg: "--dlcl-encoder")
def build_dlcl_layer_inputs(cfg, num_layers):
    if not cfg.dlcl_encoder:
        return None
    options = DLCL.parsed(cfg)
    return DLCLEncoderLayerInputs(options.num_layers, options.embed_dim, options.normalize_before)


@register_architecture("slot_transformer", "mlmha_transformer_iwslt")
def mlmha_transformer_iwslt(args):
    """MLMHA, IWSLT Es-En / En-Vi (Ampomah et al. 2020, §5.2): n = L = 4, M-00; pre-norm with a LayerNorm
    per collected layer, as the authors' released code."""
    args.decoder_cross_attention = getattr(args, "decoder_cross_attention", MULTI_LAYER)
    thesis_pre_norm(args)
    thesis_small(args)


@register_architecture("slot_transformer", "mlmha_transformer_wmt_en_de")
def mlmha_transformer_wmt_en_de(args):
    """MLMHA, WMT'14 En-De (Ampomah et al. 2020, §5.2): n = L = 6, M-10; pre-norm as ``mlmha_transformer_iwslt``."""
    args.decoder_cross_attention = getattr(args, "decoder_cross_attention", MULTI_LAYER)
    args.mlmha_variant = getattr(args, "mlmha_variant", M_10)
    thesis_pre_norm(args)
    thesis_base(args)


@register_architecture("slot_transformer", "layer_aggregation_transformer_iwslt")
def layer_aggregation_transformer_iwslt(args):
    """Layer aggregation (thesis §3.2.1) on the small IWSLT Transformer, Iter-C-Agg, n = L;
    pre-norm with a LayerNorm per collected layer, as the authors' code."""
    args.layer_aggregation = getattr(args, "layer_aggregation", ITER_C_AGG)
    thesis_pre_norm(args)
    thesis_small(args)


@register_architecture("slot_transformer", "layer_aggregation_transformer_wmt_en_de")
def layer_aggregation_transformer_wmt_en_de(args):
    """Layer aggregation (thesis §3.2.1) on the base Transformer, Iter-C-Agg, n = L; pre-norm."""
    args.layer_aggregation = getattr(args, "layer_aggregation", ITER_C_AGG)
    thesis_pre_norm(args)
    thesis_base(args)


# The same presets with post-norm layers, as the thesis' equations are written (Eqs. 2.10-2.11,
# 3.6); they are what the presets above built before they followed the authors' code.
@register_architecture("slot_transformer", "mlmha_transformer_iwslt_post_norm")
def mlmha_transformer_iwslt_post_norm(args):
    post_norm(args)
    mlmha_transformer_iwslt(args)


@register_architecture("slot_transformer", "mlmha_transformer_wmt_en_de_post_norm")
def mlmha_transformer_wmt_en_de_post_norm(args):
    post_norm(args)
    mlmha_transformer_wmt_en_de(args)


@register_architecture("slot_transformer", "layer_aggregation_transformer_iwslt_post_norm")
def layer_aggregation_transformer_iwslt_post_norm(args):
    post_norm(args)
    layer_aggregation_transformer_iwslt(args)


@register_architecture("slot_transformer", "layer_aggregation_transformer_wmt_en_de_post_norm")
def layer_aggregation_transformer_wmt_en_de_post_norm(args):
    post_norm(args)
    layer_aggregation_transformer_wmt_en_de(args)


# DLCL (Wang et al. 2019): pre-norm, as the paper's deep systems, with an encoder deeper than the
# decoder (the paper deepens the encoder only, §4).
@register_architecture("slot_transformer", "dlcl_transformer_wmt_en_de")
def dlcl_transformer_wmt_en_de(args):
    """DLCL on the base Transformer (d=512, 8 heads, FFN 2048), pre-norm, 20 encoder and 6
    decoder layers [choice: the authors' deep presets have 25 (post-norm) and 30 (pre-norm)
    encoder layers; ``--encoder-layers 30`` gives theirs]."""
    args.dlcl_encoder = getattr(args, "dlcl_encoder", True)
    args.encoder_layers = getattr(args, "encoder_layers", 20)
    thesis_pre_norm(args)
    thesis_base(args)


@register_architecture("slot_transformer", "dlcl_transformer_iwslt")
def dlcl_transformer_iwslt(args):
    """DLCL on the small IWSLT Transformer of this family (d=256, 4 heads, FFN 1024), pre-norm,
    8 encoder and 4 decoder layers [choice: twice the encoder depth of ``thesis_small``]."""
    args.dlcl_encoder = getattr(args, "dlcl_encoder", True)
    set_sizes(args, embed_dim=256, heads=4, ffn=1024, encoder_layers=8, decoder_layers=4)
    thesis_pre_norm(args)
    thesis_small(args)
