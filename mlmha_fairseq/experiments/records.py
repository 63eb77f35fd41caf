"""Run records: the few files of a finished run that the report reads (its scores, its test
hypotheses and its training log, a few hundred kB at most), kept in a folder of their own,
``<records>/<system>/seed<N>/``, outside the work directory.

A work directory holds checkpoints (megabytes per run, gigabytes per grid), so it stays on the
machine that trained it; a grid trained in rounds on machines that do not keep their disks (a
preemptible cloud node, a cluster's scratch space, a CI-like sandbox), or split across several
machines (``--seeds 1-2`` here, ``--seeds 3-3`` there), loses the finished runs with the
machine. With ``--records DIR`` the runner copies every finished run there (a folder a
repository or shared disk keeps), and at its start restores into the work directory every run
that is recorded but not finished there, so the table, the significance tests over replicates
and the learning curves cover every recorded run as if it had been trained in this work
directory. A run is only restored against the test references it was scored with (their
SHA-256 is part of the record): a record of another corpus is refused in one line.
"""
import json
import logging
import os
import shutil
from typing import Sequence

from mlmha_fairseq.corpus.fetch import sha256_of
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.text_io import count_lines, write_text
from mlmha_fairseq.experiments.grid import Run
from mlmha_fairseq.output_files import atomic_output

logger = logging.getLogger("mlmha_fairseq.experiment")

# what the report reads of a finished run (scores.json last: with it, a run is finished)
TRAIN_LOG = os.path.join("logs", "train.log")
RECORDED = ("hypotheses.txt", TRAIN_LOG, "scores.json")
ABOUT = "record.json"  # {"references_sha256": ...}


def record_folder(records: str, run: Run) -> str:
    """``<records>/<system>/seed<N>``: the run folder's last two names, as under ``<work_dir>/runs``."""
    seed_folder = os.path.basename(run.directory)
    return os.path.join(records, os.path.basename(os.path.dirname(run.directory)), seed_folder)


def check_no_links(records: str, path: str) -> None:
    """Refuse a symbolic link at or above ``path`` inside ``records``: the runner would write
    (or read) the file it points to, outside the records folder."""
    records = os.path.abspath(records)
    current = os.path.abspath(path)
    while current.startswith(records + os.sep):
        if os.path.islink(current):
            raise UsageError(f"records folder {records}: {current} is a symbolic link (to {os.readlink(current)}); "
                             "the runner writes and reads only files inside the folder: replace the link by the "
                             "folder or file itself")
        current = os.path.dirname(current)


def _copy(source: str, destination: str, records: str) -> None:
    """(A source inside ``records`` is checked by :func:`restore` before anything is copied.)"""
    check_no_links(records, destination)
    with atomic_output(destination) as temporary:
        shutil.copyfile(source, temporary)


def _copy_log(source: str, destination: str, records: str) -> None:
    """The training log with the working directory's path removed where it names a file in it
    (fairseq's warnings name the venv's files, its argument dump the ``--user-dir``): a record
    that a repository keeps names no path of the machine that trained it. The report reads
    none of those paths."""
    check_no_links(records, destination)
    here = os.path.join(os.getcwd(), "")
    with open(source, "rb") as handle:
        text = handle.read()
    if here != os.sep:  # run from the file system's root, every path is under it: keep them
        text = text.replace(here.encode(), b"")
    with atomic_output(destination) as temporary, open(temporary, "wb") as handle:
        handle.write(text)


def check_record(folder: str, references: str, sentences: int) -> None:
    """A record the report can read: its scores.json a JSON object with a BLEU score, its
    hypotheses one line per test sentence; one line naming the record and the fault otherwise."""
    try:
        with open(os.path.join(folder, "scores.json"), encoding="utf-8") as handle:
            scores = json.load(handle)
        float(scores["bleu"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"record {folder}: scores.json is truncated or not this runner's (no readable BLEU score): "
                         "record the run again or remove the record") from None
    hypotheses = count_lines(os.path.join(folder, "hypotheses.txt"))
    if hypotheses != sentences:
        raise UsageError(f"record {folder}: hypotheses.txt has {hypotheses} lines, the test references {references} "
                         f"{sentences}: the record is truncated; record the run again or remove the record")


def save(runs: Sequence[Run], records: str, references: str) -> int:
    """Copy every finished run of ``runs`` to ``records`` (again, where it was recorded before:
    a record follows its run); returns the number recorded."""
    checksum = sha256_of(references)
    saved = 0
    for run in runs:
        if not run.finished:
            continue
        folder = record_folder(records, run)
        check_no_links(records, os.path.join(folder, ABOUT))
        write_text(os.path.join(folder, ABOUT), json.dumps({"references_sha256": checksum}, indent=2) + "\n")
        for name in RECORDED:
            if os.path.isfile(run.path(name)):
                copy = _copy_log if name == TRAIN_LOG else _copy
                copy(run.path(name), os.path.join(folder, name), records)
        saved += 1
    return saved


def restore(runs: Sequence[Run], records: str, references: str) -> int:
    """Copy into its run folder every run of ``runs`` that ``records`` holds and that is not
    finished in the work directory (a half-trained attempt there is replaced: the record is
    the finished run); returns the number restored. Raises :class:`UsageError` for a record
    scored against other test references, before anything is copied."""
    checksum = sha256_of(references)
    unfinished = [(run, record_folder(records, run)) for run in runs if not run.finished]
    recorded = [(run, folder) for run, folder in unfinished if os.path.isfile(os.path.join(folder, RECORDED[-1]))]
    sentences = count_lines(references)
    for run, folder in recorded:
        for name in (ABOUT, *RECORDED):
            check_no_links(records, os.path.join(folder, name))
        try:
            with open(os.path.join(folder, ABOUT), encoding="utf-8") as handle:
                theirs = json.load(handle)["references_sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"record {folder} has no readable {ABOUT}: it cannot be checked against the test "
                             f"references {references}") from None
        if theirs != checksum:
            raise UsageError(f"record {folder} was scored against other test references than {references} "
                             f"(another corpus): use another --records folder")
        check_record(folder, references, sentences)
    for run, folder in recorded:
        for name in RECORDED:
            if os.path.isfile(os.path.join(folder, name)):
                _copy(os.path.join(folder, name), run.path(name), records)
        logger.info("%s: restored from %s", run.name, folder)
    return len(recorded)
