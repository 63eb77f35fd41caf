"""Encoder-based multi-level supervision, MS-l, and AIF (thesis ch. 4).

Model ``ms_transformer``: the slot Transformer (every slot option still applies) plus
auxiliary decoders:

* ``--aux-decoder-layers 1,2``: one *Aux-Decoder l* per listed encoder layer l < L, a full
  decoder stack of the Main-Decoder's shape (layers, d, heads, FFN, norm placement) whose
  cross-attention memory is the output ``H_e^l`` of encoder layer l (thesis Fig. 4.2). They share the
  target embedding, the positional embedding and the output projection with the
  Main-Decoder: the same Parameter objects, so each one adds exactly one decoder
  stack. Train with the criterion ``multi_decoder_label_smoothed_cross_entropy``
  (Eq. 4.1: ``J = L_m + gamma sum_l L_{a_l}``).
* ``--aux-fusion``: AIF (Eqs. 4.2-4.3). Every Main-Decoder layer adds
  ``z^f = sum_i f^i W^{a_i}`` right after its masked self-attention, with ``f^i`` the final
  hidden states of Aux-Decoder i (after its final LayerNorm in pre-norm: the features fed
  to the shared output projection, [choice]). Gradients flow from the
  Main-Decoder into the auxiliary decoders (no detach, thesis Eq. 4.3).
* Inference: without AIF only the Main-Decoder runs (the auxiliary decoders are never
  called in incremental decoding; ``python -m mlmha_fairseq.cli.strip_aux_decoders``
  removes them for deployment). With AIF they run incrementally in lock-step on the main
  beam's prefixes; they are submodules of ``model.decoder``, so fairseq's generator
  reorders their caches with the main beam. ``--decode-from aux:l`` decodes
  with Aux-Decoder l alone (thesis Table 4.7); ``--zero-aif`` is the "ind-decoder" of
  §4.5.5 (all ``W^{a}`` = 0, which equals skipping the fusion).

Where the pieces live: the auxiliary decoders are submodules of the Main-Decoder
(``decoder.aux_decoders.<i>``), so the Main-Decoder keeps fairseq's parameter names and a
stripped MS-l checkpoint is a plain slot-Transformer state dict; their memories come from
the encoder memory slot (``encoder_out["aux_memories"]``, collected also at generation time,
where fairseq calls the encoder without ``return_all_hiddens``). The multi-source model takes
the same options (off there by default): its Main-Decoder is this class with the input
combination in its layers, and the auxiliary decoders read layers of the primary source's
encoder ([choice], :mod:`.multi_source`).

Readings [choice]: pre-norm encoder states below the top are not normalised in fairseq
(only the top one passes the final LayerNorm), so in pre-norm each auxiliary memory
passes through its own LayerNorm, as the authors' code does for its taps; post-norm
states are used as they are. The auxiliary decoders are fairseq's standard decoder stacks: the decoder slots
(self-/cross-attention fillers, output fusion) apply to the Main-Decoder only.

Presets: ``ms_transformer`` (MS-1, base size), ``ms_transformer_iwslt`` (small 4+4, MS-3 +
AIF) and ``ms_transformer_wmt_en_de`` (base 6+6, MS-1 + AIF), pre-norm as the authors' code;
``*_post_norm``: the same with post-norm layers.
"""
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from fairseq.models import register_model
from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import LayerNorm

from ..errors import UsageError
from ..modules.auxiliary_information_fusion import AuxiliaryInformationFusion
from .presets import post_norm, thesis_base, thesis_pre_norm, thesis_small
from .slot_transformer import SlotTransformerDecoder, SlotTransformerModel, slot_transformer
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .slots import DECODER_AFTER_SELF_ATTENTION, ENCODER_MEMORY

AUX_MEMORIES = "aux_memories"  # K x T x B x C: H_e^l of each auxiliary decoder, in order
AUX_STATES = "aux_states"  # extra entry while decoding: each aux decoder's (features, extra)
AUX_OUT = "aux_out"  # extra entry of a full forward: each aux decoder's (logits, extra)
AUX_LAYERS = "aux_layers"  # extra entry of a full forward: the encoder layer of each aux decoder
AUX_FEATURES = "aux_features"  # layer extra: [f^1; ...; f^n], T x B x nC, the input of AIF
NO_AUX = "none"
MAIN = "main"
DECODE_FROM_AUX = re.compile(r"aux:(\d+)")
_AIF = Switch("--aux-fusion", lambda args: bool(getattr(args, "aux_fusion", False)))


