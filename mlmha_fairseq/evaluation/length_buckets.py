"""BLEU by source-length bucket.

As in Ampomah et al. 2020 and the thesis (En-De: source subword counts,
half-open buckets ``[0,10), [10,20), ..., [50,inf)``; En-Vi: whitespace tokens of the
pre-tokenized source, inclusive groups 1-10, 11-20, ..., >40), and Cui et al. 2019
(right-closed groups ``(0,10], ..., (50,inf)`` on source words before BPE).
EOS is never counted.

Written here rather than with compare-mt's ``LengthSentenceBucketer`` because that one
buckets by *reference* length (``len(ref)``) and the documents bucket by source length.
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.evaluation.generate_output import remove_bpe
from mlmha_fairseq.evaluation.scoring import Protocol, corpus_score
from mlmha_fairseq.evaluation.text_io import InputError, check_same_length

UNITS = ("subword", "word")
CLOSED_SIDES = ("left", "right")
DEFAULT_EDGES = (10, 20, 30, 40, 50)
SUBWORD_NMT_SYMBOL = "@@ "


@dataclass(frozen=True)
class Bucket:
    """A length interval; ``high`` is ``None`` for the open last bucket.

    ``closed="left"``: ``[low, high)``; ``closed="right"``: ``(low, high]``, except that the
    first right-closed bucket also holds length ``low`` (0) so that every sentence has a bucket.
    """

    low: int
    high: Optional[int]
    closed: str

    @property
    def label(self) -> str:
        upper = "inf)" if self.high is None else (f"{self.high})" if self.closed == "left"
                                                  else f"{self.high}]")
        first_right = self.closed == "right" and self.low == 0
        lower = "[" if self.closed == "left" or first_right else "("
        return f"{lower}{self.low},{upper}"

    def contains(self, length: int) -> bool:
        if self.closed == "left":
            return length >= self.low and (self.high is None or length < self.high)
        above = length >= self.low if self.low == 0 else length > self.low
        return above and (self.high is None or length <= self.high)


def make_buckets(edges: Sequence[int], closed: str = "left") -> List[Bucket]:
    """Buckets from 0 to infinity split at the strictly increasing positive ``edges``."""
    if closed not in CLOSED_SIDES:
        raise InputError(f"closed must be one of {CLOSED_SIDES}")
    if not edges or any(e <= 0 for e in edges) or list(edges) != sorted(set(edges)):
        raise InputError(f"bucket edges must be strictly increasing positive integers: {list(edges)}")
    bounds = [0] + list(edges)
    highs: List[Optional[int]] = list(edges) + [None]
    return [Bucket(low, high, closed) for low, high in zip(bounds, highs)]


def source_lengths(sources: Sequence[str], unit: str,
                   bpe_symbol: str = SUBWORD_NMT_SYMBOL) -> List[int]:
    """Whitespace tokens per source line: as given for ``subword`` (a BPE-segmented source),
    after undoing the BPE marked by ``bpe_symbol`` for ``word``."""
    if unit not in UNITS:
        raise InputError(f"unit must be one of {UNITS}")
    lines = remove_bpe(list(sources), bpe_symbol) if unit == "word" else sources
    return [len(line.split()) for line in lines]


def assign_buckets(lengths: Sequence[int], buckets: Sequence[Bucket]) -> List[int]:
    """Index of the bucket of each length."""
    return [next(i for i, b in enumerate(buckets) if b.contains(n)) for n in lengths]


def bleu_by_length(lengths: Sequence[int], references: Sequence[Sequence[str]],
                   systems: Sequence[Tuple[str, Sequence[str]]], protocol: Protocol,
                   buckets: Sequence[Bucket]) -> List[Dict]:
    """One row per bucket: label, sentence count and each system's corpus score on the
    bucket's sentences (NaN for an empty bucket)."""
    check_same_length([("sources", lengths)] + [(n, h) for n, h in systems]
                      + [(f"references #{i + 1}", r) for i, r in enumerate(references)])
    membership = assign_buckets(lengths, buckets)
    rows = []
    for index, bucket in enumerate(buckets):
        chosen = [i for i, b in enumerate(membership) if b == index]
        row = {"bucket": bucket.label, "count": len(chosen)}
        for name, hyps in systems:
            if not chosen:
                row[name] = math.nan
                continue
            subset_refs = [[refs[i] for i in chosen] for refs in references]
            row[name] = corpus_score([hyps[i] for i in chosen], subset_refs, protocol).score
        rows.append(row)
    return rows
