"""The staged layers of the slot Transformer: fairseq's encoder and decoder layers computed as
stages, each stage a place (:mod:`.slots`) where a mechanism's module may run.

:class:`SlotTransformerEncoderLayer` computes fairseq's encoder layer as self-attention, the
step after it and the feed-forward sublayer; :class:`SlotTransformerDecoderLayer` fairseq's
decoder layer as self-attention, the step after it (AIF's ``z^f``), cross-attention and the
feed-forward sublayer. The attentions come from their slots, the other stages from the stage
slots; with those empty each layer is fairseq's, with its submodules and parameter names (pre-
and post-norm, ``tests/test_slot_transformer.py``). Per-call inputs of a mechanism (AIF's
auxiliary features, the multi-source memories) reach the stages through the layer call
(:class:`LayerInput`). The stacks that build these layers are in :mod:`.slot_transformer`.
"""
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from .slots import (
    DECODER_AFTER_SELF_ATTENTION,
    DECODER_CROSS_ATTENTION,
    DECODER_CROSS_ATTENTION_SUBLAYER,
    DECODER_FEED_FORWARD,
    DECODER_SELF_ATTENTION,
    ENCODER_AFTER_SELF_ATTENTION,
    ENCODER_FEED_FORWARD,
    ENCODER_SELF_ATTENTION,
    one_module,
)


def keep_stage_module(layer: nn.Module, module: Optional[nn.Module]) -> Optional[str]:
    """A stage slot's module registered on ``layer`` under the attribute it declares (its
    parameter names in checkpoints, e.g. ``aux_fusion``); that attribute, None for an empty slot."""
    if module is None:
        return None
    if hasattr(layer, module.layer_attribute):
        raise ValueError(f"the layer already has a {module.layer_attribute!r}")
    setattr(layer, module.layer_attribute, module)
    return module.layer_attribute


class SlotTransformerEncoderLayer(TransformerEncoderLayerBase):
    """fairseq's encoder layer whose self-attention comes from the encoder self-attention
    slot (fairseq's ``MultiheadAttention`` by default), computed in three stages,
    :meth:`self_attention_stage`, :meth:`after_self_attention` and :meth:`feed_forward_stage`,
    the last two filled by their stage slots (:mod:`.slots`); with those slots empty, as
    fairseq's ``TransformerEncoderLayerBase.forward`` computes it, with its submodules (pre-
    and post-norm, ``tests/test_slot_transformer.py``)."""

    def __init__(self, cfg, layer_idx: int, return_fc: bool = False):
        self.layer_idx = layer_idx  # read by build_self_attention inside super().__init__
        super().__init__(cfg, return_fc=return_fc)
        where = dict(layer_idx=layer_idx, embed_dim=self.embed_dim)
        self.after_self_attention_name = keep_stage_module(self, ENCODER_AFTER_SELF_ATTENTION.build(cfg, **where))
        self.feed_forward_name = keep_stage_module(self, ENCODER_FEED_FORWARD.build(cfg, **where))
        if self.feed_forward_name is not None:  # the module is the whole sublayer
            self.fc1 = self.fc2 = self.final_layer_norm = None

    def build_self_attention(self, embed_dim, cfg):
        module = ENCODER_SELF_ATTENTION.build(cfg, layer_idx=self.layer_idx, embed_dim=embed_dim)
        return module if module is not None else super().build_self_attention(embed_dim, cfg)

    def forward(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        """fairseq's layer interface: ``x`` T x B x C; ``attn_mask`` (T x T, 1 = masked) becomes
        additive, -1e8 (-1e4 below float32) as in fairseq, not -inf: a padded query row would
        otherwise be all -inf and its softmax NaN."""
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)
        x = self.self_attention_stage(x, encoder_padding_mask, attn_mask)
        x, fc_result = self.feed_forward_stage(self.after_self_attention(x))
        if self.return_fc and not torch.jit.is_scripting():
            return x, fc_result
        return x

    def self_attention_stage(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor]):
        """Self-attention sublayer with its residual and LayerNorm."""
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
                              need_weights=False, attn_mask=attn_mask)
        x = self.residual_connection(self.dropout_module(x), residual)
        return x if self.normalize_before else self.self_attn_layer_norm(x)

    def after_self_attention(self, x):
        """The step between the two sublayers: its slot's module (with no per-call extras),
        nothing in the Transformer."""
        if self.after_self_attention_name is None:
            return x
        return getattr(self, self.after_self_attention_name).after_self_attention(x, {})

    def feed_forward_stage(self, x) -> Tuple[Tensor, Optional[Tensor]]:
        """Position-wise feed-forward sublayer: ``(x, fc2's output before dropout)``, the
        ``fc_result`` fairseq returns with ``return_fc`` (None from a filled stage)."""
        if self.feed_forward_name is not None:
            return getattr(self, self.feed_forward_name).feed_forward(x), None
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        fc_result = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(x))))
        x = self.residual_connection(self.dropout_module(fc_result), residual)
        return (x if self.normalize_before else self.final_layer_norm(x)), fc_result


