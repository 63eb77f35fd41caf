"""Writing output files so that a reader never sees half of one, and no tool replaces its input.

Every file this package writes (checkpoints, tables, JSON, figures, arrays) is written to a
temporary file in the destination's folder and renamed into place (``os.replace``, atomic on
POSIX when both are on one file system): an interrupted or failed write leaves the previous
file, or none, never a truncated one.
"""
import contextlib
import os
import tempfile
from typing import Iterable, Iterator

from mlmha_fairseq.errors import UsageError

# Read/write for everyone the umask allows, as open(path, "w") would create the file
# (mkstemp creates it readable by its owner only).
DEFAULT_FILE_MODE = 0o666


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path`` to write; on success it is renamed to ``path``,
    on an exception it is removed. The temporary name keeps ``path``'s extension, which tools
    such as matplotlib and numpy read to choose the format."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    stem, extension = os.path.splitext(os.path.basename(path))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{stem}.", suffix=f".tmp{extension}")
    os.close(handle)
    try:
        yield temporary
        os.chmod(temporary, DEFAULT_FILE_MODE & ~_umask())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def refuse_overwriting_inputs(output: str, inputs: Iterable[str], what: str = "the output") -> None:
    """:class:`UsageError` if ``output`` is one of ``inputs`` (the same file, also through a
    link or another spelling of its path)."""
    if not os.path.exists(output):
        return
    for path in inputs:
        if os.path.exists(path) and os.path.samefile(output, path):
            raise UsageError(f"{what} {output} is also an input of this command; "
                             "write to another file")
