"""Multi-source Transformer: input combination strategies for the decoder (Libovický, Helcl and
Mareček, WMT 2018; seed 004, spec mma_multisource.md B, pitfalls M1-M16).

Model ``multi_source_transformer`` (with ``--task multi_source_translation``):

* one encoder per source, in ``--source-langs`` order: a :class:`SlotTransformerEncoder` per
  text source (so the encoder-side slot options, e.g. ``--encoder-self-attention``, apply to
  every text encoder), a linear projection ``Linear(C, d)`` per image-feature source
  ([paper] "a linear projection to 512"; no positional encoding, no mask);
* the decoder cross-attention slot filled by the strategy of ``--combination-strategy``
  (``serial``, ``parallel``, ``flat``, ``hierarchical``;
  :mod:`mlmha_fairseq.modules.input_combination`), in pre-norm (``--decoder-normalize-before``,
  the reference implementation) or post-norm (fairseq's default) form. The filler claims
  the slot whenever the model sets ``combination_strategy``, so ``--combination-strategy``
  is the public option and the slot's ``--decoder-cross-attention`` stays ``standard``
  ([choice]: the strategies need the multi-source encoder output and decoder layer, so
  they are not offered to ``slot_transformer``).

Embeddings ([paper] one matrix shared by the text encoders and the decoder, tied to the
output layer): ``--share-all-embeddings`` (the presets' default); ``--share-encoder-embeddings``
shares one matrix among the text encoders only; otherwise every encoder has its own.

Encoder output: the primary source's fairseq entries (so fairseq's generator, alignment and
``--print-alignment`` see one ordinary source) plus ``multi_source_memories`` (n tensors
``S_k x B x C``) and ``multi_source_padding_masks`` (n tensors ``B x S_k``), which
:meth:`MultiSourceEncoder.reorder_encoder_out` reorders along the batch (pitfall M4).

Presets: ``multimodal_transformer_multi30k`` and ``multi_source_transformer_europarl``.
"""
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
from fairseq.models import FairseqEncoder, register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.utils import safe_getattr
from torch import Tensor, nn

from ..data.multi_source_dataset import IMAGE
from ..modules.input_combination import (
    HIERARCHICAL,
    MEMORY_KEY,
    SERIAL,
    STRATEGIES,
    InputCombination,
    build_input_combination,
)
from .slot_transformer import (
    ENCODER_OUT,
    SlotTransformerDecoder,
    SlotTransformerDecoderLayer,
    SlotTransformerEncoder,
    SlotTransformerModel,
    next_layer_index,
    slot_transformer,
    wrap_layer,
)
from .slots import DECODER_CROSS_ATTENTION, apply_model_hooks

MASKS_KEY = "multi_source_padding_masks"  # encoder_out entry: one B x S_k mask per source
PADDING_MASK = "encoder_padding_mask"
# set by MultiSourceTransformerModel.build_model from the task (not command-line options)
NAMES, KINDS, PRIMARY, CHANNELS = (
    "multi_source_names", "multi_source_kinds", "multi_source_primary", "multi_source_channels")
# fairseq decoder-layer options that the multi-source layer does not implement
UNSUPPORTED_LAYER_OPTIONS = (("--scale-attn", "attn_ln"), ("--scale-heads", "c_attn"),
                             ("--scale-fc", "ffn_layernorm"), ("--scale-resids", "w_resid"))


def add_args(parser):
    """Options of the multi-source model (fairseq passes its model argument group)."""
    parser.add_argument("--combination-strategy", choices=STRATEGIES,
                        help="how the decoder combines the sources (Libovicky et al. 2018, "
                             "Fig. 1): serial, parallel (summed contexts), flat (one attention "
                             "over all states) or hierarchical (attention over the per-source "
                             "contexts)")
    parser.add_argument("--hier-attention-heads", type=int, metavar="H",
                        help="heads of the hierarchical second level (default: "
                             "--decoder-attention-heads)")
    parser.add_argument("--share-encoder-embeddings", action="store_true",
                        help="one embedding matrix for all text encoders (implied by "
                             "--share-all-embeddings, which also ties the decoder's)")