def has_aux_decoders(args) -> bool:
    return str(getattr(args, "aux_decoder_layers", NO_AUX)).strip().lower() != NO_AUX


def aux_layers(cfg) -> List[int]:
    """The encoder layers (1-based, ascending) that feed an auxiliary decoder, validated."""
    spec = cfg.aux_decoder_layers  # parsed only for a model with the option (ms_transformer)
    if str(spec).strip().lower() == NO_AUX:
        return []
    if not str(spec).strip():
        raise UsageError("--aux-decoder-layers '': give the encoder layers of the auxiliary "
                         f"decoders, e.g. 1,2, or {NO_AUX}")
    num_layers = cfg.encoder.layers
    try:
        layers = [int(token) for token in str(spec).split(",")]
    except ValueError:
        raise UsageError(f"--aux-decoder-layers {spec!r}: expected comma-separated encoder "
                         "layer numbers, e.g. 1,2") from None
    if len(set(layers)) != len(layers):
        raise UsageError(f"--aux-decoder-layers {spec}: a layer is listed twice")
    for layer in layers:
        if not 1 <= layer < num_layers:
            raise UsageError(f"--aux-decoder-layers {spec}: auxiliary decoders attach to encoder "
                             f"layers 1..{num_layers - 1} (layer {num_layers} feeds the main decoder)")
    return sorted(layers)


def _decode_from(spec: str, layers: List[int]) -> Optional[int]:
    """Index of the auxiliary decoder named by --decode-from aux:L, or None for main."""
    if spec == MAIN:
        return None
    match = DECODE_FROM_AUX.fullmatch(spec)
    if match is None or int(match.group(1)) not in layers:
        choices = ", ".join([MAIN] + [f"aux:{layer}" for layer in layers])
        raise UsageError(f"--decode-from {spec}: choose one of {choices}")
    return layers.index(int(match.group(1)))


@dataclass(frozen=True)
class SupervisionOptions:
    """The Main-Decoder's view of multi-level supervision, validated once."""

    aux_layers: Tuple[int, ...]  # encoder layer of each auxiliary decoder, ascending
    fusion: bool  # AIF
    fusion_dropout: float
    zero_aif: bool
    decode_from: Optional[int]  # index of the auxiliary decoder that decodes, None: main

    @classmethod
    def from_cfg(cls, cfg) -> "SupervisionOptions":
        layers = aux_layers(cfg)
        if cfg.aux_fusion and not layers:
            raise UsageError("--aux-fusion needs auxiliary decoders (--aux-decoder-layers)")
        return cls(tuple(layers), cfg.aux_fusion, cfg.aux_fusion_dropout, cfg.zero_aif,
                   _decode_from(cfg.decode_from, layers))


MULTI_LEVEL_SUPERVISION = register_mechanism(Mechanism(
    "multi-level supervision", Switch("--aux-decoder-layers", has_aux_decoders), (
        Option("--aux-decoder-layers", "1", "attach an auxiliary decoder to each of these encoder "
               "layers (1-based, each < the number of encoder layers; 'none' for none), e.g. 1 "
               "(MS-1) or 1,2,3 (MS-123)", argparse=dict(metavar="L1,L2,..."), is_switch=True),
        Option("--aux-fusion", False, "AIF: add the auxiliary decoders' final states to every "
               "main-decoder layer after its self-attention (one bias-free d x d matrix per layer "
               "and auxiliary decoder)", argparse=dict(action="store_true"), is_switch=True,
               negation="--no-aux-fusion"),
        Option("--aux-fusion-dropout", 0.0, "dropout on the fused vector z^f (default 0: none, as "
               "in the thesis)", argparse=dict(type=float, metavar="P"), needs=_AIF),
        Option("--zero-aif", False, "analysis: the 'ind-decoder', AIF weights taken as zero (thesis "
               "§4.5.5), e.g. fairseq-generate --model-overrides \"{'zero_aif': True}\"",
               argparse=dict(action="store_true"), needs=_AIF, inference_only=True),
        Option("--decode-from", MAIN, "inference: produce the output with the main decoder (default) "
               "or with the auxiliary decoder of encoder layer L alone (thesis Table 4.7), e.g. "
               "fairseq-generate --model-overrides \"{'decode_from': 'aux:1'}\"",
               argparse=dict(metavar="main|aux:L"), inference_only=True),
    ), slot_wide=False, parse=SupervisionOptions.from_cfg))


