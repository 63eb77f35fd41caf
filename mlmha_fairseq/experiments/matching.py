"""Budget-matched baselines: for a mechanism, fairseq's Transformer with as many parameters.

A mechanism that adds parameters (MLMHA's extra cross-attention, MLRF's fusion layers, the
auxiliary decoders of multi-level supervision) may win by its size rather than by its idea;
the comparison that separates the two is against a Transformer of the same size (as Wang et al.
2019 weigh DLCL against deeper and wider Transformers). For each
mechanism system named by the config's ``matched`` key the runner derives the baseline system
with its feed-forward layers widened (``matched_by = "ffn"``: ``--encoder-ffn-embed-dim`` and
``--decoder-ffn-embed-dim`` both set to one width), or with layers added, encoder and decoder in
turn, and the remainder closed by the FFN width (``matched_by = "layers"``), until its parameter
count is the mechanism's within :data:`TOLERANCE`.

Parameters are counted exactly as fairseq-train counts them (``num. shared model params``: the
model's ``parameters()``, a shared embedding once), on a model built by fairseq's own parser and
task from the grid's arguments (model size, train_args, the system's options) and the corpus's
dictionaries (their size sets the embeddings' share of the count), on PyTorch's ``meta`` device:
shapes without storage, so that a base-size model costs nothing to count.
"""
import contextlib
import logging
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments.grid import USER_DIR, Settings
from mlmha_fairseq.experiments.systems import System

logger = logging.getLogger("mlmha_fairseq.experiment")

TOLERANCE = 0.01  # |matched - mechanism| / mechanism
MATCHED_BY = ("ffn", "layers")
MAX_ADDED_LAYERS = 48  # per side: a mechanism larger than this is not matched by depth
SIDES = ("encoder", "decoder")


def model_arguments(system: System, settings: Settings) -> List[str]:
    """fairseq-train's arguments that shape ``system``'s model in this grid, in the runner's
    order (:func:`mlmha_fairseq.experiments.grid.train`): the system's options last."""
    return [settings.data_bin, "--user-dir", USER_DIR, *settings.corpus_args, *system.task_options,
            "--arch", system.arch, *settings.model_args,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--optimizer", "adam",
            *settings.train_args, *system.options]


def count_parameters(system: System, settings: Settings) -> int:
    """The parameters fairseq-train would report for ``system`` (``num. shared model params``),
    from a model built as it builds one: fairseq's parser, ``tasks.setup_task`` (which reads the
    corpus's dictionaries) and ``task.build_model``, on the ``meta`` device; on the CPU where a
    module cannot be built on ``meta`` (the count is the same)."""
    import torch
    from fairseq import options, tasks

    parser = options.get_training_parser()
    try:
        args = options.parse_args_and_arch(parser, [str(a) for a in model_arguments(system, settings)])
    except SystemExit:
        raise UsageError(f"matched baseline: the options of {system.name!r} are not fairseq-train's: "
                         f"{' '.join(map(str, system.options))}") from None
    args.tpu = False  # fairseq's parser turns --bf16 into --tpu
    with _quiet_fairseq():  # its "dictionary: N types" lines, once per count
        task = tasks.setup_task(args)
        try:
            with torch.device("meta"):
                model = task.build_model(args)
        except Exception:  # a module that computes on its weights while it is built
            model = task.build_model(args)
    return sum(parameter.numel() for parameter in model.parameters())


@contextlib.contextmanager
def _quiet_fairseq():
    fairseq_logger = logging.getLogger("fairseq")
    level = fairseq_logger.level
    fairseq_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        fairseq_logger.setLevel(level)


def _option(options: Sequence[str], name: str) -> Optional[str]:
    """The last value of ``name`` in a command line (argparse keeps the last)."""
    value = None
    for index, word in enumerate(options[:-1]):
        if word == name:
            value = options[index + 1]
    return value


def _with(system: System, changes: Dict[str, int]) -> System:
    """``system`` with ``changes`` = {option: value} appended to its options (the last wins)."""
    extra = [str(word) for option, value in changes.items() for word in (option, value)]
    return replace(system, options=[*system.options, *extra], key="")


def _ffn(base: System, width: int) -> Dict[str, int]:
    return {f"--{side}-ffn-embed-dim": width for side in SIDES}


def _nearest_width(system: System, changes: Dict[str, int], target: int, start: int, count_at_start: int,
                  settings: Settings) -> Tuple[int, int]:
    """(width, count): the FFN width whose count is nearest ``target``, from the count at width
    ``start`` and one more build (a Transformer's count is linear in the FFN width: each layer's
    two FFN matrices and biases grow by 2 d + 1 per unit)."""
    wider = count_parameters(_with(system, {**changes, **_ffn(system, start + 64)}), settings)
    per_unit = (wider - count_at_start) / 64
    if per_unit <= 0:
        raise UsageError("matched baseline: the FFN width does not change the baseline's parameter count "
                         "(does its architecture have --encoder-ffn-embed-dim?)")
    width = max(1, round(start + (target - count_at_start) / per_unit))
    return width, count_parameters(_with(system, {**changes, **_ffn(system, width)}), settings)


