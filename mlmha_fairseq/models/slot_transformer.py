"""The slot-based Transformer (model ``slot_transformer``).

fairseq's transformer with named places (:mod:`mlmha_fairseq.models.slots`) where the
mechanisms of this package plug in. Encoder, decoder and their layers subclass fairseq's,
keep its module names and only ask each slot whether a mechanism fills it; with every
slot at its default the model *is* fairseq's ``transformer``: same modules, same state
dict, same outputs (``tests/test_slot_transformer.py``).

What the slots add to fairseq's data flow:

* The encoder collects every layer's output whenever its memory slot is filled, also at
  generation time, where fairseq calls it without ``return_all_hiddens``. Each memory
  module (several mechanisms may add one) reads fairseq's encoder output and returns the
  entries it declares in ``output_keys``: lists of time-major tensors ``(..., T, B, C)``,
  which :meth:`SlotTransformerEncoder.reorder_encoder_out` reorders along the batch
  dimension (fairseq's own method drops unknown entries) when the batch size changes. A
  module may also replace ``encoder_out`` itself (the memory of the standard
  cross-attention).
* A cross-attention module names the ``encoder_out`` entry it attends to
  (``memory_key``, default ``"encoder_out"``); the decoder hands that entry to every layer
  in place of the top encoder layer, so fairseq's layer loop runs unchanged.
* A decoder-output module fuses the decoder's layer outputs before the final LayerNorm.
* The encoder layer runs in two stages and the decoder layer in four
  (:class:`SlotTransformerDecoderLayer`), whose modules come from the stage slots; per-call
  inputs of a mechanism reach them through the layer call (:class:`LayerInput`).

Every slot model is built by :meth:`SlotTransformerModel.build_model`; see
``docs/architecture.md``.
"""
import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.models.transformer.transformer_legacy import base_architecture
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)
from fairseq.utils import safe_getattr

from ..errors import UsageError

from .hydra_configs import namespace_of
from .options import MECHANISMS, Mechanism, Option, check_options, register_architecture, register_mechanism
from .slots import (
    DECODER_AFTER_SELF_ATTENTION,
    DECODER_CROSS_ATTENTION,
    DECODER_CROSS_ATTENTION_SUBLAYER,
    DECODER_FEED_FORWARD,
    DECODER_OUTPUT,
    DECODER_SELF_ATTENTION,
    ENCODER_AFTER_SELF_ATTENTION,
    ENCODER_FEED_FORWARD,
    ENCODER_LAYER_INPUTS,
    ENCODER_MEMORY,
    ENCODER_SELF_ATTENTION,
    SELECTABLE_SLOTS,
    add_slot_args,
    apply_model_hooks,
    check_distinct_outputs,
    one_module,
    set_slot_defaults,
)

ENCODER_OUT = "encoder_out"
# Where a slot model's state dict keeps the options of this package it was built with.
OPTIONS_METADATA = "mlmha_fairseq_options"

logger = logging.getLogger(__name__)

# Cui et al. 2019, Table 3 ("- Position Embedding"): an ablation of the MMA paper, also without
# MMA; read by SlotTransformerEncoder
ENCODER_POSITIONS = register_mechanism(Mechanism(
    "encoder without positions", None, (
        Option("--encoder-no-token-positional-embeddings", False, "no positional embeddings in the "
               "encoder; the decoder keeps them (Cui et al. 2019, Table 3)",
               argparse=dict(action="store_true"), is_switch=True),
    )))


def wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping, as fairseq's ``build_*_layer`` do."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        return fsdp_wrap(layer, min_num_params=0)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap)


def next_layer_index(stack) -> int:
    """Index of the layer being built: fairseq builds a stack's layers in a list
    comprehension that does not pass the index to ``build_*_layer``."""
    index = getattr(stack, "_num_built_layers", 0)
    stack._num_built_layers = index + 1
    return index


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


