"""Multi-source Transformer: input combination strategies for the decoder (Libovický, Helcl and
Mareček, WMT 2018).

Model ``multi_source_transformer`` (with ``--task multi_source_translation``):

* one encoder per source, in ``--source-langs`` order: a :class:`SlotTransformerEncoder` per
  text source (so the encoder-side slot options, e.g. ``--encoder-self-attention``, apply to
  every text encoder), a linear projection ``Linear(C, d)`` per image-feature source
  ([paper] "a linear projection to 512"; no positional encoding, no mask);
* decoder layers whose cross-attention sublayer is the strategy of ``--combination-strategy``
  (``serial``, ``parallel``, ``flat``, ``hierarchical``;
  :mod:`mlmha_fairseq.modules.input_combination`), in pre-norm (``--decoder-normalize-before``,
  the reference implementation) or post-norm (fairseq's default) form: the decoder
  cross-attention sublayer slot's filler builds it for the sources the decoder hands its
  layers. The decoder cross-attention slot stays ``standard``: the strategies need the
  multi-source encoder output, so they are not offered to ``slot_transformer``.

The task's facts about the sources (names, kinds, primary source, image feature sizes: a
:class:`~mlmha_fairseq.source_kinds.SourceLayout`) are handed to the encoder and decoder
constructors at build time, and by the decoder to its layers' fillers (its layer context); they
are not options and are not stored in ``args``.

MLRF (``--mlrf-*``) on a multi-source model: every text encoder has its own fusion and
layer-embedding table; the decoder's fusion shares the table of the primary source's
encoder (Wang et al. 2018, §3.2, share one table between "the" encoder and the decoder).

Multi-level supervision and AIF (``--aux-decoder-layers L [--aux-fusion]``, off by default here;
:mod:`.multi_level_supervision`): [choice] the auxiliary decoders attend to layer L of the
primary source's text encoder (the thesis has one encoder; we read it as the primary source's),
with its padding mask; only that encoder builds their memories (``encoder.encoders.<primary>
.memories.aux_memories``; the task makes the primary source a text source). The Main-Decoder
keeps the input combination over all sources. Train with
``--criterion multi_decoder_label_smoothed_cross_entropy``.

Embeddings ([paper] one matrix shared by the text encoders and the decoder, tied to the
output layer): ``--share-all-embeddings`` (the presets' default); ``--share-encoder-embeddings``
shares one matrix among the text encoders only; otherwise every encoder has its own.
``--encoder-embed-path`` fills every text encoder's matrix, ``--decoder-embed-path`` the
decoder's, as fairseq's transformer does; as there, a ``--decoder-embed-path`` other than
``--encoder-embed-path`` is refused with ``--share-all-embeddings``. ``--merge-src-tgt-embed``
is refused (the dictionary is one already: ``--share-all-embeddings`` ties the matrices).

Layer pruning (fairseq's ``--encoder-layers-to-keep``/``--decoder-layers-to-keep``, for a
model trained with LayerDrop): given to a trained model as fairseq-generate's or
fairseq-interactive's ``--model-overrides "{'encoder_layers_to_keep': '0,2'}"``, every text
encoder (or the decoder) keeps those layers, renumbered, as fairseq prunes its transformer
(``checkpoint_utils.prune_state_dict``). Refused, in one line naming the option: the option
given to fairseq-train (fairseq could not load the checkpoint it writes: its pruning reads
the comma-separated string only), layers the model does not have, and a model whose weights
outside its layers have a size per number of layers (MLRF, layer aggregation, DLCL), which
pruning cannot cut.

Encoder output: the primary source's fairseq entries (so fairseq's generator, alignment and
``--print-alignment`` see one ordinary source) plus ``multi_source_memories`` (n tensors
``S_k x B x C``) and ``multi_source_padding_masks`` (n tensors ``B x S_k``), which
:meth:`MultiSourceEncoder.reorder_encoder_out` reorders along the batch (fairseq's own method would drop them).

Presets: ``multimodal_transformer_multi30k`` and ``multi_source_transformer_europarl``.

In Python, :meth:`MultiSourceTransformerModel.from_pretrained` returns fairseq's hub
interface reading the task's input lines (sources tab-separated, :class:`MultiSourceHubInterface`)::

    model = MultiSourceTransformerModel.from_pretrained("checkpoints", "checkpoint_best.pt",
                                                        "data-bin")
    model.translate("w1 w2 w3\tW1 W2 W3", beam=5)
"""
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from fairseq import hub_utils
from fairseq.models import FairseqEncoder, register_model
from fairseq.models.transformer import TransformerConfig
from torch import Tensor, nn

