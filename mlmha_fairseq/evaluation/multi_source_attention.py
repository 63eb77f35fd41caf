"""Cross-attention weights of a multi-source model per source (Libovický et al. 2018,
Appendix A) and the hierarchical second-level weights per source and decoder layer
(Figure 2).

Weights are recorded with forward hooks on the combination sublayers' attentions
(:func:`mlmha_fairseq.evaluation.attention_statistics.recording_attention`, as every analysis of
the package records internals) on a teacher-forced pass over the reference translation,
averaged over heads. Padding is removed; EOS is kept.
For the hierarchical strategy the joint view multiplies each source's weights by that
source's second-level weight ([choice] both levels averaged over heads first).
"""
from typing import Dict, List, Sequence

import numpy as np
import torch

from mlmha_fairseq.data.multi_source_dataset import IMAGE
from mlmha_fairseq.evaluation.attention_statistics import recording_attention
from mlmha_fairseq.evaluation.plotting import pyplot, save_figure
from mlmha_fairseq.models.multi_source import combination_modules
from mlmha_fairseq.modules.input_combination import FLAT, HIERARCHICAL

HEATMAP_INCHES_PER_TOKEN = 0.22
MIN_FIGURE_INCHES = 3.0
MAX_TICK_LABELS = 60  # longer axes get no token labels (they would overlap)
IMAGE_POSITION = "#{}"  # column label of image position k


def recorded_attentions(module) -> list:
    """The fairseq ``MultiheadAttention``s of one combination sublayer whose weights
    :func:`record` needs: the per-source ones (one over the concatenation for the flat
    strategy), then the hierarchical second level."""
    attentions = list(module.attentions)
    if module.strategy == HIERARCHICAL:
        attentions.append(module.hier_attention)
    return attentions


def sublayer_weights(module, head_weights: List[torch.Tensor], source_lengths: List[int]
                   ) -> Dict[str, List[torch.Tensor]]:
    """``sources`` (and ``contexts``) of one sublayer from its attentions' ``H x B x T x S``
    weights, averaged over heads (fairseq's head-averaged weights are that mean)."""
    if module.strategy == FLAT:  # one joint distribution over S_1 + ... + S_n: split per source
        (joint,) = head_weights
        if joint.size(-1) != sum(source_lengths):
            raise ValueError(f"the flat attention spans {joint.size(-1)} memory positions, "
                             f"the sources {source_lengths}")
        return {"sources": list(joint.mean(dim=0).split(source_lengths, dim=-1))}
    weights = {"sources": [w.mean(dim=0) for w in head_weights[:module.num_sources]]}
    if module.strategy == HIERARCHICAL:
        # query 1 x (T*B) over the n contexts: H x (T*B) x 1 x n -> B x T x n
        (level,) = head_weights[module.num_sources:]
        batch_size, tgt_len = weights["sources"][0].shape[:2]
        weights["contexts"] = level.mean(dim=0).view(tgt_len, batch_size, module.num_sources).transpose(0, 1)
    return weights


def record(model, batch) -> List[Dict[str, List[torch.Tensor]]]:
    """Per decoder layer, the recorded ``sources`` (n tensors ``B x T x S_k``) and, for the
    hierarchical strategy, ``contexts`` (``B x T x n``) of one teacher-forced batch, averaged
    over heads (float32, on the CPU): forward hooks on each combination sublayer's
    attentions (:func:`~mlmha_fairseq.evaluation.attention_statistics.recording_attention`)."""
    modules = combination_modules(model)
    per_module = [recorded_attentions(module) for module in modules]
    # each source's memory is as long as its input: S_k tokens (the encoder keeps the
    # padding positions) or P image positions (B x P x C features)
    source_lengths = [inputs.size(1) for inputs in batch["net_input"]["multi_source_inputs"]]
    with recording_attention([a for attentions in per_module for a in attentions]) as records, \
            torch.no_grad():
        model(**batch["net_input"])
    layers, start = [], 0
    for module, attentions in zip(modules, per_module):
        layers.append(sublayer_weights(module, records[start : start + len(attentions)], source_lengths))
        start += len(attentions)
    return layers


