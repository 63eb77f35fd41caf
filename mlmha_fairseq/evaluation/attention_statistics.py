"""Encoder self-attention mean distance and entropy per layer and head.

As in the thesis (§3.5.3) and Ampomah et al. 2020 (§7.3, Eqs. 13-16, after Vig & Belinkov
2019), with ``w_ij^h`` the probability of query token i attending to key token j in head h:

- Eq. 13, mean distance of head h in layer l over the corpus X:
  ``D_h = sum_x sum_i sum_{j<=i} w_ij (i - j) / sum_x sum_i sum_{j<=i} w_ij``
- Eq. 14: ``D^l = mean_h D_h``
- Eq. 15, entropy of token i: ``E_h(x_i) = - sum_{j<=i} w_ij log w_ij``
- Eq. 16: ``E^l(x_i) = mean_h E_h(x_i)``, averaged over all tokens of all sentences.

The ``j <= i`` limit comes from a causal LM although the encoder is bidirectional: it is the
default (literal formulas); ``full_row=True`` sums over every j with ``|i - j|``. Padding is
always excluded; EOS is kept unless ``exclude_eos`` (rows are not renormalised either way).

These statistics are written by hand: no library computes them.
"""
import contextlib
import functools
import inspect
from typing import Iterable, List, Tuple

import numpy as np
import torch

from mlmha_fairseq.evaluation.text_io import InputError


def _key_mask(length: int, full_row: bool) -> torch.Tensor:
    """``mask[i, j]`` = 1 where key j enters the sums for query i (``j <= i`` or all j)."""
    ones = torch.ones(length, length, dtype=torch.float64)
    return ones if full_row else torch.tril(ones)


def _offsets(length: int) -> torch.Tensor:
    """``|i - j|``; equal to ``i - j`` wherever ``j <= i``."""
    positions = torch.arange(length, dtype=torch.float64)
    return (positions[:, None] - positions[None, :]).abs()