from ..modules.input_combination import (
    HIERARCHICAL,
    MEMORY_KEY,
    SERIAL,
    STRATEGIES,
    InputCombination,
    build_input_combination,
    source_mask_extra,
    source_memory_extra,
)
from ..errors import UsageError
from ..source_kinds import IMAGE, TEXT, SourceLayout
from .multi_level_supervision import MULTI_LEVEL_SUPERVISION, NO_AUX, main_decoder_class
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .presets import set_sizes
from .slot_transformer import ENCODER_OUT, SlotTransformerEncoder, SlotTransformerModel, slot_transformer
from .slots import DECODER_CROSS_ATTENTION_SUBLAYER

MASKS_KEY = "multi_source_padding_masks"  # encoder_out entry: one B x S_k mask per source
# The weights of one encoder or decoder layer, the only ones fairseq's pruning renumbers.
LAYER_KEY = re.compile(r"\.layers\.\d+\.")
PADDING_MASK = "encoder_padding_mask"


INPUT_COMBINATION = register_mechanism(Mechanism(
    "the multi-source input combination", None, (
        Option("--combination-strategy", SERIAL, "how the decoder combines the sources (Libovicky "
               "et al. 2018, Fig. 1): serial, parallel (summed contexts), flat (one attention over "
               "all states) or hierarchical (attention over the per-source contexts)",
               argparse=dict(choices=STRATEGIES), is_switch=True),
        Option("--hier-attention-heads", None, "heads of the hierarchical second level (default: "
               "--decoder-attention-heads)", argparse=dict(type=int, metavar="H"),
               needs=Switch(f"--combination-strategy {HIERARCHICAL}",
                            lambda args: getattr(args, "combination_strategy", None) == HIERARCHICAL),
               none_means=lambda args: args.decoder_attention_heads),
        Option("--share-encoder-embeddings", False, "one embedding matrix for all text encoders "
               "(implied by --share-all-embeddings, which also ties the decoder's)",
               argparse=dict(action="store_true"), is_switch=True),
    ), slot_wide=False))


def layers_to_keep(args, side: str) -> Optional[List[int]]:
    """``--{side}-layers-to-keep`` of ``args`` (``side``: encoder or decoder), validated
    (the module docstring says what is refused); None when not given."""
    value = getattr(args, f"{side}_layers_to_keep", None)
    if not value:
        return None
    option, arch, total = f"--{side}-layers-to-keep", args.arch, getattr(args, f"{side}_layers")
    if not isinstance(value, str):  # argparse's list: fairseq-train's command line
        raise UsageError(f"{option} {','.join(map(str, value))}: {arch} keeps layers of a trained model "
                         "when fairseq-generate or fairseq-interactive loads it, given as --model-overrides "
                         f"\"{{'{side}_layers_to_keep': '0,2'}}\"; fairseq could not load a checkpoint "
                         "that fairseq-train writes with it")
    try:
        kept = [int(index) for index in value.split(",")]
    except ValueError:
        kept = []
    if not kept or len(set(kept)) != len(kept) or not all(0 <= index < total for index in kept):
        raise UsageError(f"{option} {value}: name distinct layers among the {total} {side} layers "
                         f"(0 to {total - 1}) of {arch}")
    return kept


