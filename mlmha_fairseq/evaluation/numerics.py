"""Float16 headroom of a model's activations and gradients on real batches.

For every named module, over the batches: the largest ``|activation|`` (its outputs),
``|gradient|`` (of the training loss with respect to those outputs) and ``|parameter gradient|``
(of its own parameters: what ``--fp16`` stores in float16 before the optimizer step, summed over
the batch's tokens and, for a shared matrix such as a tied embedding, over its uses), their
headroom to float16's largest value (65,504) as ``log2(65,504 / max)``, and the smallest
nonzero ``|activation|`` against float16's smallest subnormal (2^-24, below which a value
rounds to 0) as ``log2(min / 2^-24)``; per layer, the gradient norm of its parameters. A
headroom below 0 is a value that float16 cannot hold: in ``--fp16`` training an inf or NaN, and
an overflow that fairseq's loss scaler cannot remove once the loss scale is below 1.

The model runs as loaded (float32, eval mode: no dropout, so the numbers are reproducible) on
teacher-forced batches of a split, with the loss of the checkpoint's own criterion (e.g. the
joint loss of multi-level supervision), summed over the target tokens as fairseq's backward
pass takes it at loss scale 1: a gradient headroom of h bits is the largest loss scale,
2^h, at which that gradient still fits. The layer gradient norms are those of the per-token
loss (the summed loss over the batch's sample size), the gradient that fairseq's optimizer
applies and whose norm it logs (``gnorm``).
"""
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from mlmha_fairseq.evaluation.plotting import pyplot, save_figure
from mlmha_fairseq.evaluation.text_io import InputError

FP16_MAX = torch.finfo(torch.float16).max  # 65,504
FP16_SMALLEST_SUBNORMAL = 2.0 ** -24  # float16's resolution at 0: smaller magnitudes round to 0
# a layer of a stack: everything up to ``layers.<i>`` (``encoder.layers.3``,
# ``decoder.aux_decoders.0.layers.1``); other parameters are grouped by their module
LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")
PLOT_FLOOR_BITS = -8.0  # where the plot draws a value float16 cannot hold at all (inf, NaN)
# fairseq's --fp16-init-scale (2^7): a gradient with less headroom overflows at the first update
FAIRSEQ_INIT_SCALE_BITS = 7.0
HEADROOMS = {"activation_headroom_log2": "activations", "gradient_headroom_log2": "activation gradients",
             "parameter_gradient_headroom_log2": "parameter gradients"}


@dataclass
class ModuleNumerics:
    """Extremes of one module's outputs and of the loss gradient with respect to them."""

    max_activation: float = 0.0
    min_nonzero_activation: float = math.inf
    max_gradient: float = 0.0
    max_parameter_gradient: float = 0.0

    def add_activation(self, tensor: Tensor) -> None:
        magnitude = tensor.detach().abs()
        self.max_activation = max(self.max_activation, float(magnitude.max()))
        nonzero = magnitude[magnitude > 0]
        if nonzero.numel():
            self.min_nonzero_activation = min(self.min_nonzero_activation, float(nonzero.min()))

    def add_gradient(self, gradient: Tensor) -> None:
        self.max_gradient = max(self.max_gradient, float(gradient.detach().abs().max()))

    def add_parameter_gradients(self, module: nn.Module) -> None:
        for parameter in module.parameters(recurse=False):
            if parameter.grad is not None:
                self.max_parameter_gradient = max(self.max_parameter_gradient, float(parameter.grad.abs().max()))


def headroom_bits(largest: float) -> Optional[float]:
    """``log2(65,504 / largest)``: bits of float16 range left above ``largest`` (negative once
    float16 overflows, -inf for inf or NaN; None for 0, nothing recorded)."""
    if not math.isfinite(largest):
        return -math.inf
    return math.log2(FP16_MAX / largest) if largest > 0 else None


def underflow_margin_bits(smallest: float) -> Optional[float]:
    """``log2(smallest / 2^-24)``: bits above float16's smallest subnormal (negative: the value
    rounds to 0 in float16; below 10, i.e. under 2^-14, it is subnormal); None when no nonzero
    value was recorded."""
    return math.log2(smallest / FP16_SMALLEST_SUBNORMAL) if math.isfinite(smallest) else None