class LayerInput(NamedTuple):
    """What the slot decoder hands each layer in place of fairseq's ``encoder_out`` tensor
    when mechanisms have per-call inputs for the layers: the memory the cross-attention
    attends to, and the named extras (e.g. AIF's auxiliary features, the multi-source
    memories), each one tensor. fairseq's layer loop passes it on unchanged; the layer's call
    hands the extras to ``forward`` as keyword arguments
    (:meth:`SlotTransformerDecoderLayer.__call__`)."""

    memory: Any
    extras: Dict[str, Optional[Tensor]]


class SlotTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer in four stages: :meth:`self_attention_stage` (masked
    self-attention with its residual and LayerNorm), :meth:`after_self_attention` (nothing in
    the Transformer; AIF adds its fused features there), :meth:`cross_attention_stage` and
    :meth:`feed_forward_stage`. The self- and cross-attention come from their slots, and each
    stage slot (:mod:`.slots`) may fill its stage; with those slots empty, the same submodules,
    parameter names and numbers as fairseq's ``TransformerDecoderLayerBase`` (pre- and
    post-norm, ``tests/test_slot_transformer.py``). ``layer_context``: the decoder's keywords
    for the stage slots' fillers (e.g. the multi-source model's sources)."""

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False, **layer_context):
        # read by the build_* methods inside super().__init__
        self.layer_idx = layer_idx
        self.layer_context = layer_context
        self.encoder_attn_is_sublayer = False  # set by build_encoder_attention
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        if self.encoder_attn_is_sublayer:
            self.encoder_attn_layer_norm = None  # the sublayer owns its LayerNorms
        where = dict(layer_idx=layer_idx, embed_dim=self.embed_dim, **layer_context)
        # registered after fairseq's modules, where AIF's layer class had its aux_fusion: the
        # parameter order of optimizer states in checkpoints
        self.after_self_attention_name = keep_stage_module(self, DECODER_AFTER_SELF_ATTENTION.build(cfg, **where))
        self.feed_forward_name = keep_stage_module(self, DECODER_FEED_FORWARD.build(cfg, **where))
        if self.feed_forward_name is not None:  # the module is the whole sublayer
            self.fc1 = self.fc2 = self.ffn_layernorm = self.final_layer_norm = self.w_resid = None

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        module = DECODER_SELF_ATTENTION.build(cfg, layer_idx=self.layer_idx, embed_dim=embed_dim)
        if module is not None:
            return module
        return super().build_self_attention(
            embed_dim, cfg, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn
        )

    def build_encoder_attention(self, embed_dim, cfg):
        """The cross-attention slot's module, or the sublayer slot's (kept as ``encoder_attn``,
        fairseq's name, so that ``--no-cross-attention`` and ``need_attn`` apply to it), or
        fairseq's attention."""
        where = dict(layer_idx=self.layer_idx, embed_dim=embed_dim)
        sublayer = DECODER_CROSS_ATTENTION_SUBLAYER.build_one(cfg, **where, **self.layer_context)
        module = one_module("decoder cross-attention", cfg, where,
                            (DECODER_CROSS_ATTENTION, DECODER_CROSS_ATTENTION.build_one(cfg, **where)),
                            (DECODER_CROSS_ATTENTION_SUBLAYER, sublayer))
        self.encoder_attn_is_sublayer = bool(sublayer)
        return module if module is not None else super().build_encoder_attention(embed_dim, cfg)

    def __call__(self, x, encoder_out=None, *args, **kwargs):
        """fairseq's layer call; ``encoder_out`` may be a :class:`LayerInput`, whose extras
        reach ``forward`` as keyword tensors. Unpacked here, before ``nn.Module`` calls
        ``forward``: with ``--checkpoint-activations`` fairseq's ``checkpoint_wrapper``
        replaces ``forward`` and makes only the top-level tensor arguments inputs of the
        recomputed layer. A tensor inside a LayerInput would not be one: every layer's
        recomputation would run backward into that tensor's graph by itself, and the second
        layer would find it freed ("Trying to backward through the graph a second time")."""
        if isinstance(encoder_out, LayerInput):
            encoder_out, extras = encoder_out
            return super().__call__(x, encoder_out, *args, **kwargs, **extras)
        return super().__call__(x, encoder_out, *args, **kwargs)

    def forward(
        self,
        x,
        encoder_out=None,
        encoder_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        prev_self_attn_state: Optional[List[Tensor]] = None,
        prev_attn_state: Optional[List[Tensor]] = None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
        **extras: Optional[Tensor],
    ):
        """fairseq's layer interface, plus the per-call ``extras`` of the mechanisms
        (:class:`LayerInput`), handed to the stages after the self-attention."""
        x = self.self_attention_stage(
            x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
            self_attn_mask, self_attn_padding_mask,
        )
        x = self.after_self_attention(x, extras)
        attn = None
        if self.encoder_attn is not None and encoder_out is not None:
            x, attn = self.cross_attention_stage(
                x, encoder_out, encoder_padding_mask, incremental_state, prev_attn_state,
                need_attn or need_head_weights, need_head_weights, extras,
            )
        return self.feed_forward_stage(x), attn, None

    def self_attention_stage(self, x, encoder_out, encoder_padding_mask, incremental_state,
                             prev_self_attn_state, self_attn_mask, self_attn_padding_mask):
        """Masked self-attention sublayer (with ``--cross-self-attention``: over the encoder
        output and the prefix), as fairseq computes it."""
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        if prev_self_attn_state is not None:
            self.self_attn._set_input_buffer(incremental_state, _saved_state(prev_self_attn_state))
        buffer = self.self_attn._get_input_buffer(incremental_state)
        y = x
        if self.cross_self_attention and not (
            incremental_state is not None and buffer is not None and "prev_key" in buffer
        ):
            if self_attn_mask is not None:
                self_attn_mask = torch.cat(
                    (x.new_zeros(x.size(0), encoder_out.size(0)), self_attn_mask), dim=1
                )
            if self_attn_padding_mask is not None:
                if encoder_padding_mask is None:
                    encoder_padding_mask = self_attn_padding_mask.new_zeros(
                        encoder_out.size(1), encoder_out.size(0)
                    )
                self_attn_padding_mask = torch.cat((encoder_padding_mask, self_attn_padding_mask), dim=1)
            y = torch.cat((encoder_out, x), dim=0)
        x, _ = self.self_attn(
            query=x, key=y, value=y, key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state, need_weights=False, attn_mask=self_attn_mask,
        )
        if self.c_attn is not None:  # --scale-heads
            tgt_len, bsz = x.size(0), x.size(1)
            x = torch.einsum("tbhd,h->tbhd", x.view(tgt_len, bsz, self.nh, self.head_dim), self.c_attn)
            x = x.reshape(tgt_len, bsz, self.embed_dim)
        if self.attn_ln is not None:  # --scale-attn
            x = self.attn_ln(x)
        x = self.residual_connection(self.dropout_module(x), residual)
        return x if self.normalize_before else self.self_attn_layer_norm(x)

    def after_self_attention(self, x, extras: Dict[str, Tensor]):
        """The step between self- and cross-attention: its slot's module, nothing in the
        Transformer."""
        if self.after_self_attention_name is None:
            return x
        return getattr(self, self.after_self_attention_name).after_self_attention(x, extras)

    def cross_attention_stage(self, x, encoder_out, encoder_padding_mask, incremental_state,
                              prev_attn_state, need_attn: bool, need_head_weights: bool,
                              extras: Dict[str, Tensor]):
        """Encoder-decoder attention sublayer: ``(x, attention weights)``; the sublayer slot's
        module, when it fills ``encoder_attn``, computes all of it."""
        need_weights = need_attn or (not self.training and self.need_attn)
        if self.encoder_attn_is_sublayer:
            return self.encoder_attn.cross_attention_sublayer(
                x, encoder_out, encoder_padding_mask, incremental_state, extras, need_weights, need_head_weights,
            )
        residual = x
        if self.normalize_before:
            x = self.encoder_attn_layer_norm(x)
        if prev_attn_state is not None:
            self.encoder_attn._set_input_buffer(incremental_state, _saved_state(prev_attn_state))
        x, attn = self.encoder_attn(
            query=x, key=encoder_out, value=encoder_out, key_padding_mask=encoder_padding_mask,
            incremental_state=incremental_state, static_kv=True,
            need_weights=need_weights, need_head_weights=need_head_weights,
        )
        x = self.residual_connection(self.dropout_module(x), residual)
        return (x if self.normalize_before else self.encoder_attn_layer_norm(x)), attn

    def feed_forward_stage(self, x):
        """Position-wise feed-forward sublayer (its slot's module, or fairseq's)."""
        if self.feed_forward_name is not None:
            return getattr(self, self.feed_forward_name).feed_forward(x)
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_dropout_module(self.activation_fn(self.fc1(x)))
        if self.ffn_layernorm is not None:  # --scale-fc
            x = self.ffn_layernorm(x)
        x = self.dropout_module(self.fc2(x))
        if self.w_resid is not None:  # --scale-resids
            residual = torch.mul(self.w_resid, residual)
        x = self.residual_connection(x, residual)
        return x if self.normalize_before else self.final_layer_norm(x)


def _saved_state(prev_state: List[Tensor]) -> Dict[str, Optional[Tensor]]:
    """fairseq's attention cache from a layer's ``prev_*_state`` list."""
    saved: Dict[str, Optional[Tensor]] = {"prev_key": prev_state[0], "prev_value": prev_state[1]}
    if len(prev_state) >= 3:
        saved["prev_key_padding_mask"] = prev_state[2]
    return saved
