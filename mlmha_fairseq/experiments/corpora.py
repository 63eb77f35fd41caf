"""The corpus of a grid, checked before anything trains: the package's Bible corpus (built once
per settings), a folder of raw parallel text (tokenized, BPE-segmented and binarized once), or
an existing fairseq data-bin with its raw test references."""
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.corpus.builder import DATA_BIN, MANIFEST, TEXT_DIR
from mlmha_fairseq.corpus.raw_text import check_rebuild, manifest_differences
from mlmha_fairseq.corpus.splits import SPLITS
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.text_io import read_lines
from mlmha_fairseq.experiments.grid import RunFailed, run_command

logger = logging.getLogger("mlmha_fairseq.experiment")

MAX_TOKENS_PER_VERSE = 50
# how fairseq-generate turns subwords back into words ([corpus] postprocess)
POSTPROCESS = {"subword_nmt": ["--remove-bpe"], "sentencepiece": ["--remove-bpe", "sentencepiece"], "none": []}
DICTIONARY_CHECKED_SENTENCES = 10000  # of the training split (all of valid and test)


@dataclass(frozen=True)
class Corpus:
    """What the runs of a grid read: the binarized data, the raw test references, and how a
    hypothesis becomes text comparable with them."""

    data_bin: str
    target: str
    references: str  # raw test references, one line per test sentence
    fairseq_args: Tuple[str, ...] = ()  # added to fairseq-train and fairseq-generate
    postprocess: Tuple[str, ...] = tuple(POSTPROCESS["subword_nmt"])
    detokenize: bool = True  # the Moses detokenizer of the target language


