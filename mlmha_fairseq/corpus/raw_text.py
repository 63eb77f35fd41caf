"""A corpus from a researcher's own raw parallel text, in the layout of the Bible corpus.

Input: ``{split}.{side}`` files (splits ``train``, ``valid``, ``test``; sides: one or more source
languages and the target), one sentence per line, aligned by line. Output (``out_dir``), as
:mod:`mlmha_fairseq.corpus.builder` writes it, so that every tool that reads a Bible corpus
reads this one: ``text/{split}.raw.{side}`` (the input, copied), ``text/{split}.tok.{side}``
(Moses-tokenized), ``text/{split}.{side}`` (joint BPE), ``bpe.codes``, ``data-bin/``
(``fairseq-preprocess``, one joint dictionary) and ``manifest.json``, written last: a folder
with a manifest whose input fingerprints and settings match is complete and is not rebuilt.
"""
import importlib.metadata
import json
import logging
import os
from typing import Dict, List, Sequence

from mlmha_fairseq.corpus import preprocess
from mlmha_fairseq.corpus.builder import BPE_CODES, DATA_BIN, MANIFEST, TEXT_DIR
from mlmha_fairseq.corpus.fetch import sha256_of
from mlmha_fairseq.corpus.splits import SPLITS
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.text_io import InputError, count_lines, read_lines, write_text
from mlmha_fairseq.output_files import atomic_output

logger = logging.getLogger(__name__)


def check_parallel_text(raw_dir: str, sources: Sequence[str], target: str) -> Dict[str, int]:
    """The number of lines of each split, the files read as streams; one line naming the file
    for a missing split or side, a file that is not UTF-8, or files of one split whose line
    counts differ."""
    if not os.path.isdir(raw_dir):
        raise UsageError(f"[corpus] raw {raw_dir} is not a folder")
    sides = (*sources, target)
    sizes = {}
    for split in SPLITS:
        counts = {}
        for side in sides:
            path = os.path.join(raw_dir, f"{split}.{side}")
            if not os.path.isfile(path):
                raise UsageError(f"[corpus] raw: {path} is missing (expected {split}.<side> for the sides "
                                 f"{', '.join(sides)} and the splits {', '.join(SPLITS)})")
            try:
                counts[side] = count_lines(path)
            except InputError as error:  # not UTF-8, or empty: said as the config's corpus
                raise UsageError(f"[corpus] raw: {error}") from None
        for side, count in counts.items():
            if count != counts[sides[0]]:
                raise UsageError(f"[corpus] raw: {os.path.join(raw_dir, f'{split}.{side}')} has {count} lines, "
                                 f"{os.path.join(raw_dir, f'{split}.{sides[0]}')} {counts[sides[0]]}: the files "
                                 "of a split must be aligned line by line")
        sizes[split] = counts[sides[0]]
    return sizes


def read_parallel_text(raw_dir: str, sources: Sequence[str], target: str) -> Dict[str, Dict[str, List[str]]]:
    """``{split: {side: lines}}``, after :func:`check_parallel_text`."""
    check_parallel_text(raw_dir, sources, target)
    return {split: {side: read_lines(os.path.join(raw_dir, f"{split}.{side}")) for side in (*sources, target)}
            for split in SPLITS}


def manifest_differences(manifest: Dict, wanted: Dict) -> List[str]:
    """What differs between a corpus folder's manifest and the build asked for, in words
    (``raw.dir``, ``test.en changed``, ``bpe.merges_requested``): dotted keys of ``wanted``,
    and each raw file by its name."""
    differences = []
    for key, value in wanted.items():
        held = manifest
        for part in key.split("."):
            held = held.get(part) if isinstance(held, dict) else None
        if key == "raw.sha256" and not isinstance(held, dict):
            differences.append("not built from raw text")
        elif key == "raw.sha256":
            differences += [f"{name} {'changed' if name in held else 'added'}" for name in sorted(value)
                            if held.get(name) != value[name]]
            differences += [f"{name} removed" for name in sorted(set(held) - set(value))]
        elif held != value:
            differences.append(f"{key} {held!r} instead of {value!r}")
    return differences


