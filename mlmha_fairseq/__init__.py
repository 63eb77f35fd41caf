"""mlmha_fairseq: a fairseq plugin for Transformers that use more than their top layer
or more than one source (MLMHA, layer aggregation, MLRF, MMA, multi-source decoding,
multi-level supervision).

``fairseq-train --user-dir mlmha_fairseq`` imports this package, which registers every
model, architecture, criterion and task (fairseq itself only auto-imports ``models/`` and
``tasks/`` of a user directory, so criteria must be imported here).
"""
__version__ = "0.1.0"  # the one place of the version: pyproject.toml reads it (tests/test_packaging.py)

from . import compat  # noqa: F401  (first: safe checkpoint loading on torch >= 2.6)
from .errors import install_excepthook, running_fairseq_command
from . import criterions, models, tasks  # noqa: F401

if running_fairseq_command():  # fairseq-train --user-dir ...: no entry point of ours to catch a UsageError
    install_excepthook()