def _tensors(output) -> List[Tensor]:
    """The floating-point tensors of a module's output: a tensor, or those inside tuples,
    lists and dicts (fairseq's encoders return a dict of lists)."""
    if isinstance(output, Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in _tensors(item)]
    if isinstance(output, dict):
        return [tensor for item in output.values() for tensor in _tensors(item)]
    return []


class NumericsRecorder:
    """Within the context, every forward of ``model`` adds each named module's outputs to
    ``records[name]``, and the backward pass the gradients with respect to them (a hook on
    each output tensor; module backward hooks fail on modules that return dictionaries)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.records: Dict[str, ModuleNumerics] = {}
        self._handles = []

    def __enter__(self) -> "NumericsRecorder":
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def add_parameter_gradients(self) -> None:
        """Adds the parameter gradients of the last backward pass to every module's record."""
        for name, module in self.model.named_modules():
            if name in self.records:
                self.records[name].add_parameter_gradients(module)

    def _hook(self, name: str) -> Callable:
        record = self.records.setdefault(name, ModuleNumerics())

        def hook(_module, _inputs, output):
            for tensor in _tensors(output):
                record.add_activation(tensor)
                if tensor.requires_grad:
                    tensor.register_hook(record.add_gradient)

        return hook


def layer_of(parameter_name: str) -> str:
    """The layer a parameter belongs to: ``encoder.layers.3`` for
    ``encoder.layers.3.fc1.weight``, else its module (``encoder.embed_tokens``)."""
    match = LAYER.match(parameter_name)
    return match.group(1) if match else parameter_name.rsplit(".", 1)[0]


def layer_gradient_norms(model: nn.Module, scale: float = 1.0) -> Dict[str, float]:
    """L2 norm of each layer's parameter gradients (times ``scale``), in parameter order; a
    parameter shared by several modules counts once."""
    squares: Dict[str, float] = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            layer = layer_of(name)
            squares[layer] = squares.get(layer, 0.0) + float(parameter.grad.double().pow(2).sum()) * scale ** 2
    return {layer: math.sqrt(total) for layer, total in squares.items()}


@dataclass
class Numerics:
    """One model's probe: per module its extremes, per layer the mean gradient norm over
    the batches."""

    modules: Dict[str, ModuleNumerics]
    layer_gradient_norms: Dict[str, float]
    batches: int

    def module_rows(self) -> List[Dict]:
        return [{"module": name, "max_abs_activation": record.max_activation,
                 "activation_headroom_log2": headroom_bits(record.max_activation),
                 "min_nonzero_abs_activation": (record.min_nonzero_activation
                                                if math.isfinite(record.min_nonzero_activation) else None),
                 "underflow_margin_log2": underflow_margin_bits(record.min_nonzero_activation),
                 "max_abs_gradient": record.max_gradient,
                 "gradient_headroom_log2": headroom_bits(record.max_gradient),
                 "max_abs_parameter_gradient": record.max_parameter_gradient,
                 "parameter_gradient_headroom_log2": headroom_bits(record.max_parameter_gradient)}
                for name, record in self.modules.items()
                if record.max_activation or record.max_gradient or record.max_parameter_gradient]

    def layer_rows(self) -> List[Dict]:
        return [{"layer": layer, "gradient_norm": norm} for layer, norm in self.layer_gradient_norms.items()]

    def least_headroom(self) -> Dict:
        """The module row with the smallest headroom of any kind."""
        return min(self.module_rows(), key=lambda row: min(_bits(row[key]) for key in HEADROOMS))


def _bits(headroom: Optional[float]) -> float:
    """A headroom for comparisons: None (nothing recorded) as unlimited."""
    return math.inf if headroom is None else headroom


def _plotted(headroom: Optional[float]) -> float:
    """A headroom as drawn: None (nothing recorded) not at all, an inf or NaN value (-inf) at
    the plot's floor."""
    return math.nan if headroom is None else max(headroom, PLOT_FLOOR_BITS)