class SlotTransformerEncoder(TransformerEncoderBase):
    """fairseq's encoder plus the encoder memory slot (see the module docstring)."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False, reaches_decoder: bool = True):
        """``reaches_decoder``: whether the decoder reads this encoder's memory entries (False
        for a multi-source model's secondary encoders, of which only the top layer and mask
        are read), handed to the memory fillers."""
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        if safe_getattr(cfg, "encoder_no_token_positional_embeddings", False):  # ENCODER_POSITIONS
            # dropped before any checkpoint is loaded, so none are expected
            self.embed_positions = None
        self.memories = nn.ModuleDict(
            ENCODER_MEMORY.build_all(cfg, num_layers=self.num_layers, reaches_decoder=reaches_decoder))
        layer_inputs = ENCODER_LAYER_INPUTS.build_one(cfg, num_layers=self.num_layers)
        self.layer_inputs = next(iter(layer_inputs.values()), None)
        check_distinct_outputs(cfg, (ENCODER_MEMORY, self.memories), (ENCODER_LAYER_INPUTS, layer_inputs))

    def build_encoder_layer(self, cfg):
        layer = SlotTransformerEncoderLayer(cfg, next_layer_index(self), return_fc=self.return_fc)
        return wrap_layer(layer, cfg)

    def forward(
        self,
        src_tokens,
        src_lengths: Optional[Tensor] = None,
        return_all_hiddens: bool = False,
        token_embeddings: Optional[Tensor] = None,
    ):
        """fairseq's encoder forward, plus the memory slot's entries.

        The layer outputs are collected whenever the memory slot needs them, and returned
        as ``encoder_states`` only if the caller asked for them. Every memory module sees
        fairseq's own output, whatever the others write.
        """
        needs_states = len(self.memories) > 0
        encoder_out = self.forward_scriptable(
            src_tokens, src_lengths, return_all_hiddens or needs_states, token_embeddings
        )
        if needs_states:
            entries = [memory(encoder_out) for memory in self.memories.values()]
            for entry in entries:
                encoder_out.update(entry)
            if not return_all_hiddens:
                encoder_out["encoder_states"] = []
                encoder_out["fc_results"] = []
        return encoder_out

    def forward_scriptable(
        self,
        src_tokens,
        src_lengths: Optional[Tensor] = None,
        return_all_hiddens: bool = False,
        token_embeddings: Optional[Tensor] = None,
    ):
        """fairseq's encoder, or with the layer-inputs slot filled (DLCL) the same steps with
        each layer reading ``layer_inputs.combine`` of the outputs below it and the stack's
        output the combination of all of them (then the final LayerNorm in pre-norm).

        fairseq feeds each layer the previous layer's output inside this method, with no step
        of its own to override, so its steps are written out again here; ``encoder_states``
        are the layers' own outputs ``[y_0, ..., y_L]``, as fairseq's."""
        if self.layer_inputs is None:
            return super().forward_scriptable(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        has_pads = encoder_padding_mask.any()
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x) * has_pads.type_as(x))
        x = x.transpose(0, 1)  # B x T x C -> T x B x C: y_0
        states, fc_results = [x], []
        history = [self.layer_inputs.store(0, x)]
        for index, layer in enumerate(self.layers, start=1):
            output = layer(self.layer_inputs.combine(history),
                           encoder_padding_mask=encoder_padding_mask if has_pads else None)
            x, fc_result = output if isinstance(output, tuple) else (output, None)
            states.append(x)
            fc_results.append(fc_result)
            history.append(self.layer_inputs.store(index, x))
        x = self.layer_inputs.combine(history)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        src_lengths = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": states if return_all_hiddens else [],  # L+1 tensors T x B x C
            "fc_results": fc_results if return_all_hiddens else [],
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        """fairseq's reordering, plus the memory slot's entries (batch dim is -2).

        The memory entries are read at the first decoding step only: every cross-attention
        caches their projections. At an order that keeps the batch size, beam search only
        moves hypotheses among the beams of their sentence, which share its encoder output,
        so these entries are kept as they are, as fairseq's encoder-decoder attention keeps
        its cache (copying them would cost several encoder outputs per beam step). An order
        of another size (the expansion to the beams, finished sentences) selects rows. A
        caller that permutes sentences at a constant batch size and then runs the decoder
        without an incremental state should encode the permuted batch instead.
        """
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        for key, tensors in encoder_out.items():
            if key in reordered or key == "fc_results":
                continue
            if all(t.size(-2) == new_order.numel() for t in tensors):
                reordered[key] = tensors
            else:
                reordered[key] = [t.index_select(t.dim() - 2, new_order) for t in tensors]
        return reordered


class SlotTransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder plus the cross-attention memory and decoder output slots.
    ``layer_context``: keywords of the model for the fillers of its layers' stage slots (the
    multi-source model's sources and combination options), never written into ``args``.
    ``encoder_extras``: a function of ``encoder_out`` giving per-call extras of every layer
    (the multi-source model's per-source memories and masks), merged with the decoder's own
    ``layer_extras``."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None,
                 layer_context: Optional[Dict[str, Any]] = None,
                 encoder_extras: Optional[Callable[[Dict[str, List[Tensor]]], Dict[str, Tensor]]] = None):
        self.layer_context = layer_context or {}  # read by build_decoder_layer inside super().__init__
        self.encoder_extras = encoder_extras
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )
        self.memory_key = self._memory_key()
        if self.memory_key != ENCODER_OUT and cfg.cross_self_attention:
            raise UsageError(
                "--cross-self-attention needs the standard decoder cross-attention"
            )
        self.output_fusion = DECODER_OUTPUT.build(cfg, num_layers=self.num_layers)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = SlotTransformerDecoderLayer(cfg, next_layer_index(self), no_encoder_attn, **self.layer_context)
        return wrap_layer(layer, cfg)

    def _memory_key(self) -> str:
        keys = {
            getattr(layer.encoder_attn, "memory_key", ENCODER_OUT)
            for layer in self.layers
            if layer.encoder_attn is not None
        }
        if len(keys) > 1:
            raise ValueError(f"decoder layers attend to different encoder outputs: {sorted(keys)}")
        return keys.pop() if keys else ENCODER_OUT

    def cross_attention_memory(self, encoder_out):
        """``encoder_out`` as the layers see it: ``encoder_out["encoder_out"]`` is replaced
        by the entry the cross-attention slot attends to."""
        if encoder_out is None or self.memory_key == ENCODER_OUT:
            return encoder_out
        if self.memory_key not in encoder_out:
            raise KeyError(
                f"the decoder's cross-attention needs encoder output {self.memory_key!r}, "
                "which this encoder does not produce"
            )
        return {**encoder_out, ENCODER_OUT: encoder_out[self.memory_key]}

    def extract_features(
        self,
        prev_output_tokens,
        encoder_out: Optional[Dict[str, List[Tensor]]],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        full_context_alignment: bool = False,
        alignment_layer: Optional[int] = None,
        alignment_heads: Optional[int] = None,
        layer_extras: Optional[Dict[str, Tensor]] = None,
    ):
        """fairseq's features; ``layer_extras`` (e.g. AIF's auxiliary features) and the
        ``encoder_extras`` of ``encoder_out`` (e.g. the multi-source memories) reach every
        layer's stages through its call."""
        if self.encoder_extras is not None and encoder_out is not None:
            layer_extras = {**self.encoder_extras(encoder_out), **(layer_extras or {})}
        memory = self.cross_attention_memory(encoder_out)
        if layer_extras:
            if memory is None or not memory[ENCODER_OUT]:
                raise ValueError("per-layer inputs of the decoder need an encoder output")
            memory = {**memory, ENCODER_OUT: [LayerInput(memory[ENCODER_OUT][0], layer_extras)]}
        x, extra = super().extract_features(
            prev_output_tokens,
            memory,
            incremental_state,
            full_context_alignment,
            alignment_layer,
            alignment_heads,
        )
        if self.output_fusion is not None:
            x = self.fused_output(extra["inner_states"])
        return x, extra

    def fused_output(self, inner_states: List[Tensor]) -> Tensor:
        """The decoder output slot: fuse ``[embedding, layer 1..L]`` (each T x B x C) in
        place of the top layer, then finish as fairseq does (final LayerNorm, B x T x C,
        output dimension). fairseq runs those three steps inside
        ``extract_features_scriptable``, after its layer loop, with no method of their own
        to call on another tensor, so they are written out again here."""
        x = self.output_fusion(inner_states)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x