@dataclass(frozen=True)
class CombinationOptions:
    """The input combination of every decoder layer, validated once."""

    strategy: str
    hier_heads: Optional[int]

    @classmethod
    def from_args(cls, args) -> "CombinationOptions":
        strategy, hier_heads = args.combination_strategy, args.hier_attention_heads
        if hier_heads is not None and (hier_heads < 1 or args.decoder_embed_dim % hier_heads):
            raise UsageError(f"--hier-attention-heads {hier_heads} must divide "
                             f"--decoder-embed-dim {args.decoder_embed_dim}")
        return cls(strategy, hier_heads)


class ImageFeatureEncoder(nn.Module):
    """The image "encoder": ``Linear(C, d)`` over precomputed features (Libovický et al.
    2018, §4: "a linear projection to 512"), ``B x P x C`` -> ``P x B x d``, every position
    valid (images have no padding)."""

    def __init__(self, channels: int, embed_dim: int):
        super().__init__()
        self.projection = nn.Linear(channels, embed_dim)

    def forward(self, features: Tensor, src_lengths: Optional[Tensor] = None,
                return_all_hiddens: bool = False) -> Dict[str, List[Tensor]]:
        x = self.projection(features).transpose(0, 1)  # P x B x d
        mask = torch.zeros(features.shape[:2], dtype=torch.bool, device=features.device)  # B x P
        return {ENCODER_OUT: [x], PADDING_MASK: [mask]}


class MultiSourceEncoder(FairseqEncoder):
    """n encoders, one per source; see the module docstring for the output."""

    def __init__(self, dictionary, encoders: List[nn.Module], sources: SourceLayout):
        super().__init__(dictionary)
        self.encoders = nn.ModuleList(encoders)
        self.names = list(sources.names)
        self.primary_index = sources.primary_index
        self.text_indices = [k for k, kind in enumerate(sources.kinds) if kind == TEXT]

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
        outputs = [
            encoder(inputs, src_lengths=length,
                    return_all_hiddens=return_all_hiddens and k == self.primary_index)
            for k, (encoder, inputs, length) in enumerate(zip(self.encoders, multi_source_inputs, lengths))
        ]
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
        return min(self.encoders[k].max_positions() for k in self.text_indices)


@DECODER_CROSS_ATTENTION_SUBLAYER.register(
    "input combination", given_by=lambda cfg: f"--combination-strategy {cfg.combination_strategy}")
def build_combination_sublayer(cfg, layer_idx, embed_dim, sources: Optional[SourceLayout] = None,
                               combination: Optional[CombinationOptions] = None, **layer_context):
    """Every layer of the multi-source decoder, which hands its layers the sources and the
    combination options (no other decoder does): the strategy's :class:`InputCombination`
    (residuals and LayerNorms included, since serial chains n residual sublayers)."""
    if sources is None:
        return None
    return build_input_combination(
        combination.strategy, embed_dim, cfg.decoder.attention_heads, len(sources),
        cfg.encoder.embed_dim, cfg.dropout, cfg.attention_dropout, cfg.decoder.normalize_before,
        primary_index=sources.primary_index, hier_heads=combination.hier_heads,
    )


def source_extras(encoder_out: Dict[str, List[Tensor]]) -> Dict[str, Tensor]:
    """The multi-source decoder's layer extras (``encoder_extras`` of its
    :class:`SlotTransformerDecoder`): each source's memory and mask as an extra of its own (a
    list in one argument would be a constant to fairseq's checkpoint wrapper)."""
    if MEMORY_KEY not in encoder_out:
        raise KeyError("the multi-source decoder needs the multi-source encoder's output")
    extras = {}
    for k, (memory, mask) in enumerate(zip(encoder_out[MEMORY_KEY], encoder_out[MASKS_KEY])):
        extras[source_memory_extra(k)] = memory
        extras[source_mask_extra(k)] = mask
    return extras


