"""The whole corpus build: database -> aligned, cleaned splits -> tokens -> BPE -> data-bin.

Output layout under ``out_dir`` (``{side}`` is a language code such as ``fr``, or
``{language}_{version}`` such as ``en_k`` when two selected versions share a language)::

    manifest.json                what was built, from what, with which settings
    bpe.codes                    joint BPE codes (subword-nmt), learned on all training sides
    text/{split}.{side}          BPE-segmented text: the input of fairseq-preprocess
    text/{split}.tok.{side}      Moses-tokenized text (before BPE)
    text/{split}.raw.{side}      cleaned, untokenized text: the references for sacreBLEU
    text/{split}.ids             "book chapter verse" of each line
    data-bin/                    fairseq binaries, one joint dictionary dict.txt
        dict.txt, dict.{side}.txt
        {split}.{source}-{target}.{source|target}.{bin,idx}   one pair per source
"""
import contextlib
import importlib.metadata
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.corpus import preprocess
from mlmha_fairseq.corpus.bible import Verse, load_aligned
from mlmha_fairseq.corpus.cleaning import clean_verses
from mlmha_fairseq.corpus.errors import CorpusError
from mlmha_fairseq.corpus.fetch import DB_MEMBER, REQUIREMENT, locate_bible_db, sha256_of
from mlmha_fairseq.corpus.splits import (
    DEFAULT_TEST_BOOKS, DEFAULT_VALID_BOOKS, SPLITS, TEST, TRAIN, VALID, resolve_books,
    select_training, split_by_book,
)
from mlmha_fairseq.corpus.versions import Version, book_name, resolve_version
from mlmha_fairseq.output_files import atomic_output

logger = logging.getLogger(__name__)

DEFAULT_BPE_MERGES = 8000
DEFAULT_SEED = 1
DEFAULT_WORKERS = 1
MANIFEST = "manifest.json"
BPE_CODES = "bpe.codes"
TEXT_DIR = "text"
DATA_BIN = "data-bin"
MISSING = "missing"
TOO_LONG = "too_long"
SUBSAMPLED_OUT = "subsampled_out"
PROGRESS_EVERY = 5000


@dataclass
class BuildConfig:
    """Everything a build depends on (the CLI's options)."""

    sources: Sequence[str]
    target: str
    out_dir: str
    bible_db: Optional[str] = None
    cache_dir: Optional[str] = None
    test_books: Sequence[str] = DEFAULT_TEST_BOOKS
    valid_books: Sequence[str] = DEFAULT_VALID_BOOKS
    max_train_verses: Optional[int] = None
    max_tokens_per_verse: Optional[int] = None
    bpe_merges: int = DEFAULT_BPE_MERGES
    seed: int = DEFAULT_SEED
    workers: int = DEFAULT_WORKERS


def side_names(versions: Sequence[Version]) -> List[str]:
    """File suffix of each version: its language, or ``{language}_{code}`` if it repeats."""
    languages = [v.language for v in versions]
    return [v.language if languages.count(v.language) == 1 else f"{v.language}_{v.code}"
            for v in versions]


def _resolve_versions(config: BuildConfig) -> List[Version]:
    """The selected versions, sources first and target last; each may be used once."""
    versions = [resolve_version(spec) for spec in (*config.sources, config.target)]
    codes = [v.code for v in versions]
    repeated = sorted({c for c in codes if codes.count(c) > 1})
    if repeated:
        raise CorpusError(f"version(s) {', '.join(repeated)} selected twice: every source and "
                          "the target must be different versions")
    return versions


@contextlib.contextmanager
def _timed(timings: Dict[str, float], step: str):
    """Log a step's start and end, and record its duration (seconds) in ``timings``."""
    logger.info("%s ...", step)
    start = time.perf_counter()
    yield
    timings[step] = round(time.perf_counter() - start, 2)
    logger.info("%s done in %.1f s", step, timings[step])