class AuxiliaryMemories(nn.Module):
    """Encoder memory slot: the memory ``H_e^l`` of every auxiliary decoder (thesis §4.2),
    stacked as ``K x T x B x C`` under ``encoder_out["aux_memories"]``, so that fairseq's
    beam search reorders it with the rest of ``encoder_out``.

    Pre-norm: one own LayerNorm per auxiliary decoder (fairseq's lower encoder states are
    not normalised); post-norm: the states as they are.
    """

    output_keys = (AUX_MEMORIES,)

    def __init__(self, layers: List[int], embed_dim: int, normalize_before: bool):
        super().__init__()
        self.layers = layers
        self.aux_layer_norms = (
            nn.ModuleList(LayerNorm(embed_dim) for _ in layers) if normalize_before else None
        )

    def forward(self, encoder_out: Dict[str, List[Tensor]]) -> Dict[str, List[Tensor]]:
        states = encoder_out["encoder_states"]  # [embedding, layer 1..L], each T x B x C
        memories = [states[layer] for layer in self.layers]
        if self.aux_layer_norms is not None:
            memories = [norm(memory) for norm, memory in zip(self.aux_layer_norms, memories)]
        return {AUX_MEMORIES: [torch.stack(memories)]}


@ENCODER_MEMORY.register(AUX_MEMORIES,
                         given_by=lambda cfg: f"--aux-decoder-layers {cfg.aux_decoder_layers}")
def build_aux_memories(cfg, num_layers, reaches_decoder: bool = True):
    """The auxiliary decoders' memories, in the one encoder whose entries the decoder reads (a
    multi-source model's primary text encoder)."""
    if not has_aux_decoders(cfg) or not reaches_decoder:
        return None
    layers = list(MULTI_LEVEL_SUPERVISION.parsed(cfg).aux_layers)
    return AuxiliaryMemories(layers, cfg.encoder.embed_dim, cfg.encoder.normalize_before)


class AIFStep(AuxiliaryInformationFusion):
    """AIF in a Main-Decoder layer, the module of its after-self-attention slot:
    ``h^ <- h^ + z^f`` right after the masked self-attention sublayer (thesis Eq. 4.3), then
    cross-attention and FFN as usual. In post-norm ``h^`` is the self-attention sublayer's
    normalised output ``S_d^l``; in pre-norm the residual stream, before the
    cross-attention's LayerNorm. The decoder hands ``[f^1; ...; f^n]`` (T x B x nC) as the
    layer extra ``aux_features``; without it (the ind-decoder, ``--zero-aif``) the layer is
    the plain one."""

    layer_attribute = "aux_fusion"  # decoder.layers.<i>.aux_fusion.*: the names of AIF checkpoints

    def after_self_attention(self, x, extras: Dict[str, Tensor]):
        features = extras.get(AUX_FEATURES)
        return x if features is None else x + self(features)


@DECODER_AFTER_SELF_ATTENTION.register("aux_fusion", given_by=lambda cfg: _AIF.text)
def build_aux_fusion(cfg, layer_idx, embed_dim, **layer_context):
    """Every Main-Decoder layer of an AIF model (the layer context, e.g. a multi-source
    model's sources, is not read)."""
    if not _AIF.is_on(cfg):
        return None
    options = MULTI_LEVEL_SUPERVISION.parsed(cfg)
    return AIFStep(embed_dim, len(options.aux_layers), options.fusion_dropout)