class ImageFeatureEncoder(nn.Module):
    """The image "encoder": ``Linear(C, d)`` over precomputed features ([paper] B.3),
    ``B x P x C`` -> ``P x B x d``, every position valid (pitfall M2)."""

    def __init__(self, channels: int, embed_dim: int):
        super().__init__()
        self.projection = nn.Linear(channels, embed_dim)

    def forward(self, features: Tensor, lengths: Optional[Tensor] = None) -> Dict[str, List[Tensor]]:
        x = self.projection(features).transpose(0, 1)  # P x B x d
        mask = torch.zeros(features.shape[:2], dtype=torch.bool, device=features.device)  # B x P
        return {ENCODER_OUT: [x], PADDING_MASK: [mask]}


class MultiSourceEncoder(FairseqEncoder):
    """n encoders, one per source; see the module docstring for the output."""

    def __init__(self, dictionary, encoders: List[nn.Module], names: List[str],
                 primary_index: int):
        super().__init__(dictionary)
        self.encoders = nn.ModuleList(encoders)
        self.names = names
        self.primary_index = primary_index

    def forward(self, src_tokens, src_lengths=None, multi_source_inputs=None,
                multi_source_lengths=None, return_all_hiddens: bool = False):
        """``multi_source_inputs``: per source ``B x S_k`` token ids or ``B x P x C``
        features (``src_tokens`` is the primary one among them)."""
        if multi_source_inputs is None or len(multi_source_inputs) != len(self.encoders):
            raise ValueError(
                f"the multi-source encoder needs its {len(self.encoders)} sources "
                f"({','.join(self.names)}) in net_input['multi_source_inputs']: use "
                "--task multi_source_translation"
            )
        lengths = multi_source_lengths or [None] * len(self.encoders)
        outputs = []
        for k, (encoder, inputs, length) in enumerate(zip(self.encoders, multi_source_inputs, lengths)):
            if isinstance(encoder, ImageFeatureEncoder):
                outputs.append(encoder(inputs, length))
            else:
                all_hiddens = return_all_hiddens and k == self.primary_index
                outputs.append(encoder(inputs, src_lengths=length, return_all_hiddens=all_hiddens))
        encoder_out = dict(outputs[self.primary_index])
        encoder_out[MEMORY_KEY] = [out[ENCODER_OUT][0] for out in outputs]
        encoder_out[MASKS_KEY] = [out[PADDING_MASK][0] for out in outputs]
        return encoder_out

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        """Reorder every source (memories along dim 1, masks along dim 0) and the primary
        source's fairseq entries."""
        primary = self.encoders[self.primary_index]
        own = {key: value for key, value in encoder_out.items() if key not in (MEMORY_KEY, MASKS_KEY)}
        reordered = primary.reorder_encoder_out(own, new_order)
        reordered[MEMORY_KEY] = [m.index_select(1, new_order) for m in encoder_out[MEMORY_KEY]]
        reordered[MASKS_KEY] = [m.index_select(0, new_order) for m in encoder_out[MASKS_KEY]]
        return reordered

    def max_positions(self):
        return min(e.max_positions() for e in self.encoders if isinstance(e, SlotTransformerEncoder))


class MultiSourceDecoderLayer(SlotTransformerDecoderLayer):
    """fairseq's decoder layer whose encoder-decoder attention sublayer is an
    :class:`InputCombination` (residuals and LayerNorms included, since serial chains n
    residual sublayers). The self-attention and feed-forward sublayers are fairseq's,
    computed as ``TransformerDecoderLayerBase.forward`` does; the combination owns its
    LayerNorms, so the layer's ``encoder_attn_layer_norm`` is removed (pitfall M9)."""

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False):
        super().__init__(cfg, layer_idx, no_encoder_attn)
        unsupported = [option for option, name in UNSUPPORTED_LAYER_OPTIONS
                       if getattr(self, name) is not None]
        if unsupported:
            raise ValueError(f"{', '.join(unsupported)}: not supported by the multi-source decoder")
        if not isinstance(self.encoder_attn, InputCombination):
            raise ValueError("the multi-source decoder's cross-attention slot is claimed by "
                             f"{type(self.encoder_attn).__name__}: use --combination-strategy")
        self.encoder_attn_layer_norm = None

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                self_attn_mask=None, self_attn_padding_mask=None, need_attn: bool = False,
                need_head_weights: bool = False):
        """``x``: T x B x C; ``encoder_out``/``encoder_padding_mask``: the lists of the n
        memories and masks (:meth:`MultiSourceDecoder.cross_attention_memory`)."""
        need_attn = need_attn or need_head_weights
        x = self._self_attention_sublayer(x, incremental_state, self_attn_mask, self_attn_padding_mask)
        x, attn = self.encoder_attn(
            x, encoder_out, encoder_padding_mask, incremental_state,
            need_weights=need_attn or (not self.training and self.need_attn),
            need_head_weights=need_head_weights,
        )
        return self._feed_forward_sublayer(x), attn, None

    def _self_attention_sublayer(self, x, incremental_state, attn_mask, key_padding_mask):
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=key_padding_mask,
                              incremental_state=incremental_state, need_weights=False,
                              attn_mask=attn_mask)
        x = self.residual_connection(self.dropout_module(x), residual)
        return x if self.normalize_before else self.self_attn_layer_norm(x)

    def _feed_forward_sublayer(self, x):
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_dropout_module(self.activation_fn(self.fc1(x)))
        x = self.residual_connection(self.dropout_module(self.fc2(x)), residual)
        return x if self.normalize_before else self.final_layer_norm(x)