def _write_lines(path: str, lines: Sequence[str]) -> None:
    """Write one line per item, UTF-8, ``\\n``-terminated."""
    with atomic_output(path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        handle.writelines(line + "\n" for line in lines)


def _tokenize_split(verses: Sequence[Verse], sides: Sequence[str],
                    versions: Sequence[Version]) -> Dict[str, List[str]]:
    """Moses-tokenize every side of ``verses``: side -> tokenized lines."""
    return {side: preprocess.tokenize([v.texts[i] for v in verses], version.language)
            for i, (side, version) in enumerate(zip(sides, versions))}


def _tokenize_training(verses: List[Verse], sides: Sequence[str], versions: Sequence[Version],
                       config: BuildConfig, dropped: Dict[str, int]):
    """Select (length filter, subsample) and tokenize the training tuples; see ``select_training``.

    Only the tuples ``select_training`` examines are tokenized, so a small ``--max-train-verses``
    is fast. Returns the kept verses and side -> tokenized lines.
    """
    tokenizations = [preprocess.MosesTokenization(v.language) for v in versions]
    tokenized: Dict[int, Tuple[str, ...]] = {}

    def fits(index: int) -> bool:
        tokenized[index] = tuple(tokenize(text) for tokenize, text
                                 in zip(tokenizations, verses[index].texts))
        if len(tokenized) % PROGRESS_EVERY == 0:
            logger.info("  tokenized %d of %d training tuples", len(tokenized), len(verses))
        limit = config.max_tokens_per_verse
        return limit is None or all(len(line.split()) <= limit for line in tokenized[index])

    kept, too_long = select_training(len(verses), fits, config.max_train_verses, config.seed)
    dropped[TOO_LONG] = too_long
    dropped[SUBSAMPLED_OUT] = len(verses) - len(kept) - too_long
    return ([verses[i] for i in kept],
            {side: [tokenized[i][k] for i in kept] for k, side in enumerate(sides)})


def _bpe_merges_learned(codes_path: str) -> int:
    """Number of merge operations in a subword-nmt codes file (its first line is a header)."""
    with open(codes_path, encoding="utf-8") as codes:
        return sum(1 for line in codes if not line.startswith("#version"))


def _dictionary_size(path: str) -> int:
    """Number of entries in a fairseq dictionary file (special symbols not included)."""
    with open(path, encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def _write_text_files(text_dir: str, splits: Dict[str, List[Verse]],
                      tokens: Dict[str, Dict[str, List[str]]], sides: Sequence[str]) -> None:
    """Write the verse ids, the raw (cleaned) and the tokenized text of every split and side."""
    for split, verses in splits.items():
        _write_lines(os.path.join(text_dir, f"{split}.ids"),
                     [" ".join(map(str, v.key)) for v in verses])
        for i, side in enumerate(sides):
            _write_lines(os.path.join(text_dir, f"{split}.raw.{side}"),
                         [v.texts[i] for v in verses])
            _write_lines(os.path.join(text_dir, f"{split}.tok.{side}"), tokens[split][side])


def _write_bpe_files(text_dir: str, tokens: Dict[str, Dict[str, List[str]]],
                     codes_path: str) -> None:
    """Segment the tokenized text of every split and side with the learned codes."""
    bpe = preprocess.load_bpe(codes_path)
    for split, by_side in tokens.items():
        for side, lines in by_side.items():
            _write_lines(os.path.join(text_dir, f"{split}.{side}"),
                         preprocess.apply_bpe(lines, bpe))


def _manifest(config: BuildConfig, versions: Sequence[Version], sides: Sequence[str],
              held_out: Dict[str, List[int]], sizes: Dict[str, int], dropped: Dict[str, int],
              db_sha256: str, pairs: Sequence[str]) -> Dict:
    """What was built, from what, with which settings (``timings_s`` is added by the caller)."""
    codes_path = os.path.join(config.out_dir, BPE_CODES)
    return {
        "corpus": {"package": REQUIREMENT, "file": DB_MEMBER, "sha256": db_sha256},
        "sources": list(sides[:-1]),
        "target": sides[-1],
        "versions": {side: v._asdict() for side, v in zip(sides, versions)},
        "books": {**{split: [{"number": b, "name": book_name(b)} for b in books]
                     for split, books in held_out.items()},
                  TRAIN: "every other book"},
        "sizes": sizes,
        "dropped": dict(sorted(dropped.items())),
        "train_selection": {"max_train_verses": config.max_train_verses,
                            "max_tokens_per_verse": config.max_tokens_per_verse,
                            "seed": config.seed},
        "tokenizer": preprocess.tokenizer_settings(),
        "bpe": {"library": f"subword-nmt {importlib.metadata.version('subword-nmt')}",
                "codes": BPE_CODES, "merges_requested": config.bpe_merges,
                "merges_learned": _bpe_merges_learned(codes_path),
                "min_frequency": preprocess.BPE_MIN_FREQUENCY,
                "separator": preprocess.BPE_SEPARATOR, "joint_over": list(sides)},
        "data_bin": {"dir": DATA_BIN, "pairs": list(pairs), "dictionary": preprocess.JOINT_DICT,
                     "dictionary_entries": _dictionary_size(
                         os.path.join(config.out_dir, DATA_BIN, preprocess.JOINT_DICT))},
        "text": {"bpe": f"{TEXT_DIR}/{{split}}.{{side}}",
                 "tokenized": f"{TEXT_DIR}/{{split}}.tok.{{side}}",
                 "raw": f"{TEXT_DIR}/{{split}}.raw.{{side}}",
                 "ids": f"{TEXT_DIR}/{{split}}.ids"},
    }


def build_corpus(config: BuildConfig) -> Dict:
    """Build the corpus described by ``config``; return the manifest (also written to disk)."""
    started = time.perf_counter()
    versions = _resolve_versions(config)
    sides = side_names(versions)
    held_out = resolve_books(config.test_books, config.valid_books)
    text_dir = os.path.join(config.out_dir, TEXT_DIR)
    os.makedirs(text_dir, exist_ok=True)
    timings: Dict[str, float] = {}

    with _timed(timings, "locate database"):
        db_path = locate_bible_db(config.bible_db, config.cache_dir)
        db_sha256 = sha256_of(db_path)
    with _timed(timings, "read, align, clean"):
        verses, missing = load_aligned(db_path, [v.code for v in versions])
        verses, dropped = clean_verses(verses, [v.language for v in versions])
        dropped[MISSING] = missing
        splits = split_by_book(verses, held_out)
    with _timed(timings, "tokenize"):
        splits[TRAIN], train_tokens = _tokenize_training(splits[TRAIN], sides, versions,
                                                         config, dropped)
        tokens = {TRAIN: train_tokens, **{split: _tokenize_split(splits[split], sides, versions)
                                          for split in (VALID, TEST)}}
    _write_text_files(text_dir, splits, tokens, sides)
    codes_path = os.path.join(config.out_dir, BPE_CODES)
    with _timed(timings, "learn BPE"):
        preprocess.learn_joint_bpe([tokens[TRAIN][side] for side in sides], config.bpe_merges,
                                   codes_path, progress=logger.isEnabledFor(logging.INFO))
    with _timed(timings, "apply BPE"):
        _write_bpe_files(text_dir, tokens, codes_path)
    with _timed(timings, "fairseq-preprocess"):
        pairs = preprocess.binarize(text_dir, os.path.join(config.out_dir, DATA_BIN),
                                    sides[:-1], sides[-1], SPLITS, config.workers)

    sizes = {split: len(splits[split]) for split in SPLITS}
    manifest = _manifest(config, versions, sides, held_out, sizes, dropped, db_sha256, pairs)
    manifest["timings_s"] = {**timings, "total": round(time.perf_counter() - started, 2)}
    manifest_path = os.path.join(config.out_dir, MANIFEST)
    with atomic_output(manifest_path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False)
    logger.info("wrote %s: %s", config.out_dir,
                ", ".join(f"{split} {n}" for split, n in sizes.items()))
    return manifest
