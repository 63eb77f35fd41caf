"""The corpus of a grid: the package's Bible corpus, built once per settings."""
import json
import logging
import os
import sys
from typing import Dict, Optional, Sequence, Tuple

from mlmha_fairseq.corpus.builder import MANIFEST
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments.grid import RunFailed, run_command

logger = logging.getLogger("mlmha_fairseq.experiment")
MAX_TOKENS_PER_VERSE = 50


def corpus_is_built(corpus_dir: str, sources: Sequence[str], target: str, train_verses: Optional[int],
                    bpe_merges: int) -> bool:
    """Whether ``corpus_dir`` holds a finished build with these settings: the builder writes
    its manifest last (atomically), so a manifest means every file is in place."""
    try:
        with open(os.path.join(corpus_dir, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return False
    return (manifest.get("sources") == list(sources) and manifest.get("target") == target
            and manifest.get("train_selection", {}).get("max_train_verses") == train_verses
            and manifest.get("train_selection", {}).get("max_tokens_per_verse") == MAX_TOKENS_PER_VERSE
            and manifest.get("bpe", {}).get("merges_requested") == bpe_merges)


def build_corpus(sources: Sequence[str], target: str, corpus_dir: str, train_verses: Optional[int],
                 bpe_merges: int, work_dir: str) -> None:
    """The verse-aligned Bible corpus with ``mlmha_fairseq.cli.build_corpus``, unless an
    earlier run already built it with the same settings (a rerun resumes the grid, it does
    not rebuild the data its finished runs were trained on)."""
    if corpus_is_built(corpus_dir, sources, target, train_verses, bpe_merges):
        logger.info("  corpus %s: built earlier with these settings, kept", corpus_dir)
        return
    options = ["--sources", *sources, "--target", target, "--out-dir", corpus_dir,
               "--max-tokens-per-verse", str(MAX_TOKENS_PER_VERSE), "--bpe-merges", str(bpe_merges)]
    if train_verses:
        options += ["--max-train-verses", str(train_verses)]
    try:
        run_command([sys.executable, "-m", "mlmha_fairseq.cli.build_corpus", *options],
                    os.path.join(work_dir, "logs", f"corpus-{'-'.join(sources)}.log"), work_dir)
    except RunFailed as failure:
        sys.exit(str(failure))



def prepare_corpus(corpus: Dict, work_dir: str) -> Tuple[str, str]:
    """The corpus folder (built unless it exists) and its target language."""
    target = corpus.get("target", "en")
    directory = corpus.get("dir") or os.path.join(work_dir, "corpus-" + "-".join(corpus["sources"]))
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        if not corpus.get("sources"):
            raise UsageError(f"[corpus] dir {directory} has no {MANIFEST}: build it with "
                             "python -m mlmha_fairseq.cli.build_corpus, or give sources to build it here")
        build_corpus(corpus["sources"], target, directory, corpus.get("train_verses"),
                     int(corpus.get("bpe_merges", 4000)), work_dir)
    return directory, target