def check_rebuild(out_dir: str, differences: List[str], rebuild: bool) -> None:
    """Refuse to build a corpus in ``out_dir`` over one built from other input or settings,
    unless asked to: the runs trained on it would be reported beside runs of the new one."""
    if differences and not rebuild:
        raise UsageError(f"corpus folder {out_dir} holds a corpus built from other input or settings "
                         f"({'; '.join(differences[:4])}): building there would replace the data its runs were "
                         "trained on; give another [corpus] dir, or --rebuild-corpus to replace it")


def build_raw_text_corpus(raw_dir: str, sources: Sequence[str], target: str, out_dir: str, bpe_merges: int,
                          workers: int = 1, rebuild: bool = False) -> Dict:
    """Tokenize, learn and apply joint BPE, binarize; return the manifest (kept, with nothing
    rebuilt, when an earlier build of the same input with the same settings finished). A
    folder that holds another corpus is refused unless ``rebuild`` (:func:`check_rebuild`)."""
    sides = (*sources, target)
    inputs = {f"{split}.{side}": sha256_of(os.path.join(raw_dir, f"{split}.{side}"))
              for split in SPLITS for side in sides if os.path.isfile(os.path.join(raw_dir, f"{split}.{side}"))}
    settings = {"raw": {"dir": os.path.abspath(raw_dir), "sha256": inputs}, "sources": list(sources),
                "target": target}
    manifest_path = os.path.join(out_dir, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict):
        differences = manifest_differences(manifest, {"raw.dir": settings["raw"]["dir"], "raw.sha256": inputs,
                                                      "sources": list(sources), "target": target,
                                                      "bpe.merges_requested": bpe_merges})
        if not differences:
            logger.info("  corpus %s: built earlier from the same text with these settings, kept", out_dir)
            return manifest
        check_rebuild(out_dir, differences, rebuild)
    text = read_parallel_text(raw_dir, sources, target)  # every check before anything is written
    text_dir = os.path.join(out_dir, TEXT_DIR)
    os.makedirs(text_dir, exist_ok=True)
    logger.info("  corpus %s: tokenizing (sacremoses), learning %d joint BPE merges (subword-nmt), binarizing",
                out_dir, bpe_merges)
    tokens = {split: {side: preprocess.tokenize(lines, side.split("_")[0]) for side, lines in by_side.items()}
              for split, by_side in text.items()}
    codes = os.path.join(out_dir, BPE_CODES)
    preprocess.learn_joint_bpe([tokens["train"][side] for side in sides], bpe_merges, codes, progress=False)
    bpe = preprocess.load_bpe(codes)
    for split in SPLITS:
        for side in sides:
            for name, lines in ((f"{split}.raw.{side}", text[split][side]), (f"{split}.tok.{side}", tokens[split][side]),
                                (f"{split}.{side}", preprocess.apply_bpe(tokens[split][side], bpe))):
                write_text(os.path.join(text_dir, name), "".join(line + "\n" for line in lines))
    pairs = preprocess.binarize(text_dir, os.path.join(out_dir, DATA_BIN), list(sources), target, SPLITS, workers)
    manifest = {**settings, "sizes": {split: len(text[split][target]) for split in SPLITS},
                "tokenizer": preprocess.tokenizer_settings(),
                "bpe": {"merges_requested": bpe_merges, "library": f"subword-nmt {importlib.metadata.version('subword-nmt')}",
                        "codes": BPE_CODES, "separator": preprocess.BPE_SEPARATOR, "joint_over": list(sides)},
                "data_bin": {"dir": DATA_BIN, "pairs": pairs, "dictionary": preprocess.JOINT_DICT}}
    with atomic_output(manifest_path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False)
    return manifest
