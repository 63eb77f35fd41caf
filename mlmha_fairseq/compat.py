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
passes some stored options to ``eval()`` while it builds a model, so a checkpoint holding only
allowed types can still carry code as a string. A list of option names cannot close this
channel: fairseq copies options under other names before it evaluates them
(``encoder_xformers_att_config`` becomes ``cfg.encoder.xformers_att_config``, a nested dict
becomes a sub-config), and a new fairseq release may evaluate a new one. Two layers, each
keyed on what a value is, not on what it is called; neither alone covers every path:

1. **Every stored string is checked on unpickling** (:class:`CheckedNamespace`, the
   allow-list's entry for ``argparse.Namespace``): a string at any depth of a stored
   Namespace (attributes, dicts, lists) whose Python parse could run code or build a huge
   value is refused (:func:`refusal`), whatever its key, before any tool sees it. This also
   covers fairseq's direct ``eval(args.X)`` calls (fconv, wav2vec, the optimizers), which no
   replaced function can reach. Names and paths (``relu``, ``data-bin/wmt.en-de``) stay.
   Options stored as plain dicts (``fairseq-hydra-train``) are not seen here: safe unpickling
   builds dicts without a hook. This package's own tools check them after loading
   (:func:`check_stored_options`).
2. **fairseq's eval-based option parsers are replaced by literal-only ones**
   (:func:`install_literal_option_parsers`): ``utils.eval_str_list``, ``utils.eval_str_dict``
   and ``utils.eval_bool`` evaluate a string with :func:`literal_value` instead of ``eval()``.
   These are the sinks the transformer family (fairseq's and this package's models) reaches
   (``adaptive_softmax_cutoff``, ``xformers_att_config``), so a dict-stored checkpoint loaded
   by fairseq's own tools cannot run code through them either. This replaces fairseq
   functions while the plugin is loaded: the one exception to this package's rule against
   monkey-patching, limited to these three functions, whose behaviour is unchanged for
   every literal (the values fairseq documents for these options).

Not covered: a dict-stored (hydra) checkpoint of a fairseq model that calls ``eval()``
directly (fconv, lightconv's character filters, wav2vec), loaded by fairseq's own tools.
"""
import argparse
import ast
import dataclasses
import operator
import sys
from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch

from mlmha_fairseq.errors import UsageError

# The largest value an option may build when evaluated (items of a list, characters of a
# string): fconv's longest default layer list has 20 items; ``[0] * 10**10`` would take the
# machine's memory.
MAX_LITERAL_ITEMS = 1 << 16

# Nodes of a name or a path that eval() only looks up, never calls or grows: ``relu``,
# ``data-bin/wmt.en-de``, ``fr,de``. No call, subscript, comprehension, f-string, lambda
# or power.
_NAME_NODES = (ast.Expression, ast.Name, ast.Attribute, ast.Load, ast.Constant, ast.Tuple, ast.List,
               ast.UnaryOp, ast.USub, ast.UAdd, ast.BinOp, ast.Add, ast.Sub, ast.Div, ast.FloorDiv)

REFUSED = "is Python code, not a value"


class UnsafeCheckpointError(UsageError):
    """A checkpoint (or command-line) option whose value is code that fairseq would run."""


class NotALiteral(ValueError):
    """A string that is not a literal value (:func:`literal_value`)."""


class LiteralTooLarge(NotALiteral):
    """A literal expression whose value would exceed :data:`MAX_LITERAL_ITEMS`."""


def _sized(value):
    if isinstance(value, (str, bytes, list, tuple, set, dict)) and len(value) > MAX_LITERAL_ITEMS:
        raise LiteralTooLarge(f"would build a value of {len(value):,} items")
    return value


_NUMBERS = (int, float, complex)
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _repeat(sequence, times):
    """``sequence * times`` once its size is known to be bounded."""
    if not isinstance(sequence, (str, bytes, list, tuple)) or isinstance(times, bool) or not isinstance(times, int):
        raise NotALiteral("only a string, list or tuple times an integer repeats")
    size = len(sequence) * max(times, 0)
    if size > MAX_LITERAL_ITEMS:
        raise LiteralTooLarge(f"would build a value of {size:,} items")
    return sequence * times


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return _sized(node.value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_evaluate(item) for item in node.elts]
        return _sized({ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items))
    if isinstance(node, ast.Dict) and None not in node.keys:  # None: ``{**x}``
        return _sized({_evaluate(k): _evaluate(v) for k, v in zip(node.keys, node.values)})
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        if isinstance(value, _NUMBERS) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Mult) and not isinstance(left, _NUMBERS):
            return _repeat(left, right)
        if isinstance(node.op, ast.Mult) and not isinstance(right, _NUMBERS):
            return _repeat(right, left)
        if isinstance(left, _NUMBERS) and isinstance(right, _NUMBERS):
            return _ARITHMETIC[type(node.op)](left, right)
        if isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, (str, list, tuple)):
            return _sized(left + right)
    raise NotALiteral(f"{type(node).__name__} is not part of a literal")


def literal_value(text: str):
    """What ``eval(text)`` gives for a literal: Python literals (numbers, strings, ``None``,
    ``True``, lists, tuples, sets, dicts), signed numbers, sums and products of numbers, and
    sums and repetitions of sequences up to :data:`MAX_LITERAL_ITEMS` items. ``ast.literal_eval``
    is not enough: fconv's default layer spec ``[(512, 3)] * 20`` is a product. Raises
    :class:`NotALiteral` for anything else (no name is looked up and nothing is called)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        raise NotALiteral(f"not a Python expression ({type(error).__name__})") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise NotALiteral("nested too deeply") from None


def refusal(value) -> Optional[str]:
    """Why ``eval(value)`` of a stored string is unsafe (it could run code or exhaust memory),
    or None: a literal (:func:`literal_value`), a name or a path (looked up, never run), a
    string that is no Python expression (eval fails before running anything), or no string."""
    if not isinstance(value, str):
        return None
    try:
        literal_value(value)
        return None
    except LiteralTooLarge as error:
        return f"is a literal that {error}"
    except NotALiteral:
        pass
    try:
        tree = ast.parse(value.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if all(isinstance(node, _NAME_NODES) for node in ast.walk(tree)):
        return None
    return REFUSED


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


def _refuse(name: str, value: str, why: str, stored: bool = True):
    """``stored``: the value was read from a checkpoint (else from wherever fairseq's option
    parser got it: a checkpoint, the command line or a config)."""
    if stored:
        raise UnsafeCheckpointError(
            f"checkpoint option {name}={_shown(value)} {why}, and fairseq passes options to eval() when it "
            "builds a model: refusing to load it (a value must be a literal, e.g. a number, list or tuple); "
            "do not load this checkpoint")
    raise UnsafeCheckpointError(
        f"option {name}={_shown(value)} {why}, and fairseq passes this option to eval(): refusing it (a value "
        "must be a literal, e.g. a number, list or tuple); if it comes from a checkpoint, do not load that checkpoint")


def check_value(value, name: str) -> None:
    """Refuse (:class:`UnsafeCheckpointError`, one line naming the option) any string in
    ``value``, at any depth (dicts, lists, tuples, Namespaces), that :func:`refusal` refuses.
    ``name`` is the option's dotted name, extended by keys and indices on the way down."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        for key, item in value.items():
            check_value(key, f"{name}[key]")
            check_value(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            check_value(item, f"{name}[{index}]")
    else:
        why = refusal(value)
        if why:
            _refuse(name, value, why)


def check_stored_options(state: Mapping) -> None:
    """:func:`check_value` on a loaded checkpoint's options: ``args`` (legacy) and every
    section of ``cfg``, whether Namespaces or dicts (``fairseq-hydra-train`` stores dicts,
    which unpickling does not check)."""
    for where in ("args", "cfg"):
        check_value(state.get(where), where)


class CheckedNamespace(argparse.Namespace):
    """What the allow-list unpickles for ``argparse.Namespace``: the same object, once every
    string it holds is checked (:func:`check_value`). Pickled again as a plain Namespace."""

    def __setstate__(self, state):
        if isinstance(state, tuple):  # (dict, slots) form of pickle's BUILD
            state = state[0]
        check_value(state or {}, "")
        self.__dict__.update(state or {})

    def __reduce__(self):
        return argparse.Namespace, (), dict(vars(self))


# --- fairseq's eval-based option parsers, literal-only ------------------------------------

def _fields(holder) -> Optional[Mapping]:
    """The options an options object holds: a Namespace's or a config dataclass's attributes,
    a dict's or a DictConfig's items; None for anything else (a module, a tensor)."""
    if isinstance(holder, Mapping):
        return holder
    if isinstance(holder, argparse.Namespace) or dataclasses.is_dataclass(holder) and not isinstance(holder, type):
        return vars(holder)
    return None


def _held_as(holder, value, depth: int = 2) -> Optional[str]:
    """The key path under which ``holder`` (or a sub-config of it, ``depth`` levels down)
    holds the string ``value``."""
    fields = _fields(holder)
    if fields is None:
        return None
    try:
        items = list(fields.items())
    except Exception:  # a DictConfig with a value it cannot resolve: no name from it
        return None
    for key, item in items:
        if item is value or (isinstance(item, str) and item == value):
            return str(key)
    for key, item in items:
        below = _held_as(item, value, depth - 1) if depth > 1 else None
        if below:
            return f"{key}.{below}"
    return None


def _option_name(value) -> str:
    """The name under which fairseq stored ``value`` (for the error message only; fairseq
    passes the parsers a value, not its name): the outermost options object on the call stack
    that holds it (``args.encoder_xformers_att_config`` rather than the
    ``xformers_att_config`` parameter of ``MultiheadAttention`` that it was copied into), else
    the caller's local that holds it."""
    frame, name = sys._getframe(3), None  # _option_name <- _literal_option <- the parser <- its caller
    local = next((key for key, held in frame.f_locals.items() if held is value), None)
    while frame is not None:
        for key, held in frame.f_locals.items():
            found = _held_as(held, value)
            if found:
                name = f"{key}.{found}"
        frame = frame.f_back
    return name or local or "(unnamed)"


def _literal_option(text: str):
    try:
        return literal_value(text)
    except LiteralTooLarge as error:
        _refuse(_option_name(text), text, f"is a literal that {error}", stored=False)
    except NotALiteral:
        _refuse(_option_name(text), text, REFUSED if refusal(text) == REFUSED else "is not a literal value",
                stored=False)


def eval_str_list(x, type=float):
    """``fairseq.utils.eval_str_list`` with :func:`literal_value` in place of ``eval``."""
    if x is None:
        return None
    if isinstance(x, str):
        x = _literal_option(x)
    try:
        return list(map(type, x))
    except TypeError:
        return [type(x)]


def eval_str_dict(x, type=dict):
    """``fairseq.utils.eval_str_dict`` with :func:`literal_value` in place of ``eval``."""
    if x is None:
        return None
    if isinstance(x, str):
        x = _literal_option(x)
    return x


def eval_bool(x, default=False):
    """``fairseq.utils.eval_bool`` with :func:`literal_value` in place of ``eval`` (as
    fairseq's, a value that is no string gives ``default``: eval raises TypeError on it)."""
    if x is None or not isinstance(x, str):
        return default
    return bool(_literal_option(x))


LITERAL_OPTION_PARSERS = {"eval_str_list": eval_str_list, "eval_str_dict": eval_str_dict, "eval_bool": eval_bool}


def install_literal_option_parsers() -> None:
    """Bind :data:`LITERAL_OPTION_PARSERS` in ``fairseq.utils`` and in every loaded fairseq
    module that imported fairseq's originals by name (``fairseq.options``, the multilingual
    data manager). ``import fairseq`` loads every model, task and module of fairseq, so the
    modules imported later hold none of them."""
    import fairseq.utils

    originals = {name: getattr(fairseq.utils, name) for name in LITERAL_OPTION_PARSERS}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "fairseq" or module_name.startswith(("fairseq.", "fairseq_cli"))):
            continue
        for name, original in originals.items():
            if original is not LITERAL_OPTION_PARSERS[name] and getattr(module, name, None) is original:
                setattr(module, name, LITERAL_OPTION_PARSERS[name])


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
install_literal_option_parsers()