def check_replaced_memory_is_read(encoder: SlotTransformerEncoder, decoder: SlotTransformerDecoder):
    """An encoder memory that replaces ``encoder_out`` only matters to a cross-attention
    that reads ``encoder_out``: refuse the combinations where it would be silently unused."""
    writers = [name for name, memory in encoder.memories.items() if ENCODER_OUT in memory.output_keys]
    if writers and decoder.memory_key != ENCODER_OUT:
        raise UsageError(
            f"{', '.join(writers)} replaces the encoder output that the standard cross-attention "
            f"attends to, but this decoder's cross-attention attends to {decoder.memory_key!r}: "
            "choose one"
        )


def package_options(args) -> Dict[str, Tuple[str, Any]]:
    """This package's options in ``args`` that give a model's weights their meaning (slot
    choices and every mechanism's options but the inference-only ones): ``{dest: (flag,
    value)}``, values as plain data (what a checkpoint may hold)."""
    flags = {slot.dest: slot.option for slot in SELECTABLE_SLOTS}
    flags.update((option.dest, option.flag) for mechanism in MECHANISMS.values() for option in mechanism.options
                 if not option.inference_only)
    options = {}
    for dest, flag in flags.items():
        if hasattr(args, dest):
            value = getattr(args, dest)
            options[dest] = (flag, value if isinstance(value, (str, int, float, bool, type(None))) else str(value))
    return options


