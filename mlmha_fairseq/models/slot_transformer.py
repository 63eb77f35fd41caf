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
* The encoder and decoder layers run in stages, some of whose modules come from the stage
  slots; per-call inputs of a mechanism reach them through the layer call
  (:mod:`.staged_layers`).

Every slot model is built by :meth:`SlotTransformerModel.build_model`; see
``docs/architecture.md``.
"""
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

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
from fairseq.utils import safe_getattr

from ..errors import UsageError

from .hydra_configs import namespace_of
from .options import MECHANISMS, Mechanism, Option, check_options, register_architecture, register_mechanism
from .slots import (
    DECODER_OUTPUT,
    ENCODER_LAYER_INPUTS,
    ENCODER_MEMORY,
    SELECTABLE_SLOTS,
    add_slot_args,
    apply_model_hooks,
    check_distinct_outputs,
    set_slot_defaults,
)
# The staged layers, importable from here as before they had their own module.
from .staged_layers import (  # noqa: F401
    LayerInput,
    SlotTransformerDecoderLayer,
    SlotTransformerEncoderLayer,
    keep_stage_module,
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
    another decoder set ``decoder_class``, or override :meth:`decoder_class_for` when their
    options choose it."""

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
    def decoder_class_for(cls, cfg):
        """The decoder's class for the model options ``cfg``."""
        return cls.decoder_class

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens, **decoder_options):
        """fairseq's; ``decoder_options``: further keywords of the decoder class (the
        multi-source model's ``layer_context`` and ``encoder_extras``)."""
        cfg = TransformerConfig.from_namespace(cfg)
        return cls.decoder_class_for(cfg)(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention,
                                          **decoder_options)


@register_architecture("slot_transformer", "slot_transformer")
def slot_transformer(args):
    """fairseq's ``transformer`` defaults, every slot at fairseq's module."""
    set_slot_defaults(args)
    base_architecture(args)