class MultiSourceDecoder(SlotTransformerDecoder):
    """The slot decoder with :class:`MultiSourceDecoderLayer` layers, which receive all n
    memories and masks through fairseq's own layer loop."""

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = MultiSourceDecoderLayer(cfg, next_layer_index(self), no_encoder_attn)
        return wrap_layer(layer, cfg)

    def cross_attention_memory(self, encoder_out):
        """fairseq's loop hands ``encoder_out["encoder_out"][0]`` and
        ``encoder_out["encoder_padding_mask"][0]`` to every layer: make them the lists of
        per-source memories and masks."""
        if encoder_out is None:
            return None
        if MEMORY_KEY not in encoder_out:
            raise KeyError("the multi-source decoder needs the multi-source encoder's output")
        return {**encoder_out, ENCODER_OUT: [encoder_out[MEMORY_KEY]],
                PADDING_MASK: [encoder_out[MASKS_KEY]]}


@DECODER_CROSS_ATTENTION.register("input combination")
def build_combination(cfg, layer_idx, embed_dim):
    """The strategy's sublayer for every decoder layer of a multi-source model."""
    strategy = safe_getattr(cfg, "combination_strategy")
    if strategy is None:
        return None
    kinds = safe_getattr(cfg, KINDS)
    if kinds is None:
        raise ValueError("--combination-strategy needs --arch multi_source_transformer and "
                         "--task multi_source_translation")
    hier_heads = safe_getattr(cfg, "hier_attention_heads")
    if hier_heads is not None:
        if strategy != HIERARCHICAL:
            raise ValueError(f"--hier-attention-heads applies to --combination-strategy "
                             f"{HIERARCHICAL}, not {strategy}")
        if hier_heads < 1 or embed_dim % hier_heads:
            raise ValueError(f"--hier-attention-heads {hier_heads} must divide "
                             f"--decoder-embed-dim {embed_dim}")
    return build_input_combination(
        strategy, embed_dim, cfg.decoder.attention_heads, len(kinds), cfg.encoder.embed_dim,
        cfg.dropout, cfg.attention_dropout, cfg.decoder.normalize_before,
        primary_index=safe_getattr(cfg, PRIMARY), hier_heads=hier_heads,
    )


