"""Moses tokenization (sacremoses), joint BPE (subword-nmt) and ``fairseq-preprocess``.

Tokenization: punctuation normalized with ``MosesPunctNormalizer(lang)``, then
``MosesTokenizer(lang).tokenize(escape=False, aggressive_dash_splits=False)``, the tokenizer
of fairseq's ``--tokenizer moses --moses-no-escape --moses-no-dash-splits``, whose decode (the
Moses detokenizer) turns model output back into text comparable with the raw references.
"""
import contextlib
import io
import logging
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Sequence

import sacremoses
from sacremoses import MosesPunctNormalizer, MosesTokenizer
from subword_nmt.apply_bpe import BPE
from subword_nmt.learn_bpe import learn_bpe

from mlmha_fairseq.child_processes import end_with_parent
from mlmha_fairseq.corpus.errors import CorpusError
from mlmha_fairseq.corpus.splits import TRAIN
from mlmha_fairseq.output_files import atomic_output

logger = logging.getLogger(__name__)

ESCAPE = False
AGGRESSIVE_DASH_SPLITS = False
BPE_SEPARATOR = "@@"
BPE_MIN_FREQUENCY = 2
JOINT_DICT = "dict.txt"
PREPROCESS_MODULE = "fairseq_cli.preprocess"
ERROR_TAIL_LINES = 20


def tokenizer_settings() -> Dict[str, object]:
    """The tokenizer configuration, for the manifest."""
    return {
        "library": f"sacremoses {sacremoses.__version__}",
        "punct_normalizer": "MosesPunctNormalizer(lang)",
        "escape": ESCAPE,
        "aggressive_dash_splits": AGGRESSIVE_DASH_SPLITS,
        "fairseq_tokenizer": "--tokenizer moses --moses-no-escape --moses-no-dash-splits",
    }


class MosesTokenization:
    """Punctuation normalization then Moses tokenization of one language's lines."""

    def __init__(self, language: str):
        self.normalizer = MosesPunctNormalizer(lang=language)
        self.tokenizer = MosesTokenizer(lang=language)

    def __call__(self, line: str) -> str:
        """The tokenized line, tokens separated by single spaces."""
        return self.tokenizer.tokenize(self.normalizer.normalize(line), escape=ESCAPE,
                                       aggressive_dash_splits=AGGRESSIVE_DASH_SPLITS,
                                       return_str=True)


def tokenize(lines: Sequence[str], language: str) -> List[str]:
    """Normalize punctuation and Moses-tokenize ``lines`` of ``language``."""
    tokenization = MosesTokenization(language)
    return [tokenization(line) for line in lines]


def learn_joint_bpe(corpora: Sequence[Sequence[str]], merges: int, codes_path: str,
                    progress: bool) -> None:
    """Learn ``merges`` BPE merge operations on the concatenation of tokenized ``corpora``.

    subword-nmt shows a progress bar on stderr; ``progress=False`` hides it.
    """
    joint = io.StringIO("".join(line + "\n" for corpus in corpora for line in corpus))
    stderr = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with atomic_output(codes_path) as temporary, open(temporary, "w", encoding="utf-8") as codes, stderr:
        learn_bpe(joint, codes, merges, min_frequency=BPE_MIN_FREQUENCY)


def load_bpe(codes_path: str) -> BPE:
    """The subword-nmt segmenter for the codes in ``codes_path``."""
    with open(codes_path, encoding="utf-8") as codes:
        return BPE(codes, separator=BPE_SEPARATOR)


def apply_bpe(lines: Sequence[str], bpe: BPE) -> List[str]:
    """Segment tokenized ``lines`` with ``bpe`` (see :func:`load_bpe`)."""
    return [bpe.segment(line) for line in lines]


def _run_preprocess(arguments: Sequence[str], dest_dir: str) -> None:
    """Run ``fairseq-preprocess`` (its Python entry point in this interpreter)."""
    command = [sys.executable, "-m", PREPROCESS_MODULE, "--destdir", dest_dir, *arguments]
    logger.info("  fairseq-preprocess %s", " ".join(command[3:]))
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=end_with_parent)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).splitlines()[-ERROR_TAIL_LINES:])
        raise CorpusError(f"fairseq-preprocess failed (exit {result.returncode}):\n{tail}")


def _split_prefixes(text_dir: str, splits: Sequence[str]) -> List[str]:
    """``--trainpref/--validpref/--testpref`` arguments for the text files of ``splits``."""
    return [arg for split in splits
            for arg in (f"--{split}pref", os.path.join(text_dir, split))]


def build_joint_dictionary(train_files: Sequence[str], dict_path: str, workers: int) -> None:
    """Build one fairseq dictionary over several files and save it.

    It is what ``fairseq-preprocess --joined-dictionary`` builds for two files (the same task
    method and default thresholds), for any number of files.
    """
    from fairseq.tasks.translation import TranslationTask  # heavy import, only when binarizing

    TranslationTask.build_dictionary(list(train_files), workers=workers).save(dict_path)


def binarize(text_dir: str, dest_dir: str, sources: Sequence[str], target: str,
             splits: Sequence[str], workers: int) -> List[str]:
    """Binarize ``text_dir/{split}.{side}`` into ``dest_dir`` with one joint dictionary.

    A single pair uses ``--joined-dictionary``. Several sources first get one dictionary from
    the training text of every side (:func:`build_joint_dictionary`), then each
    ``(source, target)`` pair is binarized with ``--srcdict``/``--tgtdict`` set to it. Either
    way ``dest_dir/dict.txt`` is the joint dictionary (``dict.{side}.txt`` are copies of it).
    Returns the pairs' names.
    """
    if os.path.isdir(dest_dir):
        shutil.rmtree(dest_dir)  # fairseq-preprocess refuses to overwrite a dictionary
    os.makedirs(dest_dir)
    common = [*_split_prefixes(text_dir, splits), "--workers", str(workers)]
    joint_dict = os.path.join(dest_dir, JOINT_DICT)
    if len(sources) == 1:
        _run_preprocess(["--source-lang", sources[0], "--target-lang", target,
                         "--joined-dictionary", *common], dest_dir)
        shutil.copyfile(os.path.join(dest_dir, f"dict.{target}.txt"), joint_dict)
    else:
        build_joint_dictionary([os.path.join(text_dir, f"{TRAIN}.{side}")
                                for side in (*sources, target)], joint_dict, workers)
        for source in sources:
            _run_preprocess(["--source-lang", source, "--target-lang", target,
                             "--srcdict", joint_dict, "--tgtdict", joint_dict, *common], dest_dir)
    return [f"{source}-{target}" for source in sources]
