"""Reading line-aligned text files and writing result tables, with clear errors."""
import csv
import json
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.output_files import atomic_output


class InputError(UsageError):
    """A user-facing input problem (missing file, empty file, misaligned files)."""


def read_lines(path: str) -> List[str]:
    """Read a UTF-8 text file into a list of lines without trailing newlines.

    Raises :class:`InputError` if the file does not exist, is not UTF-8 or has no lines.
    """
    lines: List[str] = []
    _each_line(path, lambda line: lines.append(line.rstrip("\n")))
    return lines


def count_lines(path: str) -> int:
    """The number of lines of a UTF-8 text file, read as a stream (a corpus is checked
    without being held in memory); the errors of :func:`read_lines`."""
    count = 0

    def one(_line):
        nonlocal count
        count += 1

    _each_line(path, one)
    return count


def _each_line(path: str, visit) -> None:
    if not os.path.isfile(path):
        raise InputError(f"file not found: {path}")
    seen = False
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is no text (it would change BLEU)
            for line in handle:
                visit(line)
                seen = True
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); "
                         "convert it, e.g. with iconv -t UTF-8") from error
    if not seen:
        raise InputError(f"file is empty: {path}")


def check_same_length(named_sequences: Sequence[Tuple[str, Sequence]]) -> int:
    """Check that every ``(name, lines)`` pair has the same, non-zero number of lines.

    Returns the common length; raises :class:`InputError` naming each length otherwise.
    """
    lengths = {name: len(lines) for name, lines in named_sequences}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name}: {n} lines" for name, n in lengths.items())
        raise InputError(f"inputs have different numbers of lines ({described})")
    common = next(iter(lengths.values()), 0)
    if common == 0:
        raise InputError("no lines to evaluate")
    return common


def write_csv(path: str, rows: Sequence[Dict]) -> None:
    """Write a list of dicts (same keys, in order) as a CSV file with a header."""
    with atomic_output(path) as temporary, open(temporary, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)


def _plain(value):
    """``json.dump``'s fallback: numpy scalars and arrays (sacreBLEU and the analyses return
    them) as Python numbers and lists."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def write_json(path: str, payload) -> None:
    """Write a JSON-serialisable object (numpy values included), UTF-8, indented."""
    write_text(path, json.dumps(payload, indent=2, ensure_ascii=False, default=_plain) + "\n")


def write_text(path: str, text: str) -> None:
    """Write ``text`` as a UTF-8 file."""
    with atomic_output(path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)


def write_arrays(path: str, **arrays) -> None:
    """Write numpy arrays as a compressed ``.npz`` file (``np.savez_compressed``)."""
    with atomic_output(path) as temporary:
        np.savez_compressed(temporary, **arrays)
