"""Dynamic linear combination of layers, DLCL (Wang et al. 2019, "Learning Deep Transformer
Models for Machine Translation", §3.2).

The input of layer l+1 of a stack is a learned linear combination of the outputs of every
layer below it, the embedding output ``y_0`` included (Wang et al. 2019, §3, the layer input G):
``x_{l+1} = G(y_0, ..., y_l)`` with

* pre-norm: ``x_{l+1} = sum_{k=0}^{l} W_{l+1,k} LN_k(y_k)``;
* post-norm: ``x_{l+1} = LN_{l+1}(sum_{k=0}^{l} W_{l+1,k} y_k)``;

and the stack's output is the same combination over all L+1 outputs (row L+1). ``W`` is
lower-triangular, one scalar per (row, earlier layer): (L+1)(L+2)/2 scalars.

Readings of the authors' code where the equations leave a choice (marked [code]):

* the embedding output ``y_0`` is never normalised: pre-norm normalises ``y_1..y_L``, and in
  post-norm the first layer's input is ``W_{1,0} y_0`` without a LayerNorm; either way the
  stack has L LayerNorms;
* every row starts as the average, ``W_{l+1,k} = 1 / (l+1)``.

The layer loop belongs to the caller, which keeps the history: :meth:`store` turns ``y_k``
into what the history keeps (pre-norm: ``LN_k(y_k)``, computed once per layer rather than once
per later row), :meth:`combine` reads the history ``[y_0', ..., y_l']`` and returns
``x_{l+1}``. Everything is position-wise, so it needs no padding mask and no incremental state.
"""
from typing import List

import torch
from fairseq.modules import LayerNorm
from torch import Tensor, nn


class DynamicLinearCombination(nn.Module):
    """DLCL over a stack of ``num_layers`` layers of width ``embed_dim``.

    ``weights[l]``: row l+1 of ``W``, ``l+1`` scalars over ``y_0..y_l`` (l = 0..L; row L+1
    makes the stack's output). ``layer_norms[k-1]``: pre-norm, the LayerNorm of ``y_k``
    (k = 1..L); post-norm, the LayerNorm after the sum of row k+1.
    """

    def __init__(self, num_layers: int, embed_dim: int, normalize_before: bool):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"DLCL needs at least one layer, got {num_layers}")
        self.num_layers = num_layers
        self.normalize_before = normalize_before
        # [code] the average: row l+1 gives each of its l+1 inputs 1/(l+1), so that the
        # untrained combination is the mean of the layers below (the scale of one layer).
        self.weights = nn.ParameterList(
            nn.Parameter(torch.full((row,), 1.0 / row)) for row in range(1, num_layers + 2)
        )
        self.layer_norms = nn.ModuleList(LayerNorm(embed_dim) for _ in range(num_layers))

    def store(self, index: int, state: Tensor) -> Tensor:
        """What the history keeps of ``y_index`` (T x B x C): pre-norm ``LN_index(y_index)``
        (pre-norm G) for index >= 1; ``y_index`` itself otherwise (the authors' code leaves ``y_0`` unnormalised)."""
        if self.normalize_before and index > 0:
            return self.layer_norms[index - 1](state)
        return state

    def combine(self, history: List[Tensor]) -> Tensor:
        """``x_{l+1}`` (T x B x C) from the stored ``[y_0', ..., y_l']`` (l+1 tensors T x B x C).

        A running sum rather than a stacked einsum: a stack of the history would be kept for
        the backward pass of every row, L^2 / 2 copies of the layer outputs in all."""
        row = len(history)
        if not 1 <= row <= self.num_layers + 1:
            raise ValueError(f"DLCL combines 1..{self.num_layers + 1} layer outputs, got {row}")
        weights = self.weights[row - 1].to(history[0].dtype)
        combined = weights[0] * history[0]
        for weight, state in zip(weights[1:], history[1:]):
            combined = combined + weight * state
        if self.normalize_before or row == 1:
            return combined  # pre-norm G; the authors' code puts no LayerNorm on W_{1,0} y_0 in post-norm
        return self.layer_norms[row - 2](combined)  # post-norm G

    def matrix(self) -> Tensor:
        """``W`` as an (L+1) x (L+1) lower-triangular matrix, row l (0-based) = the weights of
        the input of layer l+1 (row L: the stack's output); for analysis."""
        size = self.num_layers + 1
        matrix = self.weights[0].new_zeros(size, size)
        for row, weights in enumerate(self.weights):
            matrix[row, : row + 1] = weights.detach()
        return matrix
