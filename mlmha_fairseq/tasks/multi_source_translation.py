"""Task ``multi_source_translation``: n aligned sources (text, or precomputed image
features) and one target, for the multi-source Transformer (Libovický et al. 2018).

Data layout (what ``python -m mlmha_fairseq.cli.build_corpus --sources es fr de --target en``
writes; docs/corpus.md): every text source ``s`` is binarized with the target by
``fairseq-preprocess --srcdict dict.txt --tgtdict dict.txt`` (one joint dictionary) into
``{split}.{s}-{tgt}.{s}.bin/.idx``; the target is read from the first text source's pair,
and every other pair's target must hold the same sentences;
an image source ``img`` is a float array ``{split}.{img}.npy`` of shape ``[sentences,
positions, channels]``. Line ``i`` of every file is the same tuple. Everything is checked
when a split is loaded, before training or decoding starts: a missing file, a language
without dictionary, files with different numbers of sentences, image features with
another number of rows or channels, pairs whose targets differ, or dictionaries that
differ, each stop with a :class:`DataError` naming the file (one line, exit status 1).

Example (the order of ``--source-langs`` is the serial order of Fig. 1a)::

    fairseq-train data-bin --user-dir mlmha_fairseq --task multi_source_translation \
        --source-langs es,fr,de,en --target-lang cs --primary-source en \
        --arch multi_source_transformer_europarl --combination-strategy serial ...
    fairseq-generate data-bin --user-dir mlmha_fairseq --task multi_source_translation \
        --source-langs es,fr,de,en --target-lang cs --primary-source en \
        --path checkpoint_best.pt --beam 10 --gnmt-lenpen 1.0 \
        [--adversarial-source en --adversarial-seed 1]

Checkpoint selection by validation BLEU takes fairseq's translation-task options (the same
names, defaults and computation, inherited from fairseq's ``TranslationTask``)::

    fairseq-train data-bin ... --eval-bleu --eval-bleu-args '{"beam": 10}' \
        --eval-bleu-detok moses --eval-bleu-remove-bpe \
        --best-checkpoint-metric bleu --maximize-best-checkpoint-metric

Translating input lines (``fairseq-interactive``, or in Python the hub interface of
``MultiSourceTransformerModel.from_pretrained``): one line per tuple, its sources in
``--source-langs`` order separated by tabs; a text source's field is its sentence (tokenized
and BPE-encoded by ``--tokenizer``/``--bpe`` as fairseq does a sentence), an image source's
field a row number (from 0) of that source's ``--inference-image-features`` file. A line with
another number of fields, or a row the file does not have, ends with one line naming the
expected sources (:meth:`MultiSourceTranslationTask.encode_input_line`)::

    paste test.es test.fr test.de test.en | fairseq-interactive data-bin --user-dir mlmha_fairseq \
        --task multi_source_translation --source-langs es,fr,de,en --target-lang cs \
        --primary-source en --path checkpoint_best.pt --beam 10 --gnmt-lenpen 1.0
    paste test.en <(seq 0 999) | fairseq-interactive data-bin --user-dir mlmha_fairseq \
        --task multi_source_translation --source-langs en,img --image-sources img \
        --target-lang de --inference-image-features test.img.npy --path checkpoint_best.pt
"""
import dataclasses
import filecmp
import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from fairseq import utils
from fairseq.data import Dictionary, ListDataset, data_utils, indexed_dataset
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from mlmha_fairseq.data.multi_source_dataset import (
    IMAGE,
    NPY_SUFFIX,
    TEXT,
    DataError,
    ImageFeatureDataset,
    MultiSourceLanguagePairDataset,
    PackedLinesDataset,
    PackedSources,
    deranged,
)
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.generation.gnmt_task_mixin import (
    GNMTLengthPenaltyConfig,
    GNMTLengthPenaltyMixin,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_POSITIONS = 1024  # fairseq's translation task default
DEFAULT_ADVERSARIAL_SEED = 1
# Characters of an input line quoted in an error about it.
EXCERPT_CHARS = 60
CONSTRAINTS_REFUSED = ("--constraints: the multi_source_translation task decodes without target "
                       "constraints (fairseq-interactive would read them from the tab-separated "
                       "fields of an input line, which here are the sources)")


def _names(value: Optional[str]) -> List[str]:
    return [name.strip() for name in (value or "").split(",") if name.strip()]


_TRANSLATION_OPTIONS = {option.name: option for option in dataclasses.fields(TranslationConfig)}


def _translation_option(name: str):
    """fairseq's translation-task option ``name`` (default, help): validation BLEU is asked
    for here with the options of fairseq's translation task, which computes it."""
    option = _TRANSLATION_OPTIONS[name]
    return field(default=option.default, metadata=option.metadata)


@dataclass
class MultiSourceTranslationConfig(GNMTLengthPenaltyConfig):
    data: Optional[str] = field(
        default=None,
        metadata={"help": "data directory: {split}.{src}-{tgt}.{src}/.{tgt} binarized with one "
                          "joint dictionary, {split}.{img}.npy for image sources"},
    )
    source_langs: Optional[str] = field(
        default=None,
        metadata={"help": "comma-separated sources in the model's order (the serial order), "
                          "e.g. es,fr,de,en or en,img"},
    )
    target_lang: Optional[str] = field(
        default=None, metadata={"help": "target language", "argparse_alias": "-t"}
    )
    image_sources: Optional[str] = field(
        default=None,
        metadata={"help": "comma-separated names among --source-langs that are precomputed "
                          "image features ({split}.{name}.npy, [sentences, positions, channels])"},
    )
    primary_source: Optional[str] = field(
        default=None,
        metadata={"help": "text source given to fairseq as src_tokens: fairseq-generate's "
                          "S- lines and --max-len-a count it (default: the first text source)"},
    )
    left_pad_source: bool = field(default=True, metadata={"help": "pad text sources on the left"})
    left_pad_target: bool = field(default=False, metadata={"help": "pad the target on the left"})
    max_source_positions: int = field(
        default=DEFAULT_MAX_POSITIONS, metadata={"help": "max tokens of each text source"}
    )
    max_target_positions: int = field(
        default=DEFAULT_MAX_POSITIONS, metadata={"help": "max tokens of the target"}
    )
    adversarial_source: Optional[str] = field(
        default=None,
        metadata={"help": "adversarial evaluation: give every sentence of the loaded split the "
                          "source (or image) NAME of another sentence, by a fixed-seed "
                          "derangement"},
    )
    adversarial_seed: int = field(
        default=DEFAULT_ADVERSARIAL_SEED, metadata={"help": "seed of the derangement"}
    )
    inference_image_features: Optional[str] = field(
        default=None,
        metadata={"help": "fairseq-interactive and the hub interface: comma-separated .npy files "
                          "[images, positions, channels], one per image source in --source-langs "
                          "order; an input line's field for an image source is a row (from 0) of "
                          "its file"},
    )
    dataset_impl: Optional[ChoiceEnum(indexed_dataset.get_available_dataset_impl())] = II(
        "dataset.dataset_impl"
    )
    eval_bleu: bool = _translation_option("eval_bleu")
    eval_bleu_args: Optional[str] = _translation_option("eval_bleu_args")
    eval_bleu_detok: str = _translation_option("eval_bleu_detok")
    eval_bleu_detok_args: Optional[str] = _translation_option("eval_bleu_detok_args")
    eval_tokenized_bleu: bool = _translation_option("eval_tokenized_bleu")
    eval_bleu_remove_bpe: Optional[str] = _translation_option("eval_bleu_remove_bpe")
    eval_bleu_print_samples: bool = _translation_option("eval_bleu_print_samples")


@register_task("multi_source_translation", dataclass=MultiSourceTranslationConfig)
class MultiSourceTranslationTask(GNMTLengthPenaltyMixin, TranslationTask):
    """Translation from n aligned sources; see the module docstring.

    Attributes read by the model (``multi_source_transformer``): ``source_names``,
    ``source_kinds`` (``"text"``/``"image"``), ``primary_index`` and ``image_channels``.

    fairseq's ``TranslationTask`` is the base for its validation BLEU (``--eval-bleu``:
    ``build_model``, ``valid_step``, ``reduce_metrics``), on the batches of this task; data,
    dictionaries and inference are this task's own.

    Input lines (fairseq-interactive, the hub interface): :meth:`encode_input_line` makes one
    token row of a line's sources (:class:`PackedSources`), which is all that
    fairseq-interactive hands from a batch to :meth:`inference_step`; that method unpacks
    the rows into the sources the model reads.
    """

    cfg: MultiSourceTranslationConfig

    def __init__(self, cfg: MultiSourceTranslationConfig, dictionary: Dictionary,
                 image_channels: Dict[str, int]):
        super().__init__(cfg, dictionary, dictionary)
        self.dictionary = dictionary
        self.source_names, self.source_kinds, self.primary_index = _layout(cfg)
        self.image_channels = image_channels
        self.packing = PackedSources(self.source_kinds, self.primary_index, dictionary)
        self._inference_features = None  # {source index: ImageFeatureDataset}, read at first use

    @classmethod
    def setup_task(cls, cfg: MultiSourceTranslationConfig, **kwargs):
        names, kinds, _ = _layout(cfg)
        data = _data_dir(cfg)
        dictionary = _joint_dictionary(data, [n for n, k in zip(names, kinds) if k == TEXT],
                                       cfg.target_lang)
        inference = _inference_feature_paths(cfg, kinds)
        channels = {name: _image_channels(data, name, inference.get(k))
                    for k, (name, kind) in enumerate(zip(names, kinds)) if kind == IMAGE}
        logger.info("sources %s -> %s, joint dictionary: %d types", ",".join(names),
                    cfg.target_lang, len(dictionary))
        return cls(cfg, dictionary, channels)

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary

    def max_positions(self):
        return self.cfg.max_source_positions, self.cfg.max_target_positions

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        if not getattr(model, "is_multi_source", False):
            raise UsageError("--task multi_source_translation needs a multi-source model "
                             "(--arch multi_source_transformer or one of its presets)")
        return model

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None, **kwargs):
        """The generator of fairseq (or of ``--gnmt-lenpen``); ``--constraints`` is refused
        here, before fairseq-interactive splits an input line at its tabs to find them."""
        if getattr(args, "constraints", None):
            raise UsageError(CONSTRAINTS_REFUSED)
        return super().build_generator(models, args, seq_gen_cls=seq_gen_cls,
                                       extra_gen_cls_kwargs=extra_gen_cls_kwargs, **kwargs)

    def encode_input_line(self, line: str, encode_fn: Optional[Callable[[str], str]] = None) -> torch.Tensor:
        """One input line as one token row (:class:`PackedSources`): the sources in
        ``--source-langs`` order, separated by tabs; a text source's field is passed through
        ``encode_fn`` (fairseq-interactive's ``--tokenizer`` and ``--bpe``) and binarized with
        the joint dictionary, an image source's field is a row (from 0) of its
        ``--inference-image-features`` file."""
        fields = line.split("\t")
        if len(fields) != len(self.source_names):
            # fairseq-interactive strips each line, tabs included: an empty first or last field is gone
            stripped = ("; fairseq-interactive strips tabs at both ends of a line, so an empty first or last field "
                        "is lost: give every source some text") if len(fields) < len(self.source_names) else ""
            raise UsageError(f"the input line {_excerpt(line)} has {len(fields)} tab-separated field(s); "
                             f"--source-langs {self.cfg.source_langs} needs one per source: "
                             f"{'<TAB>'.join(self.source_names)}{stripped}")
        sources = []
        for k, (name, kind, text) in enumerate(zip(self.source_names, self.source_kinds, fields)):
            if kind == IMAGE:
                row = int(text) if text.strip().isascii() and text.strip().isdigit() else -1  # not "²"
                self._check_image_row(k, row, f"{text!r} in the input line {_excerpt(line)}")
                sources.append(row)
                continue
            tokens = self.dictionary.encode_line(encode_fn(text) if encode_fn else text,
                                                 add_if_not_exist=False).long()
            if (tokens[:-1] == self.dictionary.eos()).any():
                raise UsageError(f"source {name} of the input line {_excerpt(line)} holds the "
                                 f"end-of-sentence symbol {self.dictionary.eos_word}")
            sources.append(tokens)
        return self.packing.pack(sources)

    def get_interactive_tokens_and_lengths(self, lines, encode_fn):
        """fairseq-interactive's input lines, each one token row (:meth:`encode_input_line`)."""
        tokens = [self.encode_input_line(line, encode_fn) for line in lines]
        return tokens, [row.numel() for row in tokens]

    def build_dataset_for_inference(self, src_tokens, src_lengths, constraints=None):
        """Input lines ``src_tokens`` (rows of :meth:`encode_input_line`, whose lengths the
        rows themselves give), sized and filtered by their sources, batched as packed rows
        (:class:`PackedLinesDataset`)."""
        if constraints is not None:
            raise UsageError(CONSTRAINTS_REFUSED)
        return PackedLinesDataset(self._line_tuples(src_tokens), src_tokens)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        """fairseq's inference step; a batch of packed input lines (from
        :meth:`build_dataset_for_inference`) is first unpacked into the sources the model
        reads, collated as a test set's batch, so that a line decodes as it would there."""
        net_input = sample["net_input"]
        if "multi_source_inputs" not in net_input:
            tokens, lengths = net_input["src_tokens"], net_input["src_lengths"]
            rows = [row[-length:] if self.cfg.left_pad_source else row[:length]
                    for row, length in zip(tokens.cpu(), lengths.tolist())]
            tuples = self._line_tuples(rows)
            batch = tuples.collater([tuples[i] for i in range(len(tuples))])
            sample = dict(sample, net_input=utils.apply_to_sample(lambda t: t.to(tokens.device),
                                                                  batch["net_input"]))
        return super().inference_step(generator, models, sample, prefix_tokens=prefix_tokens,
                                      constraints=constraints)

    def _line_tuples(self, rows) -> MultiSourceLanguagePairDataset:
        """The sources of packed input lines, each image row replaced by its features."""
        lines = [self.packing.unpack(row) for row in rows]
        sources = []
        for k, kind in enumerate(self.source_kinds):
            items = [line[k] for line in lines]
            if kind == IMAGE:
                for row in items:
                    self._check_image_row(k, row, f"row {row}")
                items = [self._inference_image_features()[k][row] for row in items]
            sources.append(ListDataset(items, np.array([len(item) for item in items], dtype=np.int64)))
        return MultiSourceLanguagePairDataset(
            sources, self.source_kinds, None, self.dictionary, self.primary_index,
            left_pad_source=self.cfg.left_pad_source, left_pad_target=self.cfg.left_pad_target,
            shuffle=False,
        )

    def _check_image_row(self, k: int, row: int, what: str) -> None:
        features = self._inference_image_features()[k]
        if not 0 <= row < len(features):
            raise UsageError(f"image source {self.source_names[k]}: {what} is not a row of "
                             f"{features.path} (0 to {len(features) - 1})")

    def _inference_image_features(self) -> Dict[int, ImageFeatureDataset]:
        """``--inference-image-features`` by source index, read when an input line first
        needs it (training never does)."""
        if self._inference_features is None:
            paths = _inference_feature_paths(self.cfg, self.source_kinds)
            if not paths:
                images = [n for n, kind in zip(self.source_names, self.source_kinds) if kind == IMAGE]
                raise UsageError(f"the image source(s) {','.join(images)} of input lines need "
                                 "--inference-image-features FILE.npy (one per image source), "
                                 "whose rows the lines name")
            self._inference_features = {}
            for k, path in paths.items():
                features = ImageFeatureDataset(path)
                name = self.source_names[k]
                if features.channels != self.image_channels[name]:
                    raise DataError(f"{path} has {features.channels} channels per position, the "
                                    f"model's image source {name} reads {self.image_channels[name]}")
                self._inference_features[k] = features
        return self._inference_features

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        """Load ``split`` as one N-way dataset; every file is checked first."""
        data = _data_dir(self.cfg)
        target_lang = self.cfg.target_lang
        first_text = self.source_names[self.source_kinds.index(TEXT)]
        target_prefix = _pair_prefix(data, split, first_text, target_lang, target_lang)
        target = self._load_text(target_prefix, f"target {target_lang}")
        sources = []
        for name, kind in zip(self.source_names, self.source_kinds):
            if kind == IMAGE:
                source, path = self._load_image(data, split, name), _npy_path(data, split, name)
            else:
                prefix = _pair_prefix(data, split, name, target_lang, name)
                source, path = self._load_text(prefix, f"source {name}"), _bin_path(prefix)
                pair_target = _pair_prefix(data, split, name, target_lang, target_lang)
                if pair_target != target_prefix:
                    _check_same_target(target_prefix, target, pair_target,
                                       self._load_text(pair_target, f"target {target_lang}"))
            if len(source) != len(target):
                raise DataError(
                    f"{path} has {len(source)} {'rows' if kind == IMAGE else 'sentences'} but the "
                    f"target {_bin_path(target_prefix)} has {len(target)}: the files of split "
                    f"{split!r} must be line-aligned"
                )
            if name == self.cfg.adversarial_source:
                logger.info("adversarial evaluation: %s of %s deranged (seed %d)", name, split,
                            self.cfg.adversarial_seed)
                source = deranged(source, self.cfg.adversarial_seed)
            sources.append(source)
        self.datasets[split] = MultiSourceLanguagePairDataset(
            sources, self.source_kinds, target, self.dictionary, self.primary_index,
            left_pad_source=self.cfg.left_pad_source, left_pad_target=self.cfg.left_pad_target,
        )
        logger.info("%s: %d tuples", split, len(target))

    def _load_text(self, prefix: str, what: str):
        dataset = data_utils.load_indexed_dataset(prefix, self.dictionary, self.cfg.dataset_impl)
        if dataset is None:
            raise DataError(f"{what}: {_bin_path(prefix)} not found or unreadable")
        return dataset

    def _load_image(self, data: str, split: str, name: str) -> ImageFeatureDataset:
        path = _npy_path(data, split, name)
        if not os.path.isfile(path):
            raise DataError(f"image source {name}: {path} not found")
        dataset = ImageFeatureDataset(path)
        if dataset.channels != self.image_channels[name]:
            raise DataError(f"{path} has {dataset.channels} channels per position, other "
                            f"{name} files have {self.image_channels[name]}")
        return dataset