def built_differences(corpus_dir: str, sources: Sequence[str], target: str, train_verses: Optional[int],
                      bpe_merges: int) -> Optional[List[str]]:
    """None where ``corpus_dir`` holds no finished build (the builder writes its manifest last,
    atomically, so a manifest means every file is in place); else how that build differs from
    these settings (empty: the same)."""
    try:
        with open(os.path.join(corpus_dir, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return None
    return manifest_differences(manifest, {
        "sources": list(sources), "target": target, "train_selection.max_train_verses": train_verses,
        "train_selection.max_tokens_per_verse": MAX_TOKENS_PER_VERSE, "bpe.merges_requested": bpe_merges})


def build_corpus(sources: Sequence[str], target: str, corpus_dir: str, train_verses: Optional[int],
                 bpe_merges: int, work_dir: str, rebuild: bool = False) -> None:
    """The verse-aligned Bible corpus with ``mlmha_fairseq.cli.build_corpus``, unless an
    earlier run already built it with the same settings (a rerun resumes the grid, it does
    not rebuild the data its finished runs were trained on); a folder holding a corpus built
    with other settings is refused unless ``rebuild``."""
    differences = built_differences(corpus_dir, sources, target, train_verses, bpe_merges)
    if differences == []:
        logger.info("  corpus %s: built earlier with these settings, kept", corpus_dir)
        return
    check_rebuild(corpus_dir, differences or [], rebuild)
    options = ["--sources", *sources, "--target", target, "--out-dir", corpus_dir,
               "--max-tokens-per-verse", str(MAX_TOKENS_PER_VERSE), "--bpe-merges", str(bpe_merges)]
    if train_verses:
        options += ["--max-train-verses", str(train_verses)]
    try:
        run_command([sys.executable, "-m", "mlmha_fairseq.cli.build_corpus", *options],
                    os.path.join(work_dir, "logs", f"corpus-{'-'.join(sources)}.log"), work_dir)
    except RunFailed as failure:
        sys.exit(str(failure))


def built_corpus(directory: str, target: str) -> Corpus:
    """A folder in the Bible corpus's layout (the builder's or :mod:`~mlmha_fairseq.corpus.raw_text`'s)."""
    return Corpus(os.path.join(directory, DATA_BIN), target, os.path.join(directory, TEXT_DIR, f"test.raw.{target}"))


def _pair_prefix(data_bin: str, split: str, source: str, target: str, side: str) -> str:
    """fairseq's file prefix of one side of a split (either direction of the pair's name)."""
    for pair in (f"{source}-{target}", f"{target}-{source}"):
        prefix = os.path.join(data_bin, f"{split}.{pair}.{side}")
        if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"):
            return prefix
    raise UsageError(f"[corpus] data_bin {data_bin} has no {split} data for {source}-{target} ({side} side: "
                     f"{os.path.join(data_bin, f'{split}.{source}-{target}.{side}')}.bin/.idx missing)")


def check_data_bin(data_bin: str, sources: Sequence[str], target: str, references: str) -> None:
    """Every split of every pair present, token ids within their dictionary, and as many
    references as test sentences; one line naming the file otherwise."""
    from fairseq.data import Dictionary, indexed_dataset

    if not os.path.isdir(data_bin):
        raise UsageError(f"[corpus] data_bin {data_bin} is not a folder")
    dictionaries = {}
    for side in (*sources, target):
        path = os.path.join(data_bin, f"dict.{side}.txt")
        if not os.path.isfile(path):
            raise UsageError(f"[corpus] data_bin: {path} is missing (is {side!r} a language of this data-bin?)")
        dictionaries[side] = (path, Dictionary.load(path))
    test_sizes = set()
    for source in sources:
        for split in SPLITS:
            for side in (source, target):
                prefix = _pair_prefix(data_bin, split, source, target, side)
                # (fairseq's load_indexed_dataset would log a line per file)
                dataset = indexed_dataset.make_dataset(prefix, indexed_dataset.infer_dataset_impl(prefix),
                                                       dictionary=dictionaries[side][1])
                checked = len(dataset) if split != "train" else min(len(dataset), DICTIONARY_CHECKED_SENTENCES)
                largest = max((int(dataset[i].max()) for i in range(checked)), default=-1)
                dict_path, dictionary = dictionaries[side]
                if largest >= len(dictionary):
                    raise UsageError(f"[corpus] data_bin: {prefix}.bin holds token id {largest}, but {dict_path} has "
                                     f"{len(dictionary)} entries: the dictionary is not the one the data was "
                                     "binarized with")
                if split == "test":
                    test_sizes.add(len(dataset))
    if len(test_sizes) != 1:
        raise UsageError(f"[corpus] data_bin {data_bin}: the test files of its pairs differ in length {sorted(test_sizes)}")
    count, size = len(read_lines(references)), test_sizes.pop()
    if count != size:
        raise UsageError(f"[corpus] test_references {references} has {count} lines, the test set of {data_bin} "
                         f"{size} sentences")


def check_corpus(corpus: Dict) -> None:
    """Refuse a raw-text or data-bin corpus that cannot be used, before anything is written."""
    from mlmha_fairseq.corpus.raw_text import check_parallel_text

    target = corpus.get("target", "en")
    if "data_bin" in corpus:
        if not corpus.get("sources") or "test_references" not in corpus:
            raise UsageError("[corpus] data_bin needs sources = [the source language(s)], target and "
                             "test_references (the raw test references)")
        check_data_bin(corpus["data_bin"], corpus["sources"], target, corpus["test_references"])
    elif "raw" in corpus:
        if not corpus.get("sources"):
            raise UsageError("[corpus] raw needs sources = [the source language(s)] and target")
        check_parallel_text(corpus["raw"], corpus["sources"], target)


def prepare_corpus(corpus: Dict, work_dir: str, rebuild: bool = False) -> Corpus:
    """The grid's corpus (:func:`check_corpus` first), built unless it exists; one built with
    other input or settings is replaced only with ``rebuild``."""
    from mlmha_fairseq.corpus.raw_text import build_raw_text_corpus

    target = corpus.get("target", "en")
    if "data_bin" in corpus:
        sources = corpus["sources"]
        # one pair: name it, as a data-bin may hold several; several: the multi-source task names them
        pair = ("--source-lang", sources[0], "--target-lang", target) if len(sources) == 1 else ()
        return Corpus(corpus["data_bin"], target, corpus["test_references"], fairseq_args=pair,
                      postprocess=tuple(POSTPROCESS[corpus.get("postprocess", "subword_nmt")]),
                      detokenize=corpus.get("detokenize", True))
    if "raw" in corpus:
        directory = corpus.get("dir") or os.path.join(
            work_dir, "corpus-" + "-".join([*corpus["sources"], target]))
        build_raw_text_corpus(corpus["raw"], corpus["sources"], target, directory, int(corpus.get("bpe_merges", 4000)),
                              rebuild=rebuild)
        return built_corpus(directory, target)
    directory = corpus.get("dir") or os.path.join(work_dir, "corpus-" + "-".join(corpus["sources"]))
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        if not corpus.get("sources"):
            raise UsageError(f"[corpus] dir {directory} has no {MANIFEST}: build it with "
                             "python -m mlmha_fairseq.cli.build_corpus, give sources to build it here, "
                             "or give a fairseq data-bin as data_bin or raw parallel text as raw")
        build_corpus(corpus["sources"], target, directory, corpus.get("train_verses"),
                     int(corpus.get("bpe_merges", 4000)), work_dir, rebuild)
    return built_corpus(directory, target)
