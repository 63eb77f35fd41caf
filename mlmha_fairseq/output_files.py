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


def _existing_ancestor(path: str) -> str:
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        current = os.path.dirname(current)
    return current


def check_output_folder(path: str, what: str) -> None:
    """:class:`UsageError` (one line naming ``what`` and ``path``) unless ``path`` is a folder
    this process can write into or can create. Tools call it for every output before their
    work starts: a clash or a read-only place found when the first file is written may come
    after hours of training."""
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {path} is not writable: choose a folder you can write to")
        return
    if os.path.lexists(path):
        raise UsageError(f"{what} {path} exists and is not a folder: move it away or choose another path")
    ancestor = _existing_ancestor(path)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{what} {path} cannot be created: {ancestor} is a file, not a folder; "
                         "choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path} cannot be created: {ancestor} is not writable; "
                         "choose a folder you can write to")


def check_output_file(path: str, what: str) -> None:
    """:class:`UsageError` unless ``path`` can be written (:func:`atomic_output`: a file in a
    folder this process can write into, replaced if it exists), as :func:`check_output_folder`."""
    if os.path.isdir(path):
        raise UsageError(f"{what} {path} is a folder: move it away or choose another path")
    check_output_folder(os.path.dirname(path) or ".", f"{what} {path}: its folder")


LOCK_FILE = ".lock"


@contextlib.contextmanager
def exclusive_folder(directory: str, what: str) -> Iterator[None]:
    """Hold ``directory`` for this process: a second holder (another runner on the same work
    directory, or on one run folder with parallel or cluster runs) is refused with one line
    naming the holder. ``flock`` is released by the kernel when its holder dies, even by
    SIGKILL, so a killed runner never leaves a stale lock; it is advisory and holds across
    processes of one machine (and on NFS mounts that support it)."""
    import fcntl
    import socket
    import time

    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:  # a place no folder can be made in (/proc/x), a full disk
        raise UsageError(f"{what} {directory} cannot be created ({error.strerror}): choose another path") from None
    path = os.path.join(directory, LOCK_FILE)
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UsageError(f"{what} {directory} is in use by {holder}; wait for it to finish or stop it") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        yield
    finally:
        handle.close()
