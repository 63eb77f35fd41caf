"""Shims fairseq needs on current torch, each with its reason. Imported first by the package.

Safe checkpoint loading (torch >= 2.6). ``torch.load`` defaults to ``weights_only=True``,
which only unpickles tensors, containers and an allow-list of classes. fairseq checkpoints
also store the training options as an ``argparse.Namespace`` and, depending on the run,
numpy scalars or arrays (fairseq issue #5603), so ``fairseq-generate``,
``fairseq-interactive`` and ``checkpoint_utils.load_checkpoint_to_cpu`` fail on checkpoints
that ``fairseq-train`` just wrote. We add exactly those plain data classes to torch's
allow-list; ``weights_only`` stays on, so a checkpoint that carries any other global (an
arbitrary callable, say) is still refused by torch with its "Weights only load failed"
error.
"""
import argparse

import numpy as np
import torch


def _numpy_data_globals():
    """numpy's constructors for scalars and arrays of plain dtypes (data, no code)."""
    core = getattr(np, "_core", None) or np.core  # numpy >= 2 renamed np.core
    dtypes = [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_]
    return [
        core.multiarray.scalar,
        core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        *[type(np.dtype(t)) for t in dtypes],
    ]


def fairseq_checkpoint_globals():
    """The classes fairseq checkpoints need besides tensors and containers."""
    return [argparse.Namespace, *_numpy_data_globals()]


def allow_fairseq_checkpoints():
    """Allow-list :func:`fairseq_checkpoint_globals` for ``weights_only`` loading."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # torch < 2.4 has no allow-list and loads everything
        add_safe_globals(fairseq_checkpoint_globals())


allow_fairseq_checkpoints()
