"""User-facing errors of the package: bad options, bad input files, conflicting mechanisms.

This package raises :class:`UsageError` for input it rejects; a command-line tool ends with it
as ``<prog>: error: <message>`` and exit status 1, like argparse, instead of a traceback that
buries the one line a user needs. The package's own tools (``python -m mlmha_fairseq.cli.*``)
do so in their entry point (:func:`mlmha_fairseq.cli._support.command`). fairseq's tools
(``fairseq-train``, ``fairseq-generate``, ...) import the package through ``--user-dir`` and
have no entry point of ours: when the running program is one of them, importing the package
installs :func:`excepthook`. Any other program that imports the package (a notebook, pytest, a
script) keeps its ``sys.excepthook``. Every other exception keeps the interpreter's usual
traceback.

The package is two parts: the plugin (what ``--user-dir mlmha_fairseq`` imports), which needs
only fairseq, torch and numpy, and the lab (corpus builder, experiment runner, analysis tools),
whose libraries come with ``pip install 'mlmha_fairseq[lab]'``. A lab library that is missing
is reported as one line naming it and that command (:func:`missing_lab_message`).
"""
import contextlib
import importlib.metadata
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


def _loaded_checkpoint(tb) -> Optional[str]:
    """The file fairseq's ``load_checkpoint_to_cpu`` was reading where traceback ``tb`` was
    raised inside ``torch.load``, if it was."""
    path, in_torch_load = None, False
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "load_checkpoint_to_cpu":
            path = tb.tb_frame.f_locals.get("path")
        elif path is not None and code.co_name == "load" and code.co_filename.endswith(
                os.path.join("torch", "serialization.py")):
            in_torch_load = True
        tb = tb.tb_next
    return path if in_torch_load and isinstance(path, str) else None


def truncated_checkpoint_message(error: BaseException, tb) -> Optional[str]:
    """One line for torch's errors on a checkpoint file that is empty or cut short (``EOFError``,
    the zip reader's ``OSError`` or ``PytorchStreamReader`` error) while fairseq loads it
    (fairseq-generate, fairseq-train --restore-file), naming the file; None for any other error."""
    truncated = isinstance(error, (EOFError, OSError)) or (
        isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error))
    path = _loaded_checkpoint(tb) if truncated else None
    if path is None:
        return None
    reason = ' '.join(str(error).split())[:120] or type(error).__name__
    return f"checkpoint {path} is empty or truncated ({reason}): use another checkpoint"


# The lab's libraries, by import name: their distribution, as pyproject.toml's lab extra lists it.
LAB_PACKAGES = {
    "sacremoses": "sacremoses",
    "subword_nmt": "subword-nmt",
    "compare_mt": "compare-mt",
    "six": "six",
    "matplotlib": "matplotlib",
    "nltk": "nltk",
    "wn": "wn",
    "submitit": "submitit",
    "statsmodels": "statsmodels",
    "mt_thresholds": "mt-thresholds",
}
LAB_EXTRA = "mlmha_fairseq[lab]"


def missing_lab_message(error: BaseException) -> Optional[str]:
    """One line for an import of a lab library that is not installed, naming it and the extra
    that installs it; None for any other error (a missing plugin dependency keeps its
    traceback: the plugin's install is broken, not incomplete). Only the package's own
    commands say it: in fairseq's, a missing module is fairseq's to report."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    distribution = LAB_PACKAGES.get((name or "").split(".")[0])
    if distribution is None:
        return None
    return (f"{distribution} is not installed; the corpus builder, experiment runner and analysis tools "
            f"need it: pip install '{LAB_EXTRA}'")


@contextlib.contextmanager
def lab_imports(module: str):
    """Wrap the imports of lab libraries at the top of a lab command's module (``module``: its
    ``__name__``). Run as the program, a missing one ends it with :func:`missing_lab_message`
    and status 1: the tool's entry point (``cli._support.command``) has not started yet to
    report it. Imported, the ``ModuleNotFoundError`` goes to the importer as usual."""
    try:
        yield
    except ModuleNotFoundError as error:
        message = missing_lab_message(error)
        if message is None or module != "__main__":
            raise
        print(format_usage_error(message), file=sys.stderr)
        sys.exit(1)


def one_line_message(error: BaseException, tb=None) -> Optional[str]:
    """What a command prints for ``error`` instead of a traceback: a :class:`UsageError`'s
    message, or the one line for torch's refusal of an unsafe checkpoint or for a truncated
    one (``tb``: where it was raised); None for any other error, which keeps its traceback."""
    if isinstance(error, UsageError):
        return str(error)
    return unsafe_checkpoint_message(error) or truncated_checkpoint_message(error, tb)


def excepthook(exc_type, exc, tb, previous=None):
    message = one_line_message(exc, tb)
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


FAIRSEQ_CLI_PACKAGE = "fairseq_cli"


def running_fairseq_command() -> bool:
    """Whether this process is one of fairseq's command-line tools: ``python -m
    fairseq_cli.<tool>``, or a console script that fairseq installs for one (``fairseq-train``:
    its name is in ``sys.argv[0]``, its ``__main__`` is the script, not the module)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name.startswith(FAIRSEQ_CLI_PACKAGE + ".")
    argv = getattr(sys, "argv", None) or [""]
    program = os.path.basename(argv[0])
    return any(entry.name == program and entry.value.startswith(FAIRSEQ_CLI_PACKAGE + ".")
               for entry in importlib.metadata.entry_points(group="console_scripts"))
