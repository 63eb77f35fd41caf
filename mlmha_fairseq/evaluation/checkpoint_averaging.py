"""Averaging fairseq checkpoints (the parameter average of fairseq's
``scripts/average_checkpoints.py``, which is not installed with the pip package).

Floating-point tensors of ``state["model"]`` are averaged; every other entry (integer
buffers, cfg, optimizer history, ...) is kept from the last checkpoint given.
"""
import os
from typing import Dict, List, Optional, Sequence

import torch

from mlmha_fairseq.evaluation.model_loading import checkpoint_errors
from mlmha_fairseq.evaluation.text_io import InputError
from mlmha_fairseq.output_files import atomic_output

CHECKPOINT_PATTERNS = {
    "epoch": r"checkpoint(\d+)\.pt",
    "update": r"checkpoint_\d+_(\d+)\.pt",
}


def last_checkpoints(directory: str, count: int, kind: str = "epoch",
                     upper_bound: Optional[int] = None) -> List[str]:
    """The ``count`` newest epoch (``checkpointN.pt``) or update (``checkpoint_E_U.pt``)
    checkpoints of ``directory``, at most ``upper_bound``, oldest first."""
    from fairseq.checkpoint_utils import checkpoint_paths

    if not os.path.isdir(directory):
        raise InputError(f"directory not found: {directory}")
    if kind not in CHECKPOINT_PATTERNS:
        raise InputError(f"kind must be one of {', '.join(CHECKPOINT_PATTERNS)}")
    newest_first = checkpoint_paths(directory, CHECKPOINT_PATTERNS[kind], keep_match=True)
    chosen = [path for path, number in newest_first if upper_bound is None or number <= upper_bound]
    if len(chosen) < count:
        raise InputError(f"found {len(chosen)} {kind} checkpoints in {directory}, need {count}")
    return list(reversed(chosen[:count]))


def _check_compatible(shapes: Dict[str, torch.Size], model: Dict[str, torch.Tensor],
                      path: str) -> None:
    if set(model) != set(shapes):
        raise InputError(f"{path} has different parameter names from the first checkpoint")
    for name, tensor in model.items():
        if tensor.shape != shapes[name]:
            raise InputError(f"{path}: parameter {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(shapes[name])}")


def average_checkpoints(paths: Sequence[str]) -> dict:
    """The last checkpoint's state with its floating-point model tensors replaced by the
    mean over ``paths`` (accumulated in float64, cast back to each tensor's dtype)."""
    from fairseq.checkpoint_utils import load_checkpoint_to_cpu

    if not paths:
        raise InputError("no checkpoints to average")
    sums: Dict[str, torch.Tensor] = {}
    shapes = None
    state = None
    for path in paths:
        if not os.path.isfile(path):
            raise InputError(f"checkpoint not found: {path}")
        with checkpoint_errors(path):
            state = load_checkpoint_to_cpu(path)
        model = state["model"]
        if shapes is None:
            shapes = {name: tensor.shape for name, tensor in model.items()}
        _check_compatible(shapes, model, path)
        for name, tensor in model.items():
            if torch.is_floating_point(tensor):
                sums[name] = sums.get(name, 0) + tensor.to(torch.float64)
    averaged = dict(state["model"])
    for name, total in sums.items():
        averaged[name] = (total / len(paths)).to(state["model"][name].dtype)
    state["model"] = averaged
    return state


def save_checkpoint(state: dict, path: str) -> None:
    """Save an averaged state with ``torch.save``, through a temporary file renamed into
    place (an interrupted save leaves no broken checkpoint).

    ``load_checkpoint_to_cpu`` turned ``cfg`` into an OmegaConf object; it is stored as a
    plain container, as fairseq's trainer does, so that ``weights_only`` loading accepts it.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_config(state.get("cfg")):
        state = dict(state, cfg=OmegaConf.to_container(state["cfg"], resolve=True,
                                                       enum_to_str=True))
    with atomic_output(path) as temporary:
        torch.save(state, temporary)