def _layout(cfg):
    """``(names, kinds, primary index)`` of ``--source-langs``, validated."""
    names, images = _names(cfg.source_langs), _names(cfg.image_sources)
    if not names:
        raise UsageError("--task multi_source_translation needs --source-langs, e.g. es,fr,de,en")
    if cfg.target_lang is None:
        raise UsageError("--task multi_source_translation needs --target-lang")
    if len(set(names)) != len(names):
        raise UsageError(f"--source-langs {cfg.source_langs} names a source twice")
    for option, values in (("--image-sources", images), ("--adversarial-source", _names(cfg.adversarial_source)),
                           ("--primary-source", _names(cfg.primary_source))):
        unknown = [v for v in values if v not in names]
        if unknown:
            raise UsageError(f"{option} {','.join(unknown)} is not among --source-langs {cfg.source_langs}")
    kinds = [IMAGE if name in images else TEXT for name in names]
    if TEXT not in kinds:
        raise UsageError("--source-langs needs at least one text source")
    primary = cfg.primary_source or names[kinds.index(TEXT)]
    if primary in images:
        raise UsageError(f"--primary-source {primary} must be a text source")
    return names, kinds, names.index(primary)


def _data_dir(cfg) -> str:
    if not cfg.data:
        raise UsageError("--task multi_source_translation needs a data directory")
    data = utils.split_paths(cfg.data)[0]
    if not os.path.isdir(data):
        raise DataError(f"data directory not found: {data}")
    return data


