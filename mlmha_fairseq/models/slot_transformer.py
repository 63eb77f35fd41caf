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
  dimension (fairseq's own method drops unknown entries). A module may also replace
  ``encoder_out`` itself (the memory of the standard cross-attention).
* A cross-attention module names the ``encoder_out`` entry it attends to
  (``memory_key``, default ``"encoder_out"``); the decoder hands that entry to every layer
  in place of the top encoder layer, so fairseq's layer loop runs unchanged.
* A decoder-output module fuses the decoder's layer outputs before the final LayerNorm.
"""
from typing import Dict, List, Optional

from torch import Tensor, nn

from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
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

from .slots import (
    DECODER_CROSS_ATTENTION,
    DECODER_OUTPUT,
    DECODER_SELF_ATTENTION,
    ENCODER_MEMORY,
    ENCODER_SELF_ATTENTION,
    add_slot_args,
    apply_model_hooks,
    check_distinct_outputs,
    set_slot_defaults,
)

ENCODER_OUT = "encoder_out"


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


class SlotTransformerEncoderLayer(TransformerEncoderLayerBase):
    """fairseq's encoder layer whose self-attention comes from the encoder self-attention
    slot (fairseq's ``MultiheadAttention`` by default)."""

    def __init__(self, cfg, layer_idx: int, return_fc: bool = False):
        self.layer_idx = layer_idx  # read by build_self_attention inside super().__init__
        super().__init__(cfg, return_fc=return_fc)

    def build_self_attention(self, embed_dim, cfg):
        module = ENCODER_SELF_ATTENTION.build(cfg, layer_idx=self.layer_idx, embed_dim=embed_dim)
        return module if module is not None else super().build_self_attention(embed_dim, cfg)


class SlotTransformerDecoderLayer(TransformerDecoderLayerBase):
    """fairseq's decoder layer whose self- and cross-attention come from their slots."""

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False):
        self.layer_idx = layer_idx  # read by the build_* methods inside super().__init__
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        module = DECODER_SELF_ATTENTION.build(cfg, layer_idx=self.layer_idx, embed_dim=embed_dim)
        if module is not None:
            return module
        return super().build_self_attention(
            embed_dim, cfg, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn
        )

    def build_encoder_attention(self, embed_dim, cfg):
        module = DECODER_CROSS_ATTENTION.build(cfg, layer_idx=self.layer_idx, embed_dim=embed_dim)
        return module if module is not None else super().build_encoder_attention(embed_dim, cfg)


class SlotTransformerEncoder(TransformerEncoderBase):
    """fairseq's encoder plus the encoder memory slot (see the module docstring)."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        self.memories = nn.ModuleDict(ENCODER_MEMORY.build_all(cfg, num_layers=self.num_layers))
        check_distinct_outputs(self.memories)

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

    def reorder_encoder_out(self, encoder_out: Dict[str, List[Tensor]], new_order):
        """fairseq's reordering, plus the memory slot's entries (batch dim is -2)."""
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        for key, tensors in encoder_out.items():
            if key not in reordered and key != "fc_results":
                reordered[key] = [t.index_select(t.dim() - 2, new_order) for t in tensors]
        return reordered


class SlotTransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder plus the cross-attention memory and decoder output slots."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        super().__init__(
            cfg,
            dictionary,
            embed_tokens,
            no_encoder_attn=no_encoder_attn,
            output_projection=output_projection,
        )
        self.memory_key = self._memory_key()
        if self.memory_key != ENCODER_OUT and cfg.cross_self_attention:
            raise ValueError(
                "--cross-self-attention needs the standard decoder cross-attention"
            )
        self.output_fusion = DECODER_OUTPUT.build(cfg, num_layers=self.num_layers)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        layer = SlotTransformerDecoderLayer(cfg, next_layer_index(self), no_encoder_attn)
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
    ):
        x, extra = super().extract_features(
            prev_output_tokens,
            self.cross_attention_memory(encoder_out),
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
        output dimension)."""
        x = self.output_fusion(inner_states)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x


def _check_replaced_memory_is_read(model):
    """An encoder memory that replaces ``encoder_out`` only matters to a cross-attention
    that reads ``encoder_out``: refuse the combinations where it would be silently unused."""
    writers = [name for name, memory in model.encoder.memories.items() if ENCODER_OUT in memory.output_keys]
    if writers and model.decoder.memory_key != ENCODER_OUT:
        raise ValueError(
            f"{', '.join(writers)} replaces the encoder output that the standard cross-attention "
            f"attends to, but this decoder's cross-attention attends to {model.decoder.memory_key!r}: "
            "choose one"
        )


@register_model("slot_transformer")
class SlotTransformerModel(TransformerModel):
    """fairseq's transformer (Vaswani et al., 2017) with slots for this package's
    mechanisms; see :mod:`mlmha_fairseq.models.slot_transformer`. Subclasses that need
    another decoder set ``decoder_class``."""

    decoder_class = SlotTransformerDecoder

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_slot_args(parser)

    @classmethod
    def build_model(cls, args, task):
        slot_transformer(args)  # complete options of checkpoints written by older versions
        model = super().build_model(args, task)
        _check_replaced_memory_is_read(model)
        apply_model_hooks(model)  # what spans several slots (slots.register_model_hook)
        return model

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return SlotTransformerEncoder(TransformerConfig.from_namespace(cfg), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(cfg)
        return cls.decoder_class(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def set_beam_size(self, beam_size: int):
        """fairseq's ``SequenceGenerator`` gives the beam size to models that take it: this
        package's attention modules that cache per sentence in beam search learn it (MLMHA's
        n projected encoder layers, which would otherwise be copied at every step); fairseq's
        own modules keep fairseq's transformer behaviour."""
        for module in self.decoder.modules():
            if hasattr(module, "set_beam_size") and module.__module__.startswith("mlmha_fairseq.modules."):
                module.set_beam_size(beam_size)


@register_model_architecture("slot_transformer", "slot_transformer")
def slot_transformer(args):
    """fairseq's ``transformer`` defaults, every slot at fairseq's module."""
    set_slot_defaults(args)
    base_architecture(args)
