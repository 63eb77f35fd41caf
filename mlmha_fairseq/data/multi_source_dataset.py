"""N-way parallel data for multi-source translation (Libovický et al. 2018).

:class:`MultiSourceLanguagePairDataset` holds n aligned sources and one target. Item ``i``
is line ``i`` of every file, so every filter and every batch works on whole tuples and the
sources can never desynchronise. A source is either text (a fairseq indexed dataset of
token ids, binarized by ``fairseq-preprocess`` with the joint dictionary) or precomputed
image features (:class:`ImageFeatureDataset`: a float array ``[N, positions, channels]``).

Input lines of ``fairseq-interactive`` and of the hub interface travel as one token row per
line (:class:`PackedSources`, :class:`PackedLinesDataset`), since fairseq-interactive hands
only ``src_tokens`` and ``src_lengths`` of a batch on to the task's ``inference_step``.
"""
from typing import List, Sequence, Union

import numpy as np
import torch
from fairseq.data import BaseWrapperDataset, FairseqDataset, data_utils

from mlmha_fairseq.errors import UsageError

from ..source_kinds import IMAGE, TEXT  # noqa: F401 (also imported from here)
NPY_SUFFIX = ".npy"
# Image features are checked for NaN and infinities in blocks of rows of about this size, so
# that the check of a memory-mapped array of many GB never holds more than one block.
FINITE_CHECK_BYTES = 64 << 20


class DataError(UsageError):
    """Misaligned or missing data, reported with the file names before training starts."""