def _joint_dictionary(data: str, text_sources: List[str], target_lang: str) -> Dictionary:
    """The target dictionary; every text source's must be the same (one joint dictionary)."""
    dictionaries = {}
    for lang in [target_lang] + text_sources:
        path = os.path.join(data, f"dict.{lang}.txt")
        if not os.path.isfile(path):
            raise DataError(f"no dictionary for language {lang}: {path} not found")
        dictionaries[path] = Dictionary.load(path)
    target_path, target = next(iter(dictionaries.items()))
    for path, dictionary in dictionaries.items():
        if dictionary.symbols != target.symbols:
            raise DataError(f"{path} differs from {target_path}: binarize every pair with one "
                            "joint dictionary (fairseq-preprocess --srcdict D --tgtdict D)")
    return target


def _inference_feature_paths(cfg, kinds: List[str]) -> Dict[int, str]:
    """``--inference-image-features`` by source index (empty when not given)."""
    paths = _names(cfg.inference_image_features)
    images = [k for k, kind in enumerate(kinds) if kind == IMAGE]
    if paths and len(paths) != len(images):
        raise UsageError(f"--inference-image-features names {len(paths)} file(s) for the "
                         f"{len(images)} image source(s) of --image-sources {cfg.image_sources}: "
                         "give one .npy per image source, in --source-langs order")
    return dict(zip(images, paths))