@register_model("multi_source_transformer")
class MultiSourceTransformerModel(SlotTransformerModel):
    """Multi-source Transformer (Libovický et al., WMT 2018); see the module docstring."""

    is_multi_source = True  # checked by the multi_source_translation task
    decoder_class = MultiSourceDecoder

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_args(parser)

    @classmethod
    def build_model(cls, args, task):
        multi_source_transformer(args)  # complete options of older checkpoints
        if not hasattr(task, "source_kinds"):
            raise ValueError("--arch multi_source_transformer needs --task multi_source_translation")
        if safe_getattr(args, "no_cross_attention"):
            raise ValueError("--no-cross-attention: the multi-source decoder attends to its sources")
        setattr(args, NAMES, list(task.source_names))
        setattr(args, KINDS, list(task.source_kinds))
        setattr(args, PRIMARY, task.primary_index)
        setattr(args, CHANNELS, [task.image_channels.get(name, 0) for name in task.source_names])
        # fairseq's TransformerModel.build_model; the slot model hooks, written for one
        # encoder, then run once per text encoder (e.g. --encoder-no-token-positional-embeddings)
        model = super(SlotTransformerModel, cls).build_model(args, task)
        for encoder in model.encoder.encoders:
            if isinstance(encoder, SlotTransformerEncoder):
                apply_model_hooks(SimpleNamespace(encoder=encoder, decoder=model.decoder))
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(cfg)
        shared = cfg.share_all_embeddings or safe_getattr(cfg, "share_encoder_embeddings")
        kinds, primary = safe_getattr(cfg, KINDS), safe_getattr(cfg, PRIMARY)
        encoders = []
        for k, (kind, channels) in enumerate(zip(kinds, safe_getattr(cfg, CHANNELS))):
            if kind == IMAGE:
                encoders.append(ImageFeatureEncoder(channels, cfg.encoder.embed_dim))
                continue
            tokens = embed_tokens if shared or k == primary else cls.build_embedding(
                cfg, src_dict, cfg.encoder.embed_dim, cfg.encoder.embed_path)
            encoders.append(SlotTransformerEncoder(cfg, src_dict, tokens))
        return MultiSourceEncoder(src_dict, encoders, safe_getattr(cfg, NAMES), primary)


    def forward(self, src_tokens, src_lengths, prev_output_tokens, multi_source_inputs=None,
                multi_source_lengths=None, return_all_hiddens: bool = True,
                features_only: bool = False, alignment_layer: Optional[int] = None,
                alignment_heads: Optional[int] = None):
        """fairseq's transformer forward with every source (``net_input`` of the task)."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths,
                                   multi_source_inputs=multi_source_inputs,
                                   multi_source_lengths=multi_source_lengths,
                                   return_all_hiddens=return_all_hiddens)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out,
                            features_only=features_only, alignment_layer=alignment_layer,
                            alignment_heads=alignment_heads, src_lengths=src_lengths,
                            return_all_hiddens=return_all_hiddens)


def combination_modules(model) -> List[InputCombination]:
    """The combination sublayer of every decoder layer, bottom to top."""
    return [layer.encoder_attn for layer in model.decoder.layers]


@register_model_architecture("multi_source_transformer", "multi_source_transformer")
def multi_source_transformer(args):
    """fairseq's ``transformer`` defaults, serial combination (the best MSMT strategy)."""
    args.combination_strategy = getattr(args, "combination_strategy", SERIAL)
    args.hier_attention_heads = getattr(args, "hier_attention_heads", None)
    args.share_encoder_embeddings = getattr(args, "share_encoder_embeddings", False)
    slot_transformer(args)


def paper_settings(args):
    """What the paper and its reference implementation fix for both tasks: pre-norm with a
    final LayerNorm (M7), no embedding scaling (M11b), one embedding matrix tied three
    ways (B.3), dropout 0.1 ([choice] unstated, B.4.6), attention dropout 0 (RI)."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.no_scale_embedding = getattr(args, "no_scale_embedding", True)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", True)
    args.dropout = getattr(args, "dropout", 0.1)
    args.attention_dropout = getattr(args, "attention_dropout", 0.0)
    multi_source_transformer(args)


def _sizes(args, embed_dim, heads, ffn, encoder_layers, decoder_layers):
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", embed_dim)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", embed_dim)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", heads)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", heads)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", ffn)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", ffn)
    args.encoder_layers = getattr(args, "encoder_layers", encoder_layers)
    args.decoder_layers = getattr(args, "decoder_layers", decoder_layers)


@register_model_architecture("multi_source_transformer", "multimodal_transformer_multi30k")
def multimodal_transformer_multi30k(args):
    """MMT on Multi30k (B.6): d=512, 16 heads, FFN 4096, 6 encoder and 6 decoder layers;
    sources English text then image (serial order of Fig. 1)."""
    _sizes(args, embed_dim=512, heads=16, ffn=4096, encoder_layers=6, decoder_layers=6)
    paper_settings(args)


@register_model_architecture("multi_source_transformer", "multi_source_transformer_europarl")
def multi_source_transformer_europarl(args):
    """MSMT on Europarl (B.6): d=256, 8 heads, FFN 2048, 4-layer encoders, 6-layer decoder;
    sources es, fr, de, en. With one source it is the paper's baseline (B.4.9)."""
    _sizes(args, embed_dim=256, heads=8, ffn=2048, encoder_layers=4, decoder_layers=6)
    paper_settings(args)
