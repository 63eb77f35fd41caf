"""Training and validation curves from fairseq's own logs (MLRF paper, Wang et al. 2018,
Figure 4: training and validation accuracy against update steps, baseline and MLRF systems).

fairseq-train with ``--log-format json`` logs one JSON object per line after the usual
``time | level | tag |`` prefix, numbers printed as strings:

* ``train_inner``, every ``--log-interval`` updates: ``{"epoch": 3, "update": 2.5,
  "loss": ..., "accuracy": ..., "num_updates": 2500, ...}`` (means over the interval);
* ``train``, the epoch summary: ``{"epoch": 3, "train_loss": ..., "train_accuracy": ...,
  "train_num_updates": ...}``;
* ``valid``, each validation: ``{"epoch": 3, "valid_loss": ..., "valid_accuracy": ...,
  "valid_num_updates": ...}``.

Against updates (Figure 4) the training curve is the ``train_inner`` values, against epochs
the epoch summaries; the validation curve is the ``valid`` lines either way. Accuracy is
logged only by criteria that report it, e.g. ``--criterion label_smoothed_cross_entropy
--label-smoothing 0 --report-accuracy`` (with smoothing 0 the loss is the MLE loss).
"""
import json
from typing import Dict, Iterator, List, Sequence, Tuple

from mlmha_fairseq.evaluation.text_io import InputError, read_lines

SPLITS = ("train", "valid")
X_AXES = ("updates", "epoch")
Curve = List[Tuple[float, float]]


def _records(lines: Sequence[str]) -> Iterator[dict]:
    """The JSON objects of fairseq's log lines (other lines are skipped)."""
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def _point(record: dict, split: str, stat: str, x_axis: str):
    """``(x, value)`` of ``record`` for ``split``, or None if it is not such a line."""
    if x_axis == "epoch":
        key, x_key = f"{split}_{stat}", "epoch"
    elif split == "train":  # the per-interval train_inner lines carry unprefixed keys
        key, x_key = stat, "num_updates"
    else:
        key, x_key = f"{split}_{stat}", f"{split}_num_updates"
    if key in record and x_key in record:
        return float(record[x_key]), float(record[key])
    return None


def log_curves(lines: Sequence[str], stat: str = "accuracy", x_axis: str = "updates",
               path: str = "training log") -> Dict[str, Curve]:
    """``{"train": [(x, value), ...], "valid": [...]}`` of ``stat`` against ``x_axis``
    (``updates`` or ``epoch``); a later line at the same x (a resumed run) replaces an
    earlier one."""
    if x_axis not in X_AXES:
        raise InputError(f"x axis must be one of {X_AXES}")
    curves: Dict[str, Dict[float, float]] = {split: {} for split in SPLITS}
    for record in _records(lines):
        for split in SPLITS:
            point = _point(record, split, stat, x_axis)
            if point is not None:
                curves[split][point[0]] = point[1]
    if not any(curves.values()):
        raise InputError(f"{path}: no {stat} logged for training or validation; train with "
                         "--log-format json (and --report-accuracy for accuracy)")
    return {split: sorted(points.items()) for split, points in curves.items()}


def read_log_curves(path: str, stat: str = "accuracy", x_axis: str = "updates") -> Dict[str, Curve]:
    """:func:`log_curves` of a fairseq log file (``--log-file`` or the captured output)."""
    return log_curves(read_lines(path), stat, x_axis, path)