def _image_channels(data: str, name: str, inference_path: Optional[str] = None) -> int:
    """Channels of image source ``name``, from any ``{split}.{name}.npy`` and its
    ``--inference-image-features`` file (all must agree; a model may be used for input lines
    with only the latter at hand)."""
    paths = sorted(glob.glob(os.path.join(data, f"*.{name}{NPY_SUFFIX}")))
    paths += [inference_path] if inference_path else []
    if not paths:
        raise DataError(f"image source {name}: no {os.path.join(data, '{split}.' + name + NPY_SUFFIX)} "
                        "file, nor --inference-image-features")
    channels = {path: ImageFeatureDataset(path, check_values=False).channels for path in paths}
    if len(set(channels.values())) > 1:
        raise DataError(f"image source {name}: files with different channels {channels}")
    return next(iter(channels.values()))


def _pair_prefix(data: str, split: str, src: str, tgt: str, lang: str) -> str:
    """``{split}.{src}-{tgt}.{lang}`` (or ``{tgt}-{src}``, as fairseq's translation task)."""
    for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
        prefix = os.path.join(data, f"{split}.{pair}.{lang}")
        if indexed_dataset.dataset_exists(prefix, impl=None):
            return prefix
    raise DataError(f"{'source' if lang == src else 'target'} {lang} of split {split!r}: "
                    f"{_bin_path(os.path.join(data, f'{split}.{src}-{tgt}.{lang}'))} not found")


def _check_same_target(prefix: str, target, other_prefix: str, other) -> None:
    """Every pair of an N-way split is binarized with the same target text, and only the
    first pair's target is read: refuse a pair whose target differs, which would pair its
    source lines with the wrong sentences."""
    if filecmp.cmp(_bin_path(prefix), _bin_path(other_prefix), shallow=False):
        return  # the same bytes (the usual case), without reading every sentence
    for line in range(min(len(target), len(other))):
        if not torch.equal(target[line], other[line]):
            break
    else:
        if len(target) == len(other):
            return
        line = min(len(target), len(other))
    raise DataError(f"{_bin_path(other_prefix)} differs from {_bin_path(prefix)} at line {line + 1}: "
                    "every pair of the split must be binarized with the same target file, line "
                    "for line")


def _excerpt(line: str) -> str:
    return repr(line if len(line) <= EXCERPT_CHARS else line[:EXCERPT_CHARS - 3] + "...")


def _bin_path(prefix: str) -> str:
    return prefix + ".bin"


def _npy_path(data: str, split: str, name: str) -> str:
    return os.path.join(data, f"{split}.{name}{NPY_SUFFIX}")
