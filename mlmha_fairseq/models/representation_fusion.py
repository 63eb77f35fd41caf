"""Multi-layer Representation Fusion, MLRF (Wang et al., COLING 2018).

Fills two slots of the slot Transformer with a fusion of all layer outputs
(:mod:`mlmha_fairseq.modules.representation_fusion`: AVG, FNN, SA):

* encoder memory (Enc-*, ``--mlrf-encoder-fusion``): the fused ``h^`` replaces the top
  encoder layer as the memory of every decoder cross-attention;
* decoder output (Dec-*, ``--mlrf-decoder-fusion``): the fused ``z^_j`` replaces the top
  decoder layer as the input of the output projection (Eq. 3);
* both (Both-*, e.g. Both-FNN-SA = FNN on the encoder, SA on the decoder).

By default K = L + 1 states are fused, the embedding output ("layer 0") included
(only this reading gives the paper's parameter counts, Table 2); ``--mlrf-no-embedding-layer``
fuses layers 1..L (Table 4, "Word Emb."). FNN and SA add a learned layer embedding
(``--mlrf-no-layer-embedding``: Table 4, "Layer Emb."); one table, indexed by the layer
number, is shared by the encoder and the decoder (§3.2), tied by a model hook after both
sides are built.

Presets: ``mlrf_transformer_iwslt_de_en`` (Both-FNN-SA, 4 hops) and
``mlrf_transformer_nist`` (Dec-SA, 4 hops, independent W1).
"""
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional

import torch
from torch import Tensor, nn

from fairseq.utils import get_available_activation_fns

from ..errors import UsageError

from ..modules.representation_fusion import (
    AVG,
    FNN,
    FUSION_FUNCTIONS,
    SA,
    FusionOptions,
    build_fusion,
    build_layer_embedding,
)
from .presets import set_sizes
from .slot_transformer import slot_transformer
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .slots import DECODER_OUTPUT, ENCODER_MEMORY, register_model_hook

NONE = "none"
ENCODER, DECODER = "encoder", "decoder"
SIDES = (ENCODER, DECODER)
SIDE_CHOICES = (NONE,) + FUSION_FUNCTIONS
FUSION_FLAG = {ENCODER: "--mlrf-encoder-fusion", DECODER: "--mlrf-decoder-fusion"}
DEFAULTS = FusionOptions()
EMBEDDING_LAYER = 0  # footnote 2: the word-embedding layer is layer 0
MLRF_FUSION = "mlrf_fusion"
FUSED_OUTPUT = {ENCODER: "the memory every decoder layer attends to (Enc-*)",
                DECODER: "the input of the output projection (Dec-*)"}
FUNCTION_HELP = ("avg (average pooling), fnn (one-hidden-layer FNN), sa (multi-hop self-attention "
                 "over layers, then an FNN)")


def _function(args, side: str) -> str:
    """The fusion function ``args`` asks of ``side``, unchecked: what the switches test, on
    arguments that may lack the option, and what :class:`MLRFOptions` validates."""
    return getattr(args, f"mlrf_{side}_fusion", NONE) or NONE


def _fuses_with(*functions: str) -> Callable[[Any], bool]:
    return lambda args: any(_function(args, side) in functions for side in SIDES)


def _needs(*functions: str) -> Switch:
    names = "/".join(f.upper() for f in functions)
    sides = " or ".join(f"{FUSION_FLAG[side]} {'|'.join(functions)}" for side in SIDES)
    return Switch(f"{names} fusion ({sides})", _fuses_with(*functions))


_SA, _FNN_OR_SA = _needs(SA), _needs(FNN, SA)