def sentence_weights(records, batch, kinds: Sequence[str], pad: int) -> List[Dict[str, np.ndarray]]:
    """For each sentence of the batch: ``sources`` (per source, ``layers x T x S_k`` without
    padding) and, if recorded, ``contexts`` (``layers x T x n``)."""
    inputs = batch["net_input"]["multi_source_inputs"]
    target = batch["target"]
    sentences = []
    for row in range(target.size(0)):
        rows = target[row].ne(pad).nonzero(as_tuple=True)[0]
        sources = []
        for k, kind in enumerate(kinds):
            columns = (torch.arange(inputs[k].size(1)) if kind == IMAGE
                       else inputs[k][row].ne(pad).nonzero(as_tuple=True)[0])
            stacked = torch.stack([r["sources"][k][row] for r in records])  # layers x T x S_k
            sources.append(stacked[:, rows][:, :, columns].float().numpy())
        weights = {"sources": sources}
        if "contexts" in records[0]:
            weights["contexts"] = torch.stack([r["contexts"][row] for r in records])[:, rows].float().numpy()
        sentences.append(weights)
    return sentences


def joint_view(weights: Dict[str, np.ndarray], layer: int) -> np.ndarray:
    """``T x (S_1 + ... + S_n)`` of decoder layer ``layer`` (0-based): the per-source weights
    side by side, each scaled by its second-level weight for the hierarchical strategy."""
    blocks = []
    for k, source in enumerate(weights["sources"]):
        block = source[layer]
        if "contexts" in weights:
            block = block * weights["contexts"][layer][:, k : k + 1]
        blocks.append(block)
    return np.concatenate(blocks, axis=1)


def mean_context_weights(sentences: Sequence[Dict[str, np.ndarray]]) -> np.ndarray:
    """Figure 2: ``layers x n`` mean second-level weight, averaged over target positions and
    sentences (every target position counts once)."""
    stacked = np.concatenate([s["contexts"] for s in sentences], axis=1)  # layers x ΣT x n
    return stacked.mean(axis=1)


def source_labels(tokens: Sequence[Sequence[str]], names: Sequence[str]) -> List[str]:
    return [f"{name}:{token}" for name, words in zip(names, tokens) for token in words]


def image_tokens(positions: int) -> List[str]:
    return [IMAGE_POSITION.format(k) for k in range(positions)]


def plot_joint_attention(weights: np.ndarray, target_tokens: Sequence[str], column_labels: Sequence[str],
                         boundaries: Sequence[int], path: str, title: str) -> None:
    """Appendix A: target tokens (rows) against the concatenated source tokens (columns),
    with a line between sources."""
    plt = pyplot()
    rows, columns = weights.shape
    figure, axis = plt.subplots(figsize=(max(MIN_FIGURE_INCHES, columns * HEATMAP_INCHES_PER_TOKEN),
                                         max(MIN_FIGURE_INCHES, rows * HEATMAP_INCHES_PER_TOKEN)))
    image = axis.imshow(weights, cmap="Greys", vmin=0.0, vmax=max(float(weights.max()), 1e-9), aspect="auto")
    for boundary in boundaries:
        axis.axvline(boundary - 0.5, color="tab:red", linewidth=1)
    if columns <= MAX_TICK_LABELS:
        axis.set_xticks(range(columns))
        axis.set_xticklabels(column_labels, rotation=90, fontsize="x-small")
    if rows <= MAX_TICK_LABELS:
        axis.set_yticks(range(rows))
        axis.set_yticklabels(target_tokens, fontsize="x-small")
    axis.set_title(title, fontsize="small")
    figure.colorbar(image, ax=axis)
    save_figure(figure, path)


def plot_context_weights(means: np.ndarray, names: Sequence[str], path: str) -> None:
    """Figure 2: second-level weight of each source (rows) per decoder layer (columns, 0-based
    as in the paper), on a 0-1 scale."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(max(MIN_FIGURE_INCHES, 0.7 * means.shape[0] + 1.5),
                                         max(2.0, 0.5 * len(names) + 1.0)))
    image = axis.imshow(means.T, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    axis.set_xticks(range(means.shape[0]))
    axis.set_xlabel("decoder layer")
    axis.set_yticks(range(len(names)))
    axis.set_yticklabels(names)
    for layer in range(means.shape[0]):
        for k in range(len(names)):
            axis.text(layer, k, f"{means[layer, k]:.2f}", ha="center", va="center", fontsize="x-small",
                      color="white" if means[layer, k] < 0.5 else "black")
    figure.colorbar(image, ax=axis)
    save_figure(figure, path)