class MultiSourceHubInterface(hub_utils.GeneratorHubInterface):
    """fairseq's hub interface whose sentences are the multi-source task's input lines: the
    sources in ``--source-langs`` order separated by tabs, each tokenized and BPE-encoded as
    fairseq's interface does a sentence (``MultiSourceTranslationTask.encode_input_line``;
    an image source's field is a row of ``inference_image_features``, an argument of
    :meth:`MultiSourceTransformerModel.from_pretrained`)."""

    def encode(self, sentence: str) -> torch.LongTensor:
        return self.task.encode_input_line(sentence, lambda text: self.apply_bpe(self.tokenize(text)))


@register_model("multi_source_transformer")
class MultiSourceTransformerModel(SlotTransformerModel):
    """Multi-source Transformer (Libovický et al., WMT 2018); see the module docstring."""

    is_multi_source = True  # checked by the multi_source_translation task
    decoder_class_for = classmethod(main_decoder_class)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".",
                        **kwargs):
        """fairseq's ``from_pretrained`` (``kwargs`` override the checkpoint's options, e.g.
        ``inference_image_features="test.img.npy"``), with the hub interface of the
        task's input lines (:class:`MultiSourceHubInterface`)."""
        loaded = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                           archive_map=cls.hub_models(), **kwargs)
        return MultiSourceHubInterface(loaded["args"], loaded["task"], loaded["models"])

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        INPUT_COMBINATION.add_args(parser)
        MULTI_LEVEL_SUPERVISION.add_args(parser)

    @classmethod
    def complete_options(cls, args):
        multi_source_transformer(args)

    @classmethod
    def build_encoder_and_decoder(cls, args, task):
        """One encoder per source of the task, the combining decoder; the embeddings as
        the module docstring says. (The slot model's check that a replaced encoder output
        is read does not apply: every source's ``encoder_out`` is a combined memory.)"""
        if not hasattr(task, "source_kinds"):
            raise UsageError("--arch multi_source_transformer needs --task multi_source_translation")
        if args.no_cross_attention:
            raise UsageError("--no-cross-attention: the multi-source decoder attends to its sources")
        if args.merge_src_tgt_embed:
            raise UsageError(f"--merge-src-tgt-embed: {args.arch} has one joint dictionary already; tie "
                             "the embeddings with --share-all-embeddings")
        decoder_path = args.decoder_embed_path
        if args.share_all_embeddings and decoder_path and decoder_path != args.encoder_embed_path:
            raise UsageError(f"--decoder-embed-path {decoder_path}: with --share-all-embeddings "
                             f"the decoder of {args.arch} reads the text encoders' matrix, filled from "
                             "--encoder-embed-path; give that file or leave one option out")
        sources = SourceLayout.of_task(task)
        combination = CombinationOptions.from_args(args)
        cfg = TransformerConfig.from_namespace(args)
        for side, layers in (("encoder", cfg.encoder), ("decoder", cfg.decoder)):
            kept = layers_to_keep(args, side)
            if kept:  # fairseq prunes the loaded weights to these (load_state_dict)
                layers.layers = len(kept)
        dictionary = task.source_dictionary  # one joint dictionary (the task checks it)
        primary_tokens = cls.build_embedding(cfg, dictionary, cfg.encoder.embed_dim, cfg.encoder.embed_path)
        if cfg.share_all_embeddings:
            if cfg.encoder.embed_dim != cfg.decoder.embed_dim:
                raise UsageError("--share-all-embeddings requires --encoder-embed-dim to match "
                                 "--decoder-embed-dim")
            decoder_tokens = primary_tokens
            cfg.share_decoder_input_output_embed = True
        else:
            decoder_tokens = cls.build_embedding(cfg, dictionary, cfg.decoder.embed_dim, cfg.decoder.embed_path)
        shared = cfg.share_all_embeddings or args.share_encoder_embeddings
        encoders = []
        for k, (kind, channels) in enumerate(zip(sources.kinds, sources.image_channels)):
            if kind == IMAGE:
                encoders.append(ImageFeatureEncoder(channels, cfg.encoder.embed_dim))
                continue
            tokens = primary_tokens if shared or k == sources.primary_index else cls.build_embedding(
                cfg, dictionary, cfg.encoder.embed_dim, cfg.encoder.embed_path)
            encoders.append(SlotTransformerEncoder(cfg, dictionary, tokens,
                                                   reaches_decoder=k == sources.primary_index))
        encoder = MultiSourceEncoder(dictionary, encoders, sources)
        decoder = cls.build_decoder(cfg, dictionary, decoder_tokens, encoder_extras=source_extras,
                                    layer_context=dict(sources=sources, combination=combination))
        return cls(args, encoder, decoder)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        """fairseq's (which prunes the layers to keep), after refusing the pruning of a
        model with weights outside its layers whose size depends on the number of layers."""
        pruned = [side for side in ("encoder", "decoder")
                  if getattr(model_cfg, f"{side}_layers_to_keep", None)]
        if pruned:
            own = self.state_dict()
            sized = [key for key, value in state_dict.items()
                     if not LAYER_KEY.search(key) and key in own and own[key].shape != value.shape]
            if sized:
                raise UsageError(f"--{pruned[0]}-layers-to-keep: {sized[0]} of {self.args.arch} has a size "
                                 "per number of layers (a mechanism over all layers), which pruning "
                                 "cannot cut; decode the whole model")
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)

    def decoder_partner(self) -> SlotTransformerEncoder:
        """The primary source's encoder: the decoder's MLRF fusion shares its layer table."""
        return self.encoder.encoders[self.encoder.primary_index]

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