def distance_sums(weights: torch.Tensor, full_row: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Numerator and denominator of Eq. 13 for one sentence.

    ``weights``: ``[heads, n, n]`` attention probabilities without padding.
    Returns two ``[heads]`` arrays.
    """
    w = weights.to(torch.float64) * _key_mask(weights.size(-1), full_row)
    numerator = (w * _offsets(weights.size(-1))).sum(dim=(-2, -1))
    return numerator.numpy(), w.sum(dim=(-2, -1)).numpy()


def entropy_sums(weights: torch.Tensor, full_row: bool = False) -> np.ndarray:
    """Sum over the sentence's tokens i of Eq. 15's ``E_h(x_i)`` (``0 log 0 = 0``).

    ``weights``: ``[heads, n, n]``; returns a ``[heads]`` array.
    """
    w = weights.to(torch.float64) * _key_mask(weights.size(-1), full_row)
    return (-torch.special.xlogy(w, w).sum(dim=(-2, -1))).numpy()


class AttentionStatistics:
    """Corpus accumulator of Eqs. 13-16 for ``layers`` x ``heads``."""

    def __init__(self, layers: int, heads: int, full_row: bool = False):
        self.full_row = full_row
        self.distance_numerator = np.zeros((layers, heads))
        self.distance_denominator = np.zeros((layers, heads))
        self.entropy_total = np.zeros((layers, heads))
        self.tokens = np.zeros(layers)

    def update(self, layer: int, weights: torch.Tensor) -> None:
        """Add one sentence's ``[heads, n, n]`` weights of ``layer``."""
        numerator, denominator = distance_sums(weights, self.full_row)
        self.distance_numerator[layer] += numerator
        self.distance_denominator[layer] += denominator
        self.entropy_total[layer] += entropy_sums(weights, self.full_row)
        self.tokens[layer] += weights.size(-1)

    def head_distance(self) -> np.ndarray:
        """Eq. 13, ``[layers, heads]``."""
        return self.distance_numerator / self.distance_denominator

    def head_entropy(self) -> np.ndarray:
        """Eq. 15 averaged over tokens, ``[layers, heads]``."""
        return self.entropy_total / self.tokens[:, None]

    def layer_distance(self) -> np.ndarray:
        """Eq. 14, ``[layers]``."""
        return self.head_distance().mean(axis=1)

    def layer_entropy(self) -> np.ndarray:
        """Eq. 16 averaged over tokens, ``[layers]``."""
        return self.head_entropy().mean(axis=1)

    def rows(self) -> List[dict]:
        """One row per (layer, head), 1-based as in the documents' figures."""
        distance, entropy = self.head_distance(), self.head_entropy()
        return [{"layer": l + 1, "head": h + 1, "distance": distance[l, h], "entropy": entropy[l, h]}
                for l in range(distance.shape[0]) for h in range(distance.shape[1])]


def encoder_layers(model) -> list:
    """``model.encoder.layers`` (or ``model.layers`` for a bare encoder)."""
    encoder = getattr(model, "encoder", model)
    layers = getattr(encoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise InputError("the model has no encoder.layers[i].self_attn to analyse")
    return list(layers)


def _keyword_arguments(function, args, kwargs) -> dict:
    """The arguments of a call as keywords (a ``**kwargs`` parameter merged in)."""
    signature = inspect.signature(function)
    bound = signature.bind(*args, **kwargs).arguments
    call = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        else:
            call[name] = value
    return call


def record_head_weights(records: list, index: int, module, args, kwargs, _output) -> None:
    """Forward hook (``with_kwargs=True``) of a fairseq ``MultiheadAttention``: stores the
    per-head weights (H x B x T x S) of the same call in ``records[index]``."""
    # The encoder layer calls self_attn with need_weights=False; call it again with per-head
    # weights. fairseq's MultiheadAttention otherwise takes torch's fast path, which returns
    # head-averaged weights; skip_embed_dim_check disables that path.
    call = _keyword_arguments(module.forward, args, kwargs)
    call.update(need_weights=True, need_head_weights=True)
    fast_path_flag = getattr(module, "skip_embed_dim_check", None)
    if fast_path_flag is not None:
        module.skip_embed_dim_check = True
    try:
        _, weights = module.forward(**call)
    finally:
        if fast_path_flag is not None:
            module.skip_embed_dim_check = fast_path_flag
    records[index] = weights.detach().float().cpu()


@contextlib.contextmanager
def recording_attention(modules):
    """Within the context, each forward of ``modules[i]`` (fairseq ``MultiheadAttention``s)
    fills ``records[i]`` with its ``[heads, batch, tgt, src]`` attention probabilities."""
    records = [None] * len(modules)
    handles = [module.register_forward_hook(
        functools.partial(record_head_weights, records, index), with_kwargs=True)
        for index, module in enumerate(modules)]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def recording_self_attention(model):
    """:func:`recording_attention` of every encoder layer's self-attention."""
    return recording_attention([layer.self_attn for layer in encoder_layers(model)])


def _kept_positions(tokens: torch.Tensor, pad: int, eos: int, exclude_eos: bool) -> torch.Tensor:
    keep = tokens.ne(pad)
    if exclude_eos:
        keep &= tokens.ne(eos)
    return keep.nonzero(as_tuple=True)[0]


def encoder_attention_statistics(model, batches: Iterable[Tuple[torch.Tensor, torch.Tensor]],
                                 pad: int, eos: int, full_row: bool = False,
                                 exclude_eos: bool = False) -> AttentionStatistics:
    """Run the encoder on ``(src_tokens, src_lengths)`` batches and accumulate Eqs. 13-16."""
    model.eval()
    stats = None
    with recording_self_attention(model) as records, torch.no_grad():
        for src_tokens, src_lengths in batches:
            model.encoder(src_tokens, src_lengths=src_lengths)
            if stats is None:
                stats = AttentionStatistics(len(records), records[0].size(0), full_row)
            for sentence in range(src_tokens.size(0)):
                kept = _kept_positions(src_tokens[sentence], pad, eos, exclude_eos)
                for layer, weights in enumerate(records):
                    sentence_weights = weights[:, sentence][:, kept][:, :, kept]
                    stats.update(layer, sentence_weights)
    if stats is None:
        raise InputError("no sentences to analyse")
    return stats