def _record_options(model, state_dict, prefix, local_metadata):
    """State-dict hook: the model's options of this package go into the state dict's
    metadata (no key or tensor is added, so the state dict stays fairseq's transformer's)."""
    local_metadata[OPTIONS_METADATA] = {dest: value for dest, (_, value) in package_options(model.args).items()}


def recorded_options(state_dict) -> Optional[Dict[str, Any]]:
    """The options :func:`_record_options` kept in ``state_dict`` (a checkpoint's
    ``model``), or None; a tool that changes a checkpoint's options updates them here too."""
    return getattr(state_dict, "_metadata", {}).get("", {}).get(OPTIONS_METADATA)


def _warn_about_other_options(model, state_dict, prefix, local_metadata, *args):
    """Load hook: one warning naming the options of this package that differ between the
    model and the state dict's (:func:`_record_options`). ``fairseq-train --restore-file``
    loads a checkpoint into the model of the current command line and passes that command
    line's options, not the checkpoint's, to ``load_state_dict``: an M-10 checkpoint loads
    into an M-00 model without a word (same shapes, another meaning of the weights)."""
    stored = local_metadata.get(OPTIONS_METADATA)
    if not isinstance(stored, dict):
        return  # a state dict written before the options were recorded, or built by hand
    differ = [f"{flag} {value} (checkpoint: {stored[dest]})"
              for dest, (flag, value) in package_options(model.args).items()
              if dest in stored and stored[dest] != value]
    if differ:
        logger.warning("the checkpoint was trained with other options of this package: %s; its weights are "
                       "loaded into the model these options build, which may read them differently (to "
                       "resume the checkpoint's training, give its values)", ", ".join(differ))


@register_model("slot_transformer")
class SlotTransformerModel(TransformerModel):
    """fairseq's transformer (Vaswani et al., 2017) with slots for this package's
    mechanisms; see :mod:`mlmha_fairseq.models.slot_transformer`. Subclasses that need
    another decoder set ``decoder_class``."""

    decoder_class = SlotTransformerDecoder

    def __init__(self, args, encoder, decoder):
        super().__init__(args, encoder, decoder)
        self.register_state_dict_post_hook(_record_options)
        self.register_load_state_dict_pre_hook(_warn_about_other_options)

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_slot_args(parser)

    @classmethod
    def complete_options(cls, args):
        """The model's defaults for options that ``args`` lacks (checkpoints written by
        older versions): the architecture function of the model's name."""
        slot_transformer(args)

    @classmethod
    def build_model(cls, args, task):
        """Every slot model is built here: options completed, encoder and decoder built
        (:meth:`build_encoder_and_decoder`), then what spans both (slots.register_model_hook)
        tied for the encoder whose tables the decoder shares (:meth:`decoder_partner`).
        No mechanism option may be set while its mechanism is off (:mod:`.options`).
        ``args``: fairseq-train's Namespace, or a hydra ``DictConfig`` (fairseq-hydra-train, a
        checkpoint it wrote), turned into that Namespace (:func:`.hydra_configs.namespace_of`)."""
        if OmegaConf.is_config(args):
            args = namespace_of(cls, args)
        cls.complete_options(args)
        check_options(args)
        model = cls.build_encoder_and_decoder(args, task)
        apply_model_hooks(model.decoder_partner(), model.decoder)
        return model

    @classmethod
    def build_encoder_and_decoder(cls, args, task):
        """fairseq's transformer with the slot encoder and decoder."""
        model = super().build_model(args, task)
        check_replaced_memory_is_read(model.encoder, model.decoder)
        return model

    def decoder_partner(self) -> SlotTransformerEncoder:
        """The encoder whose modules the decoder's fillers may share."""
        return self.encoder

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return SlotTransformerEncoder(TransformerConfig.from_namespace(cfg), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(cfg)
        return cls.decoder_class(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


@register_architecture("slot_transformer", "slot_transformer")
def slot_transformer(args):
    """fairseq's ``transformer`` defaults, every slot at fairseq's module."""
    set_slot_defaults(args)
    base_architecture(args)
