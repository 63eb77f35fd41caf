"""User-facing errors of the package: bad options, bad input files, conflicting mechanisms.

fairseq's command-line tools (``fairseq-train``, ``fairseq-generate``) let any exception raised
while a model, task or dataset is built end the process with a Python traceback, which buries the
one line a user needs. This package raises :class:`UsageError` for input it rejects, and importing
the package (as ``--user-dir`` does) installs :func:`excepthook`, which prints such an error as
``<prog>: error: <message>`` and exits with status 1, like argparse. Every other exception keeps
the interpreter's usual traceback.
"""
import os
import pickle
import re
import sys
from typing import Optional

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UsageError(ValueError):
    """Input this package rejects. The message is one line that names the option or file at
    fault and says what to do. A ``ValueError``, so callers that catch those keep working."""


def format_usage_error(exc: BaseException, prog: str = "") -> str:
    prog = prog or os.path.basename(sys.argv[0] or "") or "python"
    return f"{prog}: error: {' '.join(str(exc).split())}"


def unsafe_checkpoint_message(error: BaseException) -> Optional[str]:
    """One line for torch's refusal of a checkpoint under safe (``weights_only``) loading,
    naming the refused global; None for any other error. torch's own message advises loading
    with ``weights_only=False``, which would run the code the file carries: it is left out."""
    if not isinstance(error, pickle.UnpicklingError) or "Weights only load failed" not in str(error):
        return None
    match = _REFUSED_GLOBAL.search(str(error))
    what = match.group(1) if match else "an object"
    return (f"the checkpoint holds {what}, which safe loading refuses: fairseq checkpoints store no such "
            "thing, so the file carries code or was not written by fairseq; do not load it")


def excepthook(exc_type, exc, tb, previous=None):
    message = str(exc) if issubclass(exc_type, UsageError) else unsafe_checkpoint_message(exc)
    if message is not None:
        print(format_usage_error(message), file=sys.stderr)
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
