"""Read Bible versions from the SQLite database and align them verse by verse.

The database has one table ``bible(bbName, bNumber, cNumber, vNumber, vText)``: one row per
(version, book, chapter, verse). All versions share one versification, so an N-way tuple is
the texts of the N versions at the same (book, chapter, verse) key.
"""
import logging
import sqlite3
from typing import Dict, List, NamedTuple, Sequence, Tuple

from mlmha_fairseq.corpus.errors import CorpusError

logger = logging.getLogger(__name__)

VerseKey = Tuple[int, int, int]  # (book, chapter, verse)


class Verse(NamedTuple):
    """One aligned verse: its key and one text per selected version (in selection order)."""

    key: VerseKey
    texts: Tuple[str, ...]

    @property
    def book(self) -> int:
        """The book number (1-66)."""
        return self.key[0]


def _connect(db_path: str) -> sqlite3.Connection:
    """Open the database read-only and check that it has the ``bible`` table."""
    try:
        connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        connection.execute("SELECT bbName, bNumber, cNumber, vNumber, vText FROM bible LIMIT 1")
    except sqlite3.Error as error:
        raise CorpusError(f"{db_path} is not a Bible database with a table "
                          f"bible(bbName, bNumber, cNumber, vNumber, vText): {error}") from error
    return connection


def available_versions(db_path: str) -> Dict[str, int]:
    """Version code -> number of verses, for every version in the database."""
    with _connect(db_path) as connection:
        rows = connection.execute("SELECT bbName, COUNT(*) FROM bible GROUP BY bbName").fetchall()
    return dict(rows)


def read_version(db_path: str, code: str) -> Dict[VerseKey, str]:
    """All verses of one version: (book, chapter, verse) -> raw text."""
    with _connect(db_path) as connection:
        rows = connection.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (code,)
        ).fetchall()
    if not rows:
        known = ", ".join(sorted(available_versions(db_path))) or "none"
        raise CorpusError(f"version {code!r} is not in {db_path} (versions there: {known})")
    return {(book, chapter, verse): text or "" for book, chapter, verse, text in rows}


def align(versions: Sequence[Dict[VerseKey, str]]) -> Tuple[List[Verse], int]:
    """Tuples of texts at the keys every version has, in canonical order.

    Returns the aligned verses and the number of keys dropped because some version lacks them.
    """
    all_keys = set().union(*versions)
    shared = set(versions[0]).intersection(*versions[1:])
    verses = [Verse(key, tuple(version[key] for version in versions)) for key in sorted(shared)]
    return verses, len(all_keys) - len(shared)


def load_aligned(db_path: str, codes: Sequence[str]) -> Tuple[List[Verse], int]:
    """Read the versions ``codes`` and align them; see :func:`align`."""
    versions = []
    for code in codes:
        versions.append(read_version(db_path, code))
        logger.info("read version %s: %d verses", code, len(versions[-1]))
    return align(versions)
