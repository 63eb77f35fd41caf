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

Options that fairseq evaluates. Safe unpickling alone does not make a checkpoint safe: fairseq
passes some stored options to ``eval()`` while it builds a model (e.g.
``TransformerDecoderBase.build_output_projection`` evaluates ``adaptive_softmax_cutoff``), so a
checkpoint holding only allowed types can still carry code as a string. The training options
of every checkpoint that ``fairseq-train`` writes from its command line are an
``argparse.Namespace``; the allow-list entry for that name is :class:`CheckedNamespace`, which
refuses such a value while the checkpoint is unpickled, before any tool (fairseq's or ours)
sees it. Options stored as plain dicts (``fairseq-hydra-train``) are checked by
:func:`check_stored_options`, which this package's own tools call.
"""
import argparse
import ast
from collections.abc import Mapping

import numpy as np
import torch

from mlmha_fairseq.errors import UsageError

# Options whose stored value fairseq passes to eval() (eval, utils.eval_str_list,
# utils.eval_str_dict, utils.eval_bool) when it builds a task, model, criterion or optimizer;
# found by scanning fairseq's source for those calls on ``args.X`` / ``cfg.X``
# (tests/test_checkpoint_safety.py repeats the scan on the installed fairseq), plus
# xformers_att_config, which reaches eval_str_dict through MultiheadAttention's constructor.
EVALUATED_OPTIONS = frozenset({
    "adafactor_eps", "adam_betas", "adamax_betas", "adaptive_input_cutoff", "adaptive_softmax_cutoff",
    "character_filters", "conv_aggregator_layers", "conv_feature_layers", "decoder_attention",
    "decoder_layers", "downsample", "encoder_attention", "encoder_layers", "gated_attention",
    "lamb_betas", "left_pad_source", "left_pad_target", "pipeline_balance", "pipeline_decoder_balance",
    "pipeline_decoder_devices", "pipeline_devices", "pipeline_encoder_balance",
    "pipeline_encoder_devices", "pretrained", "project_input", "self_attention", "wer_args",
    "xformers_att_config",
})

# What a value may be built of: literals, and sums or products of them (fconv's default
# ``[(512, 3)] * 20`` is one). No names, attributes, subscripts or calls, so evaluating it
# runs no code.
_DATA_NODES = (ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.Load,
               ast.UnaryOp, ast.UAdd, ast.USub, ast.BinOp, ast.Add, ast.Mult)


class UnsafeCheckpointError(UsageError):
    """A checkpoint whose stored options carry code that fairseq would run."""


def is_code(value) -> bool:
    """Whether ``eval(value)`` could run code: a string that parses as a Python expression with
    anything beyond literals and their sums and products. A string that does not parse is not
    code (eval would raise before running anything)."""
    if not isinstance(value, str):
        return False
    try:
        tree = ast.parse(value.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return not all(isinstance(node, _DATA_NODES) for node in ast.walk(tree))


def check_options(options: Mapping, section: str = "") -> None:
    """Refuse (:class:`UnsafeCheckpointError`, one line naming the option) a value of
    :data:`EVALUATED_OPTIONS` in ``options`` that is code rather than data; ``section``
    (e.g. ``cfg.model.``) prefixes the option's name in the message."""
    for name in sorted(EVALUATED_OPTIONS.intersection(options)):
        value = options[name]
        if is_code(value):
            shown = value if len(value) <= 80 else value[:77] + "..."
            raise UnsafeCheckpointError(
                f"checkpoint option {section}{name}={shown!r} is Python code, not a value, and fairseq passes this option "
                "to eval() when it builds the model: refusing to load it (a value must be a literal, "
                "e.g. a number, list or tuple); do not load this checkpoint")


def check_stored_options(state: Mapping) -> None:
    """:func:`check_options` on every section of a loaded checkpoint's options: ``args``
    (legacy) and each section of ``cfg`` (``model``, ``task``, ``optimizer``, ...), whether a
    Namespace or a dict (``fairseq-hydra-train`` stores dicts, which unpickling does not check)."""
    sections = [("args", state.get("args"))]
    cfg = state.get("cfg")
    if isinstance(cfg, Mapping):
        sections += [(f"cfg.{name}", section) for name, section in cfg.items()]
    for where, section in sections:
        if isinstance(section, argparse.Namespace):
            section = vars(section)
        if isinstance(section, Mapping):
            check_options(section, f"{where}.")


class CheckedNamespace(argparse.Namespace):
    """What the allow-list unpickles for ``argparse.Namespace``: the same object, once its
    options are checked (:func:`check_options`). Pickled again as a plain Namespace."""

    def __setstate__(self, state):
        if isinstance(state, tuple):  # (dict, slots) form of pickle's BUILD
            state = state[0]
        check_options(state or {})
        self.__dict__.update(state or {})

    def __reduce__(self):
        return argparse.Namespace, (), dict(vars(self))


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
    """The classes fairseq checkpoints need besides tensors and containers, as torch's
    allow-list takes them: ``(class, "name in the pickle")`` where we unpickle a name as a
    checked subclass."""
    return [(CheckedNamespace, "argparse.Namespace"), *_numpy_data_globals()]


def allow_fairseq_checkpoints():
    """Allow-list :func:`fairseq_checkpoint_globals` for ``weights_only`` loading."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # torch < 2.4 has no allow-list and loads everything
        add_safe_globals(fairseq_checkpoint_globals())


allow_fairseq_checkpoints()