class ImageFeatureDataset(FairseqDataset):
    """Precomputed image features: row ``i`` of a ``.npy`` array ``[N, positions, channels]``
    (e.g. a ResNet's last convolutional layer, ``H*W`` positions), memory-mapped. Items are
    ``positions x channels`` float tensors; a batch stacks them (every image has the same
    number of positions, so there is no padding)."""

    def __init__(self, path: str, check_values: bool = True):
        """``check_values``: refuse NaN and infinite features (:meth:`check_finite`); off only
        where the header is all that is read (the number of channels)."""
        self.path = path
        try:
            self.features = np.load(path, mmap_mode="r")
        except (OSError, ValueError, EOFError) as error:  # numpy: EOFError for an empty file
            raise DataError(f"cannot read image features {path}: {error}") from error
        if self.features.ndim != 3:
            raise DataError(f"image features {path} have shape {self.features.shape}; "
                            "expected [sentences, positions, channels]")
        self.sizes = np.full(len(self.features), self.features.shape[1], dtype=np.int64)
        if check_values:
            self.check_finite()

    def check_finite(self) -> None:
        """:class:`DataError` naming the file and the first row with a NaN or infinite value:
        one such value makes every gradient NaN, and fairseq would stop only after training
        started, with "gradients are Nan/Inf" and no word of the file."""
        if not np.issubdtype(self.features.dtype, np.inexact):
            return  # integers cannot be NaN or infinite
        row_bytes = max(1, self.features[:1].nbytes)
        block = max(1, FINITE_CHECK_BYTES // row_bytes)
        for start in range(0, len(self.features), block):
            finite = np.isfinite(self.features[start:start + block]).all(axis=(1, 2))
            bad = np.flatnonzero(~finite)
            if bad.size:
                row = start + int(bad[0])
                raise DataError(f"image features {self.path}: row {row} (sentence {row + 1}) holds NaN or "
                                "infinite values; recompute the features or replace those values")

    @property
    def channels(self) -> int:
        return int(self.features.shape[2])

    def __getitem__(self, index):
        return torch.from_numpy(np.array(self.features[index], dtype=np.float32))

    def __len__(self):
        return len(self.features)

    def num_tokens(self, index):
        return int(self.sizes[index])

    def size(self, index):
        return int(self.sizes[index])


class DerangedDataset(FairseqDataset):
    """``dataset`` with item ``i`` replaced by item ``permutation[i]`` (the adversarial
    evaluation: every sentence gets another sentence's source or image)."""

    def __init__(self, dataset, permutation: np.ndarray):
        self.dataset = dataset
        self.permutation = permutation
        self.sizes = np.asarray(dataset.sizes)[permutation]

    def __getitem__(self, index):
        return self.dataset[int(self.permutation[index])]

    def __len__(self):
        return len(self.dataset)


def derangement(size: int, seed: int) -> np.ndarray:
    """A permutation of ``range(size)`` without fixed points, drawn uniformly with a fixed
    seed (rejection sampling: on average e draws)."""
    if size < 2:
        raise DataError(f"a derangement needs at least 2 sentences, the split has {size}")
    rng = np.random.RandomState(seed)
    while True:
        permutation = rng.permutation(size)
        if not np.any(permutation == np.arange(size)):
            return permutation


class MultiSourceLanguagePairDataset(FairseqDataset):
    """n aligned sources and one target.

    Args:
        sources: one dataset per source, in the model's source order.
        kinds: ``"text"`` or ``"image"`` per source.
        target: the target token dataset (None for inference without references).
        dictionary: the joint dictionary (padding and EOS of every text side).
        primary_index: the text source put in ``net_input["src_tokens"]``, which fairseq's
            generator reads for the batch size and the maximum output length.

    A batch's ``net_input`` holds ``src_tokens``/``src_lengths`` (the primary source),
    ``multi_source_inputs`` (n tensors: ``B x S_k`` token ids, padded per source, or ``B x
    positions x channels`` features) and ``multi_source_lengths`` (n tensors ``B``), and
    ``prev_output_tokens``. Sizes: :meth:`size` is ``(longest text source, target)``, the
    pair that ``--max-source-positions``/``--max-target-positions`` bound;
    :meth:`num_tokens` is ``max(sum of all source positions, target)``, since every encoder
    runs on its source.
    """

    def __init__(self, sources: Sequence, kinds: Sequence[str], target, dictionary,
                 primary_index: int = 0, left_pad_source: bool = True,
                 left_pad_target: bool = False, shuffle: bool = True):
        if len(sources) != len(kinds) or not sources:
            raise ValueError("one kind per source, at least one source")
        if kinds[primary_index] != TEXT:
            raise ValueError("the primary source must be text")
        lengths = {len(s) for s in sources} | ({len(target)} if target is not None else set())
        if len(lengths) != 1:
            raise DataError(f"sources and target have different numbers of sentences: {sorted(lengths)}")
        self.sources = list(sources)
        self.kinds = list(kinds)
        self.target = target
        self.dictionary = dictionary
        self.primary_index = primary_index
        self.left_pad_source = left_pad_source
        self.left_pad_target = left_pad_target
        self.shuffle = shuffle
        self.source_sizes = np.stack([np.asarray(s.sizes, dtype=np.int64) for s in self.sources])
        text_rows = [k for k, kind in enumerate(self.kinds) if kind == TEXT]
        self.text_sizes = self.source_sizes[text_rows].max(axis=0)  # longest text source
        self.total_source_sizes = self.source_sizes.sum(axis=0)
        self.tgt_sizes = None if target is None else np.asarray(target.sizes, dtype=np.int64)
        self.sizes = self.text_sizes if self.tgt_sizes is None else np.vstack(
            (self.text_sizes, self.tgt_sizes)).T

    def __getitem__(self, index):
        return {
            "id": index,
            "sources": [source[index] for source in self.sources],
            "target": None if self.target is None else self.target[index],
        }

    def __len__(self):
        return len(self.sources[0])

    def _collate_source(self, k: int, items: List[torch.Tensor]):
        if self.kinds[k] == IMAGE:
            features = torch.stack(items)  # B x positions x channels
            lengths = torch.full((len(items),), features.size(1), dtype=torch.long)
            return features, lengths
        tokens = data_utils.collate_tokens(items, self.dictionary.pad(), self.dictionary.eos(),
                                           left_pad=self.left_pad_source)
        return tokens, torch.tensor([item.numel() for item in items], dtype=torch.long)

    def collater(self, samples):
        if not samples:
            return {}
        collated = [self._collate_source(k, [s["sources"][k] for s in samples])
                    for k in range(len(self.sources))]
        inputs = [tokens for tokens, _ in collated]
        lengths = [length for _, length in collated]
        batch = {
            "id": torch.tensor([s["id"] for s in samples], dtype=torch.long),
            "nsentences": len(samples),
            "net_input": {
                "src_tokens": inputs[self.primary_index],
                "src_lengths": lengths[self.primary_index],
                "multi_source_inputs": inputs,
                "multi_source_lengths": lengths,
            },
            "target": None,
            "ntokens": int(lengths[self.primary_index].sum()),
        }
        if self.target is not None:
            targets = [s["target"] for s in samples]
            pad, eos = self.dictionary.pad(), self.dictionary.eos()
            batch["target"] = data_utils.collate_tokens(targets, pad, eos, left_pad=self.left_pad_target)
            batch["net_input"]["prev_output_tokens"] = data_utils.collate_tokens(
                targets, pad, eos, left_pad=self.left_pad_target, move_eos_to_beginning=True)
            batch["ntokens"] = sum(t.numel() for t in targets)
        return batch

    def num_tokens(self, index):
        tgt = 0 if self.tgt_sizes is None else self.tgt_sizes[index]
        return max(int(self.total_source_sizes[index]), int(tgt))

    def num_tokens_vec(self, indices):
        sizes = self.total_source_sizes[indices]
        return sizes if self.tgt_sizes is None else np.maximum(sizes, self.tgt_sizes[indices])

    def size(self, index):
        tgt = 0 if self.tgt_sizes is None else int(self.tgt_sizes[index])
        return int(self.text_sizes[index]), tgt

    def ordered_indices(self):
        """Shuffled (training) or in order, then sorted by target and by total source
        length, as fairseq's LanguagePairDataset sorts by target then source."""
        indices = np.random.permutation(len(self)) if self.shuffle else np.arange(len(self))
        if self.tgt_sizes is not None:
            indices = indices[np.argsort(self.tgt_sizes[indices], kind="mergesort")]
        return indices[np.argsort(self.total_source_sizes[indices], kind="mergesort")]

    def filter_indices_by_size(self, indices, max_sizes):
        """Drop whole tuples whose longest text source or whose target is too long
        (image sources have a fixed number of positions and are not bounded)."""
        if max_sizes is None:
            return indices, []
        max_source, max_target = max_sizes if isinstance(max_sizes, (tuple, list)) else (max_sizes, max_sizes)
        keep = np.ones(len(indices), dtype=bool)
        if max_source is not None:
            keep &= self.text_sizes[indices] <= max_source
        if max_target is not None and self.tgt_sizes is not None:
            keep &= self.tgt_sizes[indices] <= max_target
        return indices[keep], indices[~keep].tolist()

    @property
    def supports_prefetch(self):
        datasets = self.sources + ([self.target] if self.target is not None else [])
        return all(getattr(d, "supports_prefetch", False) for d in datasets)

    def prefetch(self, indices):
        for dataset in self.sources + ([self.target] if self.target is not None else []):
            dataset.prefetch(indices)


def deranged(dataset, seed: int) -> DerangedDataset:
    """``dataset`` with its items permuted by a fixed-seed derangement."""
    return DerangedDataset(dataset, derangement(len(dataset), seed))



class PackedSources:
    """One input line's sources as one token row, and back.

    The row holds the primary source first, so that what fairseq-interactive prints as the
    line's source (``S-``) and the positions ``--replace-unk`` reads are the primary
    source's, then the other sources in source order. A text source is its tokens, ending in
    EOS; an image source is one token, ``len(dictionary) + row`` of its features file, which
    no word has (the dictionary prints it as ``<unk>``) and which cannot be mistaken for the
    padding or EOS of the row.
    """

    def __init__(self, kinds: Sequence[str], primary_index: int, dictionary):
        self.kinds = list(kinds)
        self.order = [primary_index] + [k for k in range(len(kinds)) if k != primary_index]
        self.dictionary = dictionary

    def pack(self, sources: Sequence[Union[torch.Tensor, int]]) -> torch.Tensor:
        """``sources`` in source order: token tensors (ending in EOS) and image rows."""
        parts = [torch.tensor([len(self.dictionary) + sources[k]]) if self.kinds[k] == IMAGE
                 else sources[k] for k in self.order]
        return torch.cat(parts).long()

    def unpack(self, row: torch.Tensor) -> List[Union[torch.Tensor, int]]:
        """The sources of ``row`` (unpadded) in source order; a :class:`UsageError` for a row
        that :meth:`pack` did not make, e.g. a whole line binarized as one sentence."""
        sources, start = [None] * len(self.kinds), 0
        for k in self.order:
            if self.kinds[k] == IMAGE:
                if start >= len(row) or row[start] < len(self.dictionary):
                    break
                sources[k], start = int(row[start]) - len(self.dictionary), start + 1
                continue
            ends = (row[start:] == self.dictionary.eos()).nonzero()
            if not len(ends):
                break
            end = start + int(ends[0]) + 1
            sources[k], start = row[start:end], end
        if start != len(row) or any(source is None for source in sources):
            raise UsageError("a multi-source input is not one of the task's packed input lines: "
                             "encode each line with MultiSourceTranslationTask.encode_input_line (the "
                             "hub interface of MultiSourceTransformerModel.from_pretrained does)")
        return sources


class PackedLinesDataset(BaseWrapperDataset):
    """Input lines for inference: ``tuples`` (a :class:`MultiSourceLanguagePairDataset`
    without target, which sizes, filters and orders them) whose batches carry the packed
    rows (:class:`PackedSources`) as ``src_tokens``/``src_lengths``, the only part of a batch
    that fairseq-interactive passes on to the task."""

    def __init__(self, tuples: MultiSourceLanguagePairDataset, rows: Sequence[torch.Tensor]):
        super().__init__(tuples)
        self.rows = list(rows)

    def __getitem__(self, index):
        return {"id": index, "row": self.rows[index]}

    def collater(self, samples):
        if not samples:
            return {}
        rows = [sample["row"] for sample in samples]
        dictionary = self.dataset.dictionary
        return {
            "id": torch.tensor([sample["id"] for sample in samples], dtype=torch.long),
            "nsentences": len(samples),
            "ntokens": sum(row.numel() for row in rows),
            "net_input": {
                "src_tokens": data_utils.collate_tokens(rows, dictionary.pad(), dictionary.eos(),
                                                        left_pad=self.dataset.left_pad_source),
                "src_lengths": torch.tensor([row.numel() for row in rows], dtype=torch.long),
            },
        }
