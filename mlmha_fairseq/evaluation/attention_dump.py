"""Per-head encoder self-attention weights of chosen sentences (the MMA paper's Figure 3).

The weights come from the attention statistics' hook
(:func:`~mlmha_fairseq.evaluation.attention_statistics.recording_self_attention`), which
re-runs every encoder self-attention with per-head weights; padding rows and columns are
removed, EOS is kept (it is a position of the model's input, and MMA's windows count it).
"""
from typing import List, Sequence

import numpy as np
import torch

from mlmha_fairseq.evaluation.attention_statistics import encoder_layers, recording_self_attention
from mlmha_fairseq.evaluation.model_loading import DEFAULT_BATCH_SIZE, batches
from mlmha_fairseq.evaluation.plotting import pyplot, save_figure

GLOBAL_HEAD = "G"  # a head of fairseq's own self-attention sees every key
HEATMAP_INCHES_PER_TOKEN = 0.22
MIN_PANEL_INCHES = 1.8
MAX_TICK_LABELS = 40  # longer sentences get no token labels (they would overlap)


def head_types(model) -> List[List[str]]:
    """Per encoder layer, the type of each head (``G`` for fairseq's self-attention)."""
    return [list(getattr(layer.self_attn, "head_types", None)
                 or [GLOBAL_HEAD] * layer.self_attn.num_heads)
            for layer in encoder_layers(model)]


def sentence_attention(model, token_lists: Sequence[torch.Tensor], dictionary, left_pad: bool = True,
                       batch_size: int = DEFAULT_BATCH_SIZE) -> List[np.ndarray]:
    """For each sentence (token ids, EOS included), its ``[layers, heads, n, n]`` attention
    probabilities (rows: query positions, columns: key positions)."""
    model.eval()
    weights = []
    with recording_self_attention(model) as records, torch.no_grad():
        for src_tokens, src_lengths in batches(token_lists, dictionary, batch_size, left_pad):
            model.encoder(src_tokens, src_lengths=src_lengths)
            stacked = torch.stack(records, dim=1)  # H x L x B x T x S -> per sentence below
            for sentence in range(src_tokens.size(0)):
                kept = src_tokens[sentence].ne(dictionary.pad()).nonzero(as_tuple=True)[0]
                per_sentence = stacked[:, :, sentence][:, :, kept][:, :, :, kept]
                weights.append(per_sentence.transpose(0, 1).numpy())
    return weights


def plot_sentence_attention(tokens: Sequence[str], weights: np.ndarray, types: Sequence[Sequence[str]],
                            path: str, title: str = "") -> None:
    """Heat maps of one sentence, one panel per layer (rows) and head (columns)."""
    plt = pyplot()
    layers, heads, length, _ = weights.shape
    panel = max(MIN_PANEL_INCHES, length * HEATMAP_INCHES_PER_TOKEN)
    figure, axes = plt.subplots(layers, heads, figsize=(heads * panel, layers * panel), squeeze=False)
    labelled = length <= MAX_TICK_LABELS
    for layer in range(layers):
        for head in range(heads):
            axis = axes[layer][head]
            axis.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0)
            axis.set_title(f"layer {layer + 1} head {head + 1} ({types[layer][head]})", fontsize="small")
            ticks = range(length) if labelled else []
            axis.set_xticks(ticks)
            axis.set_yticks(ticks)
            if labelled:
                axis.set_xticklabels(tokens, rotation=90, fontsize="x-small")
                axis.set_yticklabels(tokens, fontsize="x-small")
    figure.suptitle(f"{title} (rows: queries, columns: keys)".strip())
    save_figure(figure, path)