def _fusion_options(cfg) -> FusionOptions:
    """The fusion hyper-parameters of ``cfg``, validated."""
    options = FusionOptions(
        hops=cfg.mlrf_hops,
        attention_dim=cfg.mlrf_attention_dim,
        ffn_dim=cfg.mlrf_ffn_dim,
        attention_activation=cfg.mlrf_attention_activation,
        ffn_activation=cfg.mlrf_ffn_activation,
        independent_w1=cfg.mlrf_indep_w1,
        attention_bias=cfg.mlrf_attention_bias,
        dropout=cfg.mlrf_fusion_dropout,
        average_layer_norm=not cfg.mlrf_no_avg_layernorm,
    )
    for flag, value in (("--mlrf-hops", options.hops), ("--mlrf-attention-dim", options.attention_dim),
                        ("--mlrf-ffn-dim", options.ffn_dim)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be >= 1")
    if not 0.0 <= options.dropout < 1.0:
        raise UsageError(f"--mlrf-fusion-dropout {options.dropout} must be in [0, 1)")
    return options


def _checked_function(cfg, side: str) -> str:
    """The fusion function of ``side``: the command line offers only the choices, a checkpoint's
    arguments or ``--model-overrides`` may hold anything."""
    function = _function(cfg, side)
    if function not in SIDE_CHOICES:
        raise UsageError(f"{FUSION_FLAG[side]} {function}: choose one of {', '.join(SIDE_CHOICES)}")
    return function


def _num_layers(cfg, side: str) -> int:
    return cfg.encoder.layers if side == ENCODER else cfg.decoder.layers


def _embed_dim(cfg, side: str) -> int:
    return cfg.encoder.embed_dim if side == ENCODER else cfg.decoder.embed_dim


def _layer_embedding_rows(cfg, sides: FrozenSet[str], include_embedding_layer: bool) -> int:
    """Rows of the shared table: one per fused layer number, first..max(L), over the
    ``sides`` that use it; they must then have the same width."""
    if len({_embed_dim(cfg, side) for side in sides}) > 1:
        raise UsageError("the MLRF layer embedding is shared by encoder and decoder: it needs "
                         "--encoder-embed-dim == --decoder-embed-dim (or --mlrf-no-layer-embedding)")
    first_layer = EMBEDDING_LAYER + int(not include_embedding_layer)
    return 1 + max(_num_layers(cfg, side) for side in sides) - first_layer


@dataclass(frozen=True)
class MLRFOptions:
    """What MLRF fuses where, validated once: each side's fusion function, whether the
    embedding output is fused, the sides whose fusion adds the shared layer embedding (Eq. 4)
    and the rows of that table, and the fusion hyper-parameters."""

    functions: Mapping[str, str]  # ENCODER/DECODER -> NONE (the top layer, unfused) or a function
    include_embedding_layer: bool  # K = L + 1 (layer 0 fused), else K = L (Table 4 "Word Emb.")
    layer_embedding_sides: FrozenSet[str]
    layer_embedding_rows: int  # 0 when no side adds the layer embedding
    fusion: FusionOptions

    @classmethod
    def from_cfg(cls, cfg) -> "MLRFOptions":
        functions = {side: _checked_function(cfg, side) for side in SIDES}
        fusion = _fusion_options(cfg)
        include_embedding_layer = not cfg.mlrf_no_embedding_layer
        # Eq. 4: FNN and SA add the layer embedding (AVG has none: AverageFusion)
        sides = frozenset(side for side in SIDES
                          if functions[side] in (FNN, SA) and not cfg.mlrf_no_layer_embedding)
        rows = _layer_embedding_rows(cfg, sides, include_embedding_layer) if sides else 0
        return cls(MappingProxyType(functions), include_embedding_layer, sides, rows, fusion)


MLRF = register_mechanism(Mechanism(
    "MLRF", _needs(*FUSION_FUNCTIONS), (
        *(Option(FUSION_FLAG[side], NONE, f"fuse all {side} layer outputs (embedding included) "
                 f"into {FUSED_OUTPUT[side]}: {FUNCTION_HELP}", argparse=dict(choices=SIDE_CHOICES),
                 is_switch=True) for side in SIDES),
        Option("--mlrf-hops", DEFAULTS.hops, f"SA fusion: number of attention hops n_hop (default "
               f"{DEFAULTS.hops})", argparse=dict(type=int, metavar="N"), needs=_SA),
        Option("--mlrf-attention-dim", DEFAULTS.attention_dim, f"SA fusion: inner size d_a of W1 "
               f"(default {DEFAULTS.attention_dim})", argparse=dict(type=int, metavar="D_A"), needs=_SA),
        Option("--mlrf-ffn-dim", DEFAULTS.ffn_dim, f"FNN and SA fusion: hidden size d_f (default "
               f"{DEFAULTS.ffn_dim})", argparse=dict(type=int, metavar="D_F"), needs=_FNN_OR_SA),
        Option("--mlrf-indep-w1", DEFAULTS.independent_w1, "SA fusion: one W1 per layer (the paper's "
               "'+ indep. W1')", argparse=dict(action="store_true"), needs=_SA),
        Option("--mlrf-no-embedding-layer", False, "fuse layers 1..L only, without the embedding "
               "output (Table 4 'Word Emb.' ablation)", argparse=dict(action="store_true")),
        Option("--mlrf-no-layer-embedding", False, "FNN and SA fusion without the learned layer "
               "embedding (Table 4 'Layer Emb.' ablation)", argparse=dict(action="store_true"),
               needs=_FNN_OR_SA),
        Option("--mlrf-attention-activation", DEFAULTS.attention_activation, "SA fusion: sigma of "
               f"Eq. 5 (default {DEFAULTS.attention_activation})",
               argparse=dict(choices=get_available_activation_fns()), needs=_SA),
        Option("--mlrf-ffn-activation", DEFAULTS.ffn_activation, "FNN and SA fusion: activation of "
               f"the hidden layer (default {DEFAULTS.ffn_activation})",
               argparse=dict(choices=get_available_activation_fns()), needs=_FNN_OR_SA),
        Option("--mlrf-attention-bias", DEFAULTS.attention_bias, "SA fusion: biases on W1 and W2 "
               "(default: bias-free)", argparse=dict(action="store_true"), needs=_SA),
        Option("--mlrf-fusion-dropout", DEFAULTS.dropout, "dropout on the fusion FNN's hidden layer "
               f"(default {DEFAULTS.dropout})", argparse=dict(type=float, metavar="P"), needs=_FNN_OR_SA),
        Option("--mlrf-no-avg-layernorm", not DEFAULTS.average_layer_norm, "AVG fusion without the "
               "LayerNorm after it", argparse=dict(action="store_true"), needs=_needs(AVG)),
    ), parse=MLRFOptions.from_cfg))


class LayerFusion(nn.Module):
    """Fusion of a stack's layer outputs ``[layer 0 (embedding), 1..L]`` (Eq. 3).

    ``layer_embedding``: the shared table, or None; row r belongs to layer number
    ``first_layer + r``. With ``include_embedding_layer`` K = L + 1 states are fused, else
    K = L (layers 1..L, rows 0..L-1: no row is allocated for the unused embedding layer).
    """

    def __init__(self, fusion: nn.Module, num_layers: int, include_embedding_layer: bool,
                 layer_embedding: Optional[nn.Embedding]):
        super().__init__()
        self.fusion = fusion
        self.num_layers = num_layers
        self.first_layer = EMBEDDING_LAYER if include_embedding_layer else EMBEDDING_LAYER + 1
        self.layer_embedding = layer_embedding

    def fuse(self, states: List[Tensor]) -> Tensor:
        """``states``: L + 1 tensors T x B x C, layer 0 to L -> T x B x C."""
        if len(states) != self.num_layers + 1:
            raise ValueError(f"MLRF fusion expects {self.num_layers + 1} layer outputs "
                             f"(embedding and {self.num_layers} layers), got {len(states)}")
        stacked = torch.stack(states[self.first_layer:])  # K x T x B x C
        rows = None
        if self.layer_embedding is not None:
            # K x C: layers first..L. A lookup, not a slice of the weight: torch's module
            # tracker (used by its FLOP counter) fails on a slice of a parameter under no_grad.
            positions = torch.arange(len(stacked), device=stacked.device)
            rows = self.layer_embedding(positions)
        return self.fusion(stacked, rows)

    def upgrade_state_dict_named(self, state_dict, name):
        """Checkpoints written before the table lost its unused row: with
        ``--mlrf-no-embedding-layer`` they hold one more row, row 0 (the embedding layer's,
        never trained), which is dropped."""
        key = f"{name}.layer_embedding.weight"
        if self.layer_embedding is None or self.first_layer == EMBEDDING_LAYER or key not in state_dict:
            return
        if state_dict[key].size(0) == self.layer_embedding.num_embeddings + 1:
            state_dict[key] = state_dict[key][1:]


class FusedEncoderMemory(LayerFusion):
    """Enc-*: ``h^ = phi(H)`` replaces the top encoder layer for every decoder layer.

    [choice] The top state is fairseq's ``encoder_out``: in pre-norm it is
    normalised by the encoder's final LayerNorm, as every decoder memory of this package,
    while fairseq's lower states are not; in post-norm (the paper) all states are the
    layers' own normalised outputs, so nothing changes.
    """

    output_keys = ("encoder_out",)

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        states = encoder_out["encoder_states"][:-1] + encoder_out["encoder_out"]
        return {"encoder_out": [self.fuse(states)]}


class FusedDecoderOutput(LayerFusion):
    """Dec-*: ``z^_j = phi(Z_j)`` replaces the top decoder layer before the output
    projection. Gets the decoder's ``inner_states`` (before the final LayerNorm, which the
    slot applies afterwards in pre-norm); at an incremental step they hold that step only,
    which is all a position-wise fusion needs."""

    def forward(self, inner_states: List[Tensor]) -> Tensor:
        return self.fuse(inner_states)


def _build_layer_fusion(wrapper, cfg, side: str, num_layers: int) -> Optional[LayerFusion]:
    options = MLRF.parsed(cfg)
    function = options.functions[side]
    if function == NONE:
        return None
    num_states = num_layers + int(options.include_embedding_layer)  # K
    embed_dim = _embed_dim(cfg, side)
    fusion = build_fusion(function, num_states, embed_dim, options.fusion)
    layer_embedding = None
    if side in options.layer_embedding_sides:
        layer_embedding = build_layer_embedding(options.layer_embedding_rows, embed_dim)
    return wrapper(fusion, num_layers, options.include_embedding_layer, layer_embedding)


def _given_by(side: str) -> Callable[[Any], str]:
    return lambda cfg: f"{FUSION_FLAG[side]} {MLRF.parsed(cfg).functions[side]}"


@ENCODER_MEMORY.register(MLRF_FUSION, given_by=_given_by(ENCODER))
def build_fused_encoder_memory(cfg, num_layers, **encoder_context):
    return _build_layer_fusion(FusedEncoderMemory, cfg, ENCODER, num_layers)


@DECODER_OUTPUT.register(MLRF_FUSION, given_by=_given_by(DECODER))
def build_fused_decoder_output(cfg, num_layers):
    return _build_layer_fusion(FusedDecoderOutput, cfg, DECODER, num_layers)


@register_model_hook
def share_layer_embedding(encoder: nn.Module, decoder: nn.Module):
    """One layer-embedding table for the encoder and the decoder (Wang et al. 2018, §3.2,
    "for simple implementation"): the decoder's fusion uses the encoder's table. The state
    dict keeps both keys (the same tensor), ``model.parameters()`` yields it once."""
    memory = encoder.memories[MLRF_FUSION] if MLRF_FUSION in encoder.memories else None
    output = decoder.output_fusion
    if not (isinstance(memory, LayerFusion) and isinstance(output, LayerFusion)):
        return
    if memory.layer_embedding is not None and output.layer_embedding is not None:
        output.layer_embedding = memory.layer_embedding


def _mlrf_settings(args):
    """Paper §4.2: post-norm, residual dropout 0.1, separate source and target vocabularies
    with an untied output matrix (no --share-all-embeddings)."""
    args.dropout = getattr(args, "dropout", 0.1)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", False)
    args.share_decoder_input_output_embed = getattr(args, "share_decoder_input_output_embed", False)
    slot_transformer(args)  # n_hop 4, d_a 1024, d_f 512: the option defaults (FusionOptions)


@register_architecture("slot_transformer", "mlrf_transformer_iwslt_de_en")
def mlrf_transformer_iwslt_de_en(args):
    """IWSLT'14 De-En (§4.2): d=256, FFN 1024, 3+3 layers, 4 heads [choice: not stated];
    the best system, Both-FNN-SA (nhop = 4), d_a 1024, d_f 512 (Table 2)."""
    set_sizes(args, embed_dim=256, heads=4, ffn=1024, encoder_layers=3, decoder_layers=3)
    args.mlrf_encoder_fusion = getattr(args, "mlrf_encoder_fusion", FNN)
    args.mlrf_decoder_fusion = getattr(args, "mlrf_decoder_fusion", SA)
    _mlrf_settings(args)


@register_architecture("slot_transformer", "mlrf_transformer_nist")
def mlrf_transformer_nist(args):
    """NIST Zh-En (§4.2): d=512, FFN 2048, 6+6 layers (fairseq's base sizes), 8 heads
    [choice: not stated]; the
    best system, Dec-SA (nhop = 4) + indep. W1 (Table 3), d_a 1024 / d_f 512 [choice: not
    stated for Zh-En, taken from De-En]."""
    args.mlrf_decoder_fusion = getattr(args, "mlrf_decoder_fusion", SA)
    args.mlrf_indep_w1 = getattr(args, "mlrf_indep_w1", True)
    _mlrf_settings(args)
