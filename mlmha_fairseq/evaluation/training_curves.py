"""Per-epoch training and validation curves from fairseq's own logs (MLRF paper, Wang et al.
2018, Figure 4: training and validation accuracy of the baseline and MLRF systems).

fairseq-train with ``--log-format json`` logs each epoch's summary as one JSON object per
line after the usual ``time | level | tag |`` prefix: ``{"epoch": 3, "train_loss": "4.1",
"train_accuracy": "42.5", ...}`` under the tag ``train`` and ``{"epoch": 3, "valid_loss":
..., "valid_accuracy": ...}`` under ``valid`` (numbers printed as strings). Accuracy is
logged only by criteria that report it, e.g. ``--criterion label_smoothed_cross_entropy
--label-smoothing 0 --report-accuracy`` (with smoothing 0 the loss is the MLE loss). The
per-update ``train_inner`` lines have no ``train_`` prefix and are not read.
"""
import json
from typing import Dict, List, Sequence, Tuple

from mlmha_fairseq.evaluation.text_io import InputError, read_lines

SPLITS = ("train", "valid")
Curve = List[Tuple[int, float]]


def epoch_curves(lines: Sequence[str], stat: str = "accuracy",
                 path: str = "training log") -> Dict[str, Curve]:
    """``{"train": [(epoch, value), ...], "valid": [...]}`` of ``stat`` from fairseq's JSON
    epoch summaries; a later line for the same epoch (a resumed run) replaces an earlier one."""
    curves: Dict[str, Dict[int, float]] = {split: {} for split in SPLITS}
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or "epoch" not in record:
            continue
        for split in SPLITS:
            key = f"{split}_{stat}"
            if key in record:
                curves[split][int(record["epoch"])] = float(record[key])
    if not any(curves.values()):
        raise InputError(f"{path}: no epoch line with train_{stat} or valid_{stat}; train with "
                         "--log-format json (and --report-accuracy for accuracy)")
    return {split: sorted(points.items()) for split, points in curves.items()}


def read_epoch_curves(path: str, stat: str = "accuracy") -> Dict[str, Curve]:
    """:func:`epoch_curves` of a fairseq log file (``--log-file`` or the captured output)."""
    return epoch_curves(read_lines(path), stat, path)