class MultiLevelSupervisionDecoder(SlotTransformerDecoder):
    """The Main-Decoder (the slot decoder) holding the auxiliary decoders as submodules.

    ``forward`` returns the Main-Decoder's ``(logits, extra)``. A full (teacher-forced)
    forward also runs every auxiliary decoder on the same prefix and adds
    ``extra["aux_out"]``: one ``(logits B x T x V, extra)`` per auxiliary decoder, and
    ``extra["aux_layers"]``, their encoder layers, for the joint loss. Incremental decoding
    runs the auxiliary decoders only for AIF, in lock-step with the Main-Decoder.
    """

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, **decoder_options):
        """``decoder_options``: the slot decoder's (e.g. the multi-source model's
        ``layer_context`` and ``encoder_extras``), for the Main-Decoder only."""
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn, **decoder_options)
        self.options = MULTI_LEVEL_SUPERVISION.parsed(cfg)
        self.aux_layers = list(self.options.aux_layers)
        self._check_compatible(no_encoder_attn)
        self.aux_decoders = nn.ModuleList(
            self._build_aux_decoder(cfg, dictionary, embed_tokens) for _ in self.aux_layers
        )
        self.aux_fusion = self.options.fusion
        self.zero_aif = self.options.zero_aif
        self.decode_from = self.options.decode_from

    def _check_compatible(self, no_encoder_attn: bool):
        if not self.aux_layers:
            return
        option = f"--aux-decoder-layers {','.join(map(str, self.aux_layers))}"
        if no_encoder_attn:
            raise UsageError(f"{option}: auxiliary decoders attend to encoder layers: they cannot be "
                             "used with --no-cross-attention")
        if self.adaptive_softmax is not None:
            raise UsageError(f"{option}: auxiliary decoders share the output projection, which "
                             "--adaptive-softmax-cutoff replaces: use a plain softmax")
        if self.options.fusion and self.output_embed_dim != self.embed_dim:
            raise UsageError("--aux-fusion needs --decoder-output-dim == --decoder-embed-dim")

    def _build_aux_decoder(self, cfg, dictionary, embed_tokens) -> TransformerDecoderBase:
        """A decoder stack of the Main-Decoder's shape sharing its embeddings and output
        projection (the same modules, hence the same Parameter objects)."""
        decoder = TransformerDecoderBase(
            cfg, dictionary, embed_tokens, output_projection=self.output_projection
        )
        decoder.embed_positions = self.embed_positions
        return decoder

    @property
    def fuses(self) -> bool:
        """Whether the Main-Decoder adds the auxiliary decoders' states (AIF, not zeroed)."""
        return self.aux_fusion and not self.zero_aif

    def aux_encoder_out(self, encoder_out: Dict[str, List[Tensor]], index: int):
        """``encoder_out`` as auxiliary decoder ``index`` sees it: its encoder layer's
        states in place of the top layer (same padding mask). In a multi-source model these
        are the primary source's, whose entries ``encoder_out`` holds; the auxiliary decoders
        read no other source."""
        if AUX_MEMORIES not in encoder_out:
            raise KeyError("the auxiliary decoders need encoder_out['aux_memories'], which "
                           "this encoder does not produce")
        return {**encoder_out, "encoder_out": [encoder_out[AUX_MEMORIES][0][index]]}

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                features_only: bool = False, **kwargs):
        if self.decode_from is not None:
            return self.aux_decoders[self.decode_from](
                prev_output_tokens, encoder_out=self.aux_encoder_out(encoder_out, self.decode_from),
                incremental_state=incremental_state, features_only=features_only, **kwargs,
            )
        x, extra = super().forward(prev_output_tokens, encoder_out, incremental_state,
                                   features_only, **kwargs)
        aux_states = extra.pop(AUX_STATES)  # always set by extract_features below
        if incremental_state is None and not features_only:
            extra[AUX_OUT] = [(self.output_layer(features), aux_extra)
                              for features, aux_extra in aux_states]
            extra[AUX_LAYERS] = list(self.aux_layers)
        return x, extra

    def extract_features(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
    ):
        """The Main-Decoder's features (B x T x C); the auxiliary decoders run first when
        needed: always in a full forward (supervision), while decoding only for AIF."""
        aux_states = []
        if self.aux_decoders and (incremental_state is None or self.fuses):
            aux_states = [
                aux.extract_features(prev_output_tokens, self.aux_encoder_out(encoder_out, index),
                                     incremental_state)
                for index, aux in enumerate(self.aux_decoders)
            ]
        layer_extras = {}
        if self.fuses:
            # F^a = [f^1; ...; f^n]: each aux decoder's B x T x C features -> T x B x nC
            layer_extras[AUX_FEATURES] = torch.cat([f for f, _ in aux_states], dim=-1).transpose(0, 1)
        x, extra = super().extract_features(
            prev_output_tokens, encoder_out, incremental_state, full_context_alignment,
            alignment_layer, alignment_heads, layer_extras=layer_extras,
        )
        extra[AUX_STATES] = aux_states
        return x, extra