@register_architecture("multi_source_transformer", "multi_source_transformer")
def multi_source_transformer(args):
    """fairseq's ``transformer`` defaults, serial combination (the best MSMT strategy), no
    auxiliary decoders."""
    INPUT_COMBINATION.set_defaults(args)
    args.aux_decoder_layers = getattr(args, "aux_decoder_layers", NO_AUX)
    MULTI_LEVEL_SUPERVISION.set_defaults(args)
    slot_transformer(args)


def paper_settings(args):
    """What the paper and its reference implementation fix for both tasks: pre-norm with a
    final LayerNorm, no embedding scaling, one embedding matrix tied three ways
    (Libovický et al. 2018, §4), dropout 0.1 ([choice] the paper does not state it),
    attention dropout 0 (the reference implementation)."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    args.no_scale_embedding = getattr(args, "no_scale_embedding", True)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", True)
    args.dropout = getattr(args, "dropout", 0.1)
    args.attention_dropout = getattr(args, "attention_dropout", 0.0)
    multi_source_transformer(args)


@register_architecture("multi_source_transformer", "multimodal_transformer_multi30k")
def multimodal_transformer_multi30k(args):
    """MMT on Multi30k (Libovický et al. 2018, §4): d=512, 16 heads, FFN 4096, 6 encoder and
    6 decoder layers; sources English text then image (serial order of Fig. 1)."""
    set_sizes(args, embed_dim=512, heads=16, ffn=4096, encoder_layers=6, decoder_layers=6)
    paper_settings(args)


@register_architecture("multi_source_transformer", "multi_source_transformer_europarl")
def multi_source_transformer_europarl(args):
    """MSMT on Europarl (Libovický et al. 2018, §4): d=256, 8 heads, FFN 2048, 4-layer
    encoders, 6-layer decoder; sources es, fr, de, en. With one source it is the paper's
    baseline."""
    set_sizes(args, embed_dim=256, heads=8, ffn=2048, encoder_layers=4, decoder_layers=6)
    paper_settings(args)
