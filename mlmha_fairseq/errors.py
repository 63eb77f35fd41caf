"""User-facing errors of the package: bad options, bad input files, conflicting mechanisms.

fairseq's command-line tools (``fairseq-train``, ``fairseq-generate``) let any exception raised
while a model, task or dataset is built end the process with a Python traceback, which buries the
one line a user needs. This package raises :class:`UsageError` for input it rejects, and importing
the package (as ``--user-dir`` does) installs :func:`excepthook`, which prints such an error as
``<prog>: error: <message>`` and exits with status 1, like argparse. Every other exception keeps
the interpreter's usual traceback.
"""
import os
import sys


class UsageError(ValueError):
    """Input this package rejects. The message is one line that names the option or file at
    fault and says what to do. A ``ValueError``, so callers that catch those keep working."""


def format_usage_error(exc: BaseException, prog: str = "") -> str:
    prog = prog or os.path.basename(sys.argv[0] or "") or "python"
    return f"{prog}: error: {' '.join(str(exc).split())}"


def excepthook(exc_type, exc, tb, previous=None):
    if issubclass(exc_type, UsageError):
        print(format_usage_error(exc), file=sys.stderr)
        return
    (previous or sys.__excepthook__)(exc_type, exc, tb)


def install_excepthook():
    """Chain :func:`excepthook` in front of the current ``sys.excepthook`` (once)."""
    current = sys.excepthook
    if getattr(current, "_mlmha_usage_errors", False):
        return

    def hook(exc_type, exc, tb):
        excepthook(exc_type, exc, tb, previous=current)

    hook._mlmha_usage_errors = True
    sys.excepthook = hook
