"""Diversity of the Dual Contextual module's two FI units (thesis Fig. 5.4, §5.6.2).

For every encoder layer l with a DC module, ``alpha_g`` and ``alpha_l`` are the attention
weights of the FI units ``FI(r, r)`` and ``FI(r, l_c)``, each "represented by the attention
head with the maximum weight distribution among all N_h heads". The divergence of layer l is

    dv_l = JS(alpha_g || alpha_l) = 1/2 KL(alpha_g || m) + 1/2 KL(alpha_l || m),
    m = (alpha_g + alpha_l) / 2,

and the model's ``E_d = 1/L sum_l dv_l`` over its DC layers.

Readings [choice] (the thesis is ambiguous): ``max`` (default) takes the
element-wise maximum over heads and renormalises every query row; ``peak-head`` takes, per
query row, the one head whose row has the largest weight. The JS divergence is computed
per query row (natural log, so 0 <= JS <= ln 2) over the sentence's real keys and averaged
over all query rows of all sentences (pads excluded, EOS kept).

The weights come from the attention statistics' hook, which re-runs each FI unit (fairseq's
``MultiheadAttention``) with per-head weights.
"""
import contextlib
import functools
from typing import Dict, Iterable, List, Tuple

import numpy as np
import torch

from mlmha_fairseq.evaluation.attention_statistics import record_head_weights, encoder_layers
from mlmha_fairseq.evaluation.plotting import LINE_FIGSIZE, pyplot, save_figure
from mlmha_fairseq.evaluation.text_io import InputError

MAX, PEAK_HEAD = "max", "peak-head"
HEAD_REDUCTIONS = (MAX, PEAK_HEAD)
UNITS = ("global_interaction", "local_interaction")  # FI(r, r), FI(r, l_c)


def reduce_heads(weights: torch.Tensor, reduction: str = MAX) -> torch.Tensor:
    """``[heads, T, S]`` -> one ``[T, S]`` distribution per query row."""
    if reduction == MAX:
        peak = weights.max(dim=0).values
        return peak / peak.sum(dim=-1, keepdim=True)
    if reduction == PEAK_HEAD:
        head = weights.max(dim=-1).values.argmax(dim=0)  # T: the head of each row
        return weights.gather(0, head[None, :, None].expand(1, *weights.shape[1:]))[0]
    raise ValueError(f"unknown head reduction {reduction!r}; expected one of {HEAD_REDUCTIONS}")


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise Jensen-Shannon divergence (nats) of distributions ``[..., S]`` -> ``[...]``.

    Not ``scipy.spatial.distance.jensenshannon``: it returns the JS *distance* (the square
    root of the divergence) and takes numpy arrays, not the recorded torch weights."""
    p, q = p.to(torch.float64), q.to(torch.float64)
    m = (p + q) / 2
    kl_p = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(dim=-1)
    kl_q = (torch.special.xlogy(q, q) - torch.special.xlogy(q, m)).sum(dim=-1)
    return (kl_p + kl_q) / 2


def dc_encoder_layers(model) -> List[Tuple[int, torch.nn.Module]]:
    """``(0-based index, DC module)`` of every encoder layer whose self-attention is DC."""
    found = [(index, layer.self_attn) for index, layer in enumerate(encoder_layers(model))
             if all(hasattr(layer.self_attn, unit) for unit in UNITS)]
    if not found:
        raise InputError("the model has no encoder layer with the Dual Contextual module "
                         "(train it with --dc-encoder-layers)")
    return found


@contextlib.contextmanager
def recording_fi_units(model):
    """Within the context, each encoder forward fills ``records[unit][k]`` with the
    ``[heads, batch, T, S]`` weights of the k-th DC layer's FI unit."""
    modules = [module for _, module in dc_encoder_layers(model)]
    records = {unit: [None] * len(modules) for unit in UNITS}
    handles = [getattr(module, unit).register_forward_hook(
        functools.partial(record_head_weights, records[unit], index), with_kwargs=True)
        for unit in UNITS for index, module in enumerate(modules)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


class DiversityAccumulator:
    """Corpus sums of the row-wise JS divergence per DC layer."""

    def __init__(self, layers: List[int]):
        self.layers = layers  # 0-based encoder layer indices
        self.total = np.zeros(len(layers))
        self.rows = np.zeros(len(layers), dtype=np.int64)

    def update(self, position: int, global_weights: torch.Tensor, local_weights: torch.Tensor,
               reduction: str) -> None:
        """Add one sentence's ``[heads, n, n]`` weights (pads removed) of the DC layer at
        ``position``."""
        divergence = js_divergence(reduce_heads(global_weights, reduction),
                                   reduce_heads(local_weights, reduction))
        self.total[position] += divergence.sum().item()
        self.rows[position] += divergence.numel()

    def layer_divergence(self) -> np.ndarray:
        """``dv_l`` per DC layer."""
        return self.total / self.rows

    def mean_divergence(self) -> float:
        """``E_d``: the mean of ``dv_l`` over the DC layers."""
        return float(self.layer_divergence().mean())

    def table(self) -> List[Dict]:
        """One row per DC layer, 1-based as in the thesis' figure."""
        return [{"layer": layer + 1, "js_divergence": float(value), "rows": int(rows)}
                for layer, value, rows in zip(self.layers, self.layer_divergence(), self.rows)]


def fi_diversity(model, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]], pad: int,
                 reduction: str = MAX) -> DiversityAccumulator:
    """Run the encoder on ``(src_tokens, src_lengths)`` batches and accumulate ``dv_l``."""
    model.eval()
    accumulator = DiversityAccumulator([index for index, _ in dc_encoder_layers(model)])
    with recording_fi_units(model) as records, torch.no_grad():
        for src_tokens, src_lengths in batches:
            model.encoder(src_tokens, src_lengths=src_lengths)
            for sentence in range(src_tokens.size(0)):
                kept = src_tokens[sentence].ne(pad).nonzero(as_tuple=True)[0]
                for position in range(len(accumulator.layers)):
                    global_weights, local_weights = (
                        records[unit][position][:, sentence][:, kept][:, :, kept] for unit in UNITS)
                    accumulator.update(position, global_weights, local_weights, reduction)
    if not accumulator.rows.any():
        raise InputError("no sentences to analyse")
    return accumulator


def plot_fi_diversity(models: Dict[str, DiversityAccumulator], path: str) -> None:
    """Per model, ``dv_l`` over the encoder layers, ``E_d`` in the legend (Fig. 5.4)."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=LINE_FIGSIZE)
    for name, accumulator in models.items():
        layers = [layer + 1 for layer in accumulator.layers]
        axis.plot(layers, accumulator.layer_divergence(), marker="o",
                  label=f"{name} (E_d = {accumulator.mean_divergence():.4f})")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel("encoder layer")
    axis.set_ylabel("JS(alpha_g || alpha_l) (nats)")
    axis.set_title("diversity of the two FI units", fontsize="medium")
    axis.legend(fontsize="small")
    save_figure(figure, path)
