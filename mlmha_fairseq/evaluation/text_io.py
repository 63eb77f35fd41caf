"""Reading line-aligned text files and writing result tables, with clear errors."""
import csv
import json
import os
from typing import Dict, List, Sequence, Tuple


class InputError(ValueError):
    """A user-facing input problem (missing file, empty file, misaligned files)."""


def read_lines(path: str) -> List[str]:
    """Read a UTF-8 text file into a list of lines without trailing newlines.

    Raises :class:`InputError` if the file does not exist or has no lines.
    """
    if not os.path.isfile(path):
        raise InputError(f"file not found: {path}")
    with open(path, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in handle]
    if not lines:
        raise InputError(f"file is empty: {path}")
    return lines


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


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)


def write_csv(path: str, rows: Sequence[Dict]) -> None:
    """Write a list of dicts (same keys, in order) as a CSV file with a header."""
    _ensure_parent(path)
    with open(path, "w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str, payload) -> None:
    """Write a JSON-serialisable object, UTF-8, indented."""
    _ensure_parent(path)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) through a temporary file in the same folder and a rename, so
    that a reader or an interrupted run never sees a half-written file."""
    _ensure_parent(path)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)
