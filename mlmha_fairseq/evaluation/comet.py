"""COMET (Rei et al. 2020, 2022) through ``unbabel-comet``, from a local checkpoint only.

None of the documents reports COMET; 2026 papers report it beside BLEU, so the tools give it
when ``--comet-model DIR`` names a COMET model folder as the Hugging Face hub stores one
(``DIR/hparams.yaml`` and ``DIR/checkpoints/model.ckpt``, e.g. a snapshot of
``Unbabel/wmt22-comet-da``). Nothing is downloaded at run time: the checkpoint is read with
``local_files_only``, so the encoder its ``hparams.yaml`` names (``pretrained_model``, e.g.
``xlm-roberta-large``: its configuration and tokenizer, not its weights) must already be in
the Hugging Face cache or be a local folder. Without ``--comet-model`` COMET reads
:data:`NOT_GIVEN`, and the other scores are computed as usual.

The score is COMET's system score (the mean of its segment scores) x 100, on the scale of
the other columns, as this package reports METEOR.

``unbabel-comet`` caps numpy below 2 and protobuf below 5, which the pinned environment
exceeds, so it is not in ``requirements.txt``: ``requirements-comet.txt`` pins it with the
dependencies it runs with here, installed without its caps (``WITH_COMET=1
scripts/setup_venv.sh``; docs/evaluation.md, "COMET").
"""
import functools
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.text_io import check_same_length

NOT_GIVEN = "n/a (give --comet-model DIR)"
HPARAMS = "hparams.yaml"
CHECKPOINT = os.path.join("checkpoints", "model.ckpt")
BATCH_SIZE = 16
# pytorch-lightning's INFO lines (the devices it found, adverts) for every prediction
LIGHTNING_LOGGERS = ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric")


def checkpoint_path(directory: str) -> str:
    """``directory``'s COMET checkpoint; a one-line :class:`UsageError` naming the folder when
    it is not a COMET model folder."""
    path = os.path.join(directory, CHECKPOINT)
    if not (os.path.isfile(os.path.join(directory, HPARAMS)) and os.path.isfile(path)):
        raise UsageError(f"--comet-model {directory} is not a COMET model folder: it needs {HPARAMS} and "
                         f"{CHECKPOINT} (e.g. a local snapshot of Unbabel/wmt22-comet-da)")
    return path


@dataclass
class CometScore:
    """COMET's system score x 100 and its segment scores (COMET's scale)."""

    score: float
    segments: List[float]


class Comet:
    """A COMET model loaded once from a local folder, scoring any number of systems."""

    def __init__(self, directory: str, batch_size: int = BATCH_SIZE):
        checkpoint = checkpoint_path(directory)
        try:
            from comet import load_from_checkpoint
        except ImportError:
            raise UsageError(f"--comet-model {directory}: unbabel-comet is not installed; install it with "
                             "WITH_COMET=1 scripts/setup_venv.sh (requirements-comet.txt)") from None
        for name in LIGHTNING_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            self.model = load_from_checkpoint(checkpoint, local_files_only=True)
        except Exception as error:  # torch, Lightning, transformers and COMET each raise their own kinds
            reason = " ".join(str(error).split())[:300] or type(error).__name__
            raise UsageError(f"--comet-model {directory} could not be loaded without downloading anything "
                             f"({reason}); the encoder it names (pretrained_model in {HPARAMS}, e.g. "
                             "xlm-roberta-large) must be a local folder or in the Hugging Face cache") from None
        self.directory, self.batch_size = directory, batch_size

    def score(self, sources: Sequence[str], hypotheses: Sequence[str], references: Sequence[str]) -> CometScore:
        check_same_length([("sources", sources), ("hypotheses", hypotheses), ("references", references)])
        import torch

        samples = [{"src": src, "mt": mt, "ref": ref} for src, mt, ref in zip(sources, hypotheses, references)]
        with warnings.catch_warnings():
            # Lightning's advice to start Slurm jobs with srun (a prediction in this process is no
            # job) and its own internal deprecation, once per call
            warnings.filterwarnings("ignore", message="The `srun` command is available")
            warnings.filterwarnings("ignore", message=".*treespec.*deprecated")
            prediction = self.model.predict(samples, batch_size=self.batch_size,
                                            gpus=1 if torch.cuda.is_available() else 0, progress_bar=False)
        return CometScore(100.0 * prediction.system_score, list(prediction.scores))


HUB_FOLDER = re.compile(r"^models--([^/]+?)--([^/]+)$")  # the Hugging Face cache's name of a model repository


def comet_model_name(directory: str) -> str:
    """The model a COMET folder holds, as papers should name it (Zouhar et al. 2024, "Pitfalls
    and Outlooks in Using COMET"): ``Unbabel/wmt22-comet-da`` for a snapshot in the Hugging Face
    cache (``.../models--Unbabel--wmt22-comet-da/snapshots/<hash>``), else the folder's name."""
    parts = os.path.normpath(os.path.abspath(directory)).split(os.sep)
    for part in reversed(parts):
        match = HUB_FOLDER.match(part)
        if match:
            return f"{match.group(1)}/{match.group(2)}"
    return parts[-1]


def comet_signature(directory: str, precision: str = "fp32", references: int = 1) -> str:
    """SacreCOMET's signature of a COMET score (Zouhar et al. 2024):
    ``Python<version>|Comet<version>|<precision>|<model>|r<references>``, e.g.
    ``Python3.11.9|Comet2.2.7|fp32|Unbabel/wmt22-comet-da|r1``. Written here in the format its
    ``sacrecomet`` command prints rather than through the package (sacrecomet 1.0.1 on PyPI): that
    is an interactive command (it asks for what is not on its command line with ``input()``),
    exits the process when unbabel-comet is missing, and installs a top-level module named
    ``papers``. The package scores in fp32 (COMET's ``predict`` default) with one reference."""
    import sys

    try:
        import comet

        version = comet.__version__
    except ImportError:
        version = "(not installed)"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"Python{python}|Comet{version}|{precision}|{comet_model_name(directory)}|r{references}"


YEAR = re.compile(r"\d+")


def thresholds_metric(directory: str) -> Optional[str]:
    """mt_thresholds' name of the COMET model in ``directory`` (Kocmi et al. 2024: ``comet22``
    for wmt22-comet-da, ``comet20``, ``cometkiwi22``, ``xcometXL``...), found as mt_thresholds'
    own command line normalizes a model name (its ``cmd_entry``, which no function exposes);
    None for a model it has no thresholds for."""
    import mt_thresholds

    name = comet_model_name(directory).split("/")[-1].lower().strip().replace("-", "")
    known = {metric.lower(): metric for metric in mt_thresholds.METRICS}
    if name not in known and "comet" in name:
        name = name.replace("da", "").replace("wmt", "")
        year = YEAR.match(name)
        if year:
            name = name[:year.start()] + name[year.end():] + year.group()
        if "qe" in name:
            name = name.replace("qe", "") + "qe"
    return known.get(name)


@functools.lru_cache(maxsize=None)
def load_comet(directory: Optional[str]) -> Optional[Comet]:
    """The model of ``--comet-model`` (None when it is not given), loaded once per process:
    the demo scores each of its tables with it."""
    return None if directory is None else Comet(directory)


def single_reference(references: Sequence[Sequence[str]]) -> Sequence[str]:
    """COMET compares a hypothesis with one reference: the only stream of ``references``."""
    if len(references) != 1:
        raise UsageError(f"COMET scores against one reference, {len(references)} reference files given; "
                         "give one --ref with --comet-model")
    return references[0]