def matched_system(mechanism: System, baseline: System, settings: Settings, by: str = "ffn",
                   target: Optional[int] = None) -> Tuple[System, int, int]:
    """(the baseline matched to ``mechanism``, its parameter count, the mechanism's): the
    baseline system with the FFN widened (``by="ffn"``) or layers added first (``by="layers"``).
    Raises :class:`UsageError` (one line) when no width gets within :data:`TOLERANCE`."""
    if by not in MATCHED_BY:
        raise UsageError(f"matched_by must be one of {', '.join(MATCHED_BY)}, got {by!r}")
    target = target if target is not None else count_parameters(mechanism, settings)
    words = [*settings.model_args, *settings.train_args, *baseline.options]
    width0 = int(_option(words, "--encoder-ffn-embed-dim") or _option(words, "--decoder-ffn-embed-dim") or 0)
    layers = {side: int(_option(words, f"--{side}-layers") or 0) for side in SIDES}
    changes: Dict[str, int] = {}
    count = count_parameters(baseline, settings)
    if by == "layers":
        if not all(layers.values()):
            raise UsageError("matched_by = \"layers\" needs the layer counts in model_args "
                             "(--encoder-layers, --decoder-layers)")
        # add a layer on each side in turn (encoder first) while the count stays at most the target
        for step in range(2 * MAX_ADDED_LAYERS):
            side = SIDES[step % 2]
            trial = {**changes, f"--{side}-layers": layers[side] + 1}
            trial_count = count_parameters(_with(baseline, trial), settings)
            if trial_count > target * (1 + TOLERANCE):
                break
            changes, count, layers[side] = trial, trial_count, layers[side] + 1
        if changes:  # both sides named, so that the name says the whole shape
            changes = {f"--{side}-layers": layers[side] for side in SIDES}
    # the nearest width, even where the count is already within the tolerance: as close as one
    # unit of width allows, and the name says the width
    if not width0:
        raise UsageError("matched baseline: the baseline's FFN width is not in model_args "
                         "(--encoder-ffn-embed-dim): give it there")
    width, count = _nearest_width(baseline, changes, target, width0, count, settings)
    changes.update(_ffn(baseline, width))
    if abs(count - target) > TOLERANCE * target:
        raise UsageError(f"matched baseline for {mechanism.name!r}: no FFN width gets within "
                         f"{TOLERANCE:.0%} of its {target:,} parameters (closest: {count:,})")
    return _with(baseline, changes), count, target


def describe(changes: System, baseline: System) -> str:
    """What the matched baseline changes, for its name: ``FFN 1,216``, ``4+4 layers, FFN 530``."""
    added = changes.options[len(baseline.options):]
    values = dict(zip(added[::2], added[1::2]))
    parts = []
    if "--encoder-layers" in values or "--decoder-layers" in values:
        parts.append(f"{values['--encoder-layers']}+{values['--decoder-layers']} layers")
    if "--encoder-ffn-embed-dim" in values:
        parts.append(f"FFN {int(values['--encoder-ffn-embed-dim']):,}")
    return ", ".join(parts)


def matched_name(mechanism: System, baseline: System, matched: System) -> str:
    """The matched baseline's name in the tables: "Transformer, matched to MLMHA M-00: FFN 1,216"."""
    short = baseline.name.split(" (")[0]  # "Transformer (fairseq)" -> "Transformer"
    return f"{short}, matched to {mechanism.name}: {describe(matched, baseline)}"


def matched_systems(systems: Sequence[System], baseline: str, names: Sequence[str], settings: Settings,
                    by: str = "ffn") -> Tuple[List[System], Dict[str, str], Dict[str, int]]:
    """The grid's systems with a matched baseline before each system of ``names``; returns
    (systems, {mechanism: its matched baseline's name}, {system name: parameter count}). A
    mechanism whose count is already within :data:`TOLERANCE` of the baseline's (MMA, DLCL) gets
    none: the baseline is its matched baseline, and a copy of it would only repeat its runs."""
    base = next(system for system in systems if system.name == baseline)
    result, pairs, counts = [], {}, {base.name: count_parameters(base, settings)}
    for system in systems:
        if system.name in names:
            target = count_parameters(system, settings)
            if abs(counts[base.name] - target) <= TOLERANCE * target:
                logger.info("%s: %s parameters, within %.0f%% of %s's %s (%+.2f%%): no matched baseline to train, "
                            "%s is one", system.name, f"{target:,}", 100 * TOLERANCE, base.name,
                            f"{counts[base.name]:,}", 100 * (counts[base.name] - target) / target, base.name)
                counts[system.name] = target
                result.append(system)
                continue
            matched, count, target = matched_system(system, base, settings, by, target)
            matched = replace(matched, name=matched_name(system, base, matched), key="", demo=None,
                              test_options=None)
            logger.info("%s: %s parameters; %s: %s (%+.2f%%)", system.name, f"{target:,}", matched.name,
                        f"{count:,}", 100 * (count - target) / target)
            result.append(matched)
            pairs[system.name] = matched.name
            counts[system.name], counts[matched.name] = target, count
        result.append(system)
    return result, pairs, counts