def main_decoder_class(model, cfg):
    """The decoder class of ``model``, a slot model class offering multi-level supervision, for
    its options ``cfg``: :class:`MultiLevelSupervisionDecoder` when they give auxiliary decoders,
    else the model's ``decoder_class``. That is MultiLevelSupervisionDecoder in
    ``ms_transformer``, so that its decoder keeps one interface without auxiliary decoders
    (``aux_decoders``, ``extra["aux_out"]``, ``--decode-from`` checked), as after
    ``strip_aux_decoders``; the slot decoder in the multi-source model, which without them is
    the model of before it offered them. Either class gives the same parameter names."""
    return MultiLevelSupervisionDecoder if has_aux_decoders(cfg) else model.decoder_class


@register_model("ms_transformer")
class MultiLevelSupervisionModel(SlotTransformerModel):
    """The slot Transformer with encoder-based multi-level supervision (Ampomah, thesis
    ch. 4): auxiliary decoders on lower encoder layers, optional AIF; see
    :mod:`mlmha_fairseq.models.multi_level_supervision`."""

    decoder_class = MultiLevelSupervisionDecoder
    decoder_class_for = classmethod(main_decoder_class)

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        MULTI_LEVEL_SUPERVISION.add_args(parser)

    @classmethod
    def complete_options(cls, args):
        ms_transformer(args)


@register_architecture("ms_transformer", "ms_transformer")
def ms_transformer(args):
    """MS-1 without AIF (the thesis' recommendation without AIF: one auxiliary decoder on a
    low layer, ch. 6) on fairseq's base Transformer."""
    MULTI_LEVEL_SUPERVISION.set_defaults(args)
    slot_transformer(args)


@register_architecture("ms_transformer", "ms_transformer_iwslt")
def ms_transformer_iwslt(args):
    """MS-3 + AIF on the small IWSLT Transformer (4+4, d=256): the thesis' best IWSLT
    setting (Tables 4.1, 4.3). [choice] The auxiliary decoder sits on layer L-1, i.e. layer
    3 of the preset's 4-layer encoder, also when --encoder-layers changes the depth."""
    thesis_pre_norm(args)  # the authors' code base, as chapter 3's presets
    thesis_small(args)  # first: the auxiliary layer depends on the encoder depth
    args.aux_decoder_layers = getattr(args, "aux_decoder_layers", str(args.encoder_layers - 1))
    args.aux_fusion = getattr(args, "aux_fusion", True)
    ms_transformer(args)


@register_architecture("ms_transformer", "ms_transformer_wmt_en_de")
def ms_transformer_wmt_en_de(args):
    """MS-1 + AIF on the base Transformer (6+6, d=512): the thesis' best WMT'14 En-De model
    (Table 4.4, 29.32). Pre-norm, as ``ms_transformer_iwslt``."""
    thesis_pre_norm(args)
    thesis_base(args)
    args.aux_fusion = getattr(args, "aux_fusion", True)  # on MS-1, the option's default
    ms_transformer(args)


# The same presets with post-norm layers, as the thesis' equations are written (Eq. 4.3 adds
# z^f after the self-attention sublayer's LayerNorm).
@register_architecture("ms_transformer", "ms_transformer_iwslt_post_norm")
def ms_transformer_iwslt_post_norm(args):
    post_norm(args)
    ms_transformer_iwslt(args)


@register_architecture("ms_transformer", "ms_transformer_wmt_en_de_post_norm")
def ms_transformer_wmt_en_de_post_norm(args):
    post_norm(args)
    ms_transformer_wmt_en_de(args)
