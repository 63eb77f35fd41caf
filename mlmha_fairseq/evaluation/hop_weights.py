"""The SA fusion's hop weights during forced decoding (MLRF paper §4.8, Figure 5).

``a_p^l`` (Eq. 6) is the weight of hop p on layer l at one position. On the decoder side a
position j reads the target prefix ``</s> y_1 .. y_{j-1}`` (token ``y_{j-1}`` is "fed in")
and predicts ``y_j``; forced decoding feeds the reference, as teacher forcing does. The
weights are taken from the fusion's :class:`~mlmha_fairseq.modules.representation_fusion.LayerAttention`
with a forward hook, so the model runs unchanged.
"""
import contextlib
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch

from mlmha_fairseq.evaluation.plotting import pyplot, save_figure
from mlmha_fairseq.evaluation.text_io import InputError
from mlmha_fairseq.models.representation_fusion import DECODER, ENCODER, FUSION_FLAG, LayerFusion
from mlmha_fairseq.modules.representation_fusion import SA, LayerAttention

SIDES = (DECODER, ENCODER)
PANEL_INCHES_PER_TOKEN = 0.35
PANEL_INCHES_PER_LAYER = 0.3
MIN_PANEL_INCHES = 2.0
MAX_TICK_LABELS = 60  # longer sentences get no token labels (they would overlap)


def fusion_of(model, side: str) -> LayerFusion:
    """The MLRF fusion of ``side``; an :class:`InputError` unless it is an SA fusion."""
    if side == ENCODER:  # one of the encoder's memory modules (slot_transformer's memory slot)
        candidates = list(getattr(model.encoder, "memories", {}).values())
    else:
        candidates = [getattr(model.decoder, "output_fusion", None)]
    fusion = next((module for module in candidates if isinstance(module, LayerFusion)), None)
    if fusion is None or not isinstance(
            getattr(fusion.fusion, "attention", None), LayerAttention):
        raise InputError(f"the model has no SA fusion on the {side} side "
                         f"(trained with {FUSION_FLAG[side]} {SA}?)")
    return fusion


def layer_labels(fusion: LayerFusion) -> List[str]:
    """``l0 .. lL`` for the fused layers (``l1 .. lL`` without the embedding layer)."""
    return [f"l{layer}" for layer in range(fusion.first_layer, fusion.num_layers + 1)]


@contextlib.contextmanager
def recording_hop_weights(fusion: LayerFusion) -> Iterator[List[torch.Tensor]]:
    """Collect the hop weights (T x B x n_hop x K) of every forward call of ``fusion``."""
    records: List[torch.Tensor] = []
    handle = fusion.fusion.attention.register_forward_hook(
        lambda module, inputs, output: records.append(output.detach().float().cpu()))
    try:
        yield records
    finally:
        handle.remove()


def decoder_input(target: torch.Tensor, eos: int) -> torch.Tensor:
    """fairseq's ``prev_output_tokens`` of one target (EOS included): ``</s> y_1 .. y_n``."""
    return torch.cat([target.new_tensor([eos]), target[:-1]])


def forced_decoding_hop_weights(model, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], eos: int,
                                side: str = DECODER) -> List[np.ndarray]:
    """For each ``(source, target)`` pair (token ids, EOS included), the hop weights
    ``n_hop x K x T`` of ``side`` (T = target length on the decoder side, source length on
    the encoder side), one sentence at a time, so that there is no padding."""
    fusion = fusion_of(model, side)
    model.eval()
    weights = []
    with recording_hop_weights(fusion) as records, torch.no_grad():
        for source, target in pairs:
            model(source[None], torch.tensor([source.numel()]), decoder_input(target, eos)[None])
            weights.append(records.pop()[:, 0].permute(1, 2, 0).numpy())  # n_hop x K x T
    return weights


def plot_hop_weights(weights: np.ndarray, layers: Sequence[str], tokens: Sequence[str], path: str,
                     title: str = "") -> None:
    """Figure 5: one heat map per hop, layers (bottom to top) by positions."""
    plt = pyplot()
    hops, num_layers, length = weights.shape
    width = max(MIN_PANEL_INCHES, length * PANEL_INCHES_PER_TOKEN) + 1.5
    height = max(MIN_PANEL_INCHES, num_layers * PANEL_INCHES_PER_LAYER + 1.0)
    figure, axes = plt.subplots(hops, 1, figsize=(width, hops * height), squeeze=False)
    for hop, axis in enumerate(axes[:, 0]):
        image = axis.imshow(weights[hop], cmap="Blues", aspect="auto", origin="lower",
                            vmin=0.0, vmax=float(weights.max()))  # one scale for all hops
        axis.set_yticks(range(num_layers))
        axis.set_yticklabels(layers)
        if length <= MAX_TICK_LABELS:
            axis.set_xticks(range(length))
            axis.set_xticklabels(tokens, rotation=90)
        axis.set_title(f"{title} hop {hop + 1}".strip(), fontsize="medium")
        figure.colorbar(image, ax=axis)
    save_figure(figure, path)


def plot_hop_weights_over_training(updates: Sequence[int], mean_weights: np.ndarray,
                                   layers: Sequence[str], path: str) -> None:
    """The mean weight of each layer against the update of each checkpoint, one panel per
    hop; ``mean_weights``: checkpoints x n_hop x K."""
    plt = pyplot()
    hops = mean_weights.shape[1]
    figure, axes = plt.subplots(1, hops, figsize=(4.5 * hops + 1.5, 3.2), squeeze=False)
    for hop, axis in enumerate(axes[0]):
        for index, layer in enumerate(layers):
            axis.plot(updates, mean_weights[:, hop, index], marker=".", label=layer)
        axis.set_ylim(0.0, 1.0)
        axis.set_xlabel("updates")
        axis.set_ylabel("mean weight")
        axis.set_title(f"hop {hop + 1}", fontsize="medium")
    axes[0, -1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(figure, path)