def probe_numerics(model: nn.Module, criterion, samples: Iterable[Dict],
                   max_batches: Optional[int] = None) -> Numerics:
    """Forward and backward of ``criterion(model, sample)`` (fairseq's criterion interface:
    ``loss, sample_size, logging``) on up to ``max_batches`` of ``samples``, recording
    every module; the model's gradients are left zeroed."""
    model.eval()
    norms: Dict[str, float] = {}
    batches = 0
    with NumericsRecorder(model) as recorder:
        for sample in samples:
            if max_batches is not None and batches >= max_batches:
                break
            model.zero_grad()
            loss, sample_size, _logging = criterion(model, sample)
            loss.backward()
            recorder.add_parameter_gradients()
            for layer, norm in layer_gradient_norms(model, 1.0 / float(sample_size)).items():
                norms[layer] = norms.get(layer, 0.0) + norm
            batches += 1
    model.zero_grad()
    if not batches:
        raise InputError("no batches to probe")
    return Numerics(recorder.records, {layer: total / batches for layer, total in norms.items()}, batches)


def plot_numerics(models: Dict[str, Numerics], path: str) -> None:
    """Per model, the activation, gradient and parameter gradient headroom of every module (in
    module order; float16 overflows below the dashed line at 0; inf and NaN at -8) and the
    gradient norm per layer (on one axis of every model's layers, in order of appearance)."""
    plt = pyplot()
    figure, (headroom, norms) = plt.subplots(2, 1, figsize=(10, 7))
    layers = list(dict.fromkeys(row["layer"] for numerics in models.values() for row in numerics.layer_rows()))
    for name, numerics in models.items():
        rows = numerics.module_rows()
        for (key, kind), marker in zip(HEADROOMS.items(), ".x+"):
            headroom.plot(range(len(rows)), [_plotted(row[key]) for row in rows], marker, linestyle="none",
                          markersize=3, label=f"{name}: {kind}")
        points = sorted((layers.index(row["layer"]), row["gradient_norm"]) for row in numerics.layer_rows())
        norms.plot(*zip(*points), marker="o", label=name)
    headroom.axhline(0, linestyle="--", color="grey")
    headroom.set_xlabel("module (in the model's order)")
    headroom.set_ylabel("log2(65,504 / max |value|)")
    headroom.set_title("float16 headroom per module", fontsize="medium")
    headroom.legend(fontsize="x-small", ncol=len(models))
    norms.set_xticks(range(len(layers)))
    norms.set_xticklabels(layers, rotation=90, fontsize="x-small")
    norms.set_yscale("log")
    norms.set_ylabel("gradient norm")
    norms.set_title("gradient norm per layer (per-token loss)", fontsize="medium")
    norms.legend(fontsize="small")
    save_figure(figure, path)


def plot_headroom_over_training(runs: Dict[str, Sequence[Tuple[int, Numerics]]], path: str) -> None:
    """Per run, the least headroom of each kind (activations, their gradients, parameter
    gradients) over all modules at each checkpoint's update (float16 overflows below the dashed
    line at 0; a gradient below the dotted line overflows at fairseq's initial loss scale, 2^7)."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(HEADROOMS), figsize=(5 * len(HEADROOMS), 4), sharex=True)
    for axis, (key, title) in zip(axes, HEADROOMS.items()):
        for name, series in runs.items():
            least = [min(_bits(row[key]) for row in numerics.module_rows()) for _update, numerics in series]
            axis.plot([update for update, _numerics in series],
                      [_plotted(None if bits == math.inf else bits) for bits in least], marker=".", label=name)
        if key != "activation_headroom_log2":
            axis.axhline(FAIRSEQ_INIT_SCALE_BITS, linestyle=":", color="grey", label="fairseq's initial loss scale")
        axis.axhline(0, linestyle="--", color="grey")
        axis.set_xlabel("updates")
        axis.set_ylabel("least log2(65,504 / max |value|)")
        axis.set_title(f"float16 headroom: {title}", fontsize="medium")
        axis.legend(fontsize="small")
    figure.suptitle("gradients of the loss summed over the batch, at loss scale 1", fontsize="small")
    save_figure(figure, path)
