"""Auxiliary Information Fusion, AIF (thesis Eqs. 4.2-4.3, Fig. 4.4).

The Auxiliary Feature Collector gathers ``F^a = [f^1, ..., f^n]``, the final hidden states
of the n auxiliary decoders for the same target prefix (each ``T x B x C``). In every
Main-Decoder layer l, right after the masked self-attention sublayer,

    z^f_l = sum_{i=1..n} f^i W_l^{a_i},    W_l^{a_i} in R^{d x d}, no bias,
    h^_l  <- h^_l + z^f_l                                              (Eq. 4.3)

This module is one layer's ``z^f_l``. The n matrices are stored as one bias-free
``Linear(n d -> d)`` applied to the concatenation ``[f^1; ...; f^n]``, which is the same sum
(its weight is ``[W_l^{a_1}; ...; W_l^{a_n}]``) in one matrix product. It holds exactly
``n d^2`` parameters, so AIF adds ``L n d^2`` to an L-layer Main-Decoder (thesis §4.2;
+0.26 M = 4 x 256^2 per auxiliary decoder on the small model, the 17.0 -> 17.3 M of Table 4.6a;
+1.57 M = 6 x 512^2 on base, MS-4's 86.5 M against MS-1+AIF's 88.0 M in Table 5.2).

[choice] No LayerNorm around the addition (the thesis mentions none); optional dropout on
``z^f`` (``dropout``, default 0, i.e. none).
"""
from typing import Sequence

import torch
from fairseq.modules import FairseqDropout
from torch import Tensor, nn


class AuxiliaryInformationFusion(nn.Module):
    """``z^f_l = sum_i f^i W_l^{a_i}`` for one Main-Decoder layer (Eq. 4.2)."""

    def __init__(self, embed_dim: int, num_aux: int, dropout: float = 0.0):
        super().__init__()
        if num_aux < 1:
            raise ValueError(f"AIF needs at least one auxiliary decoder, got {num_aux}")
        self.num_aux = num_aux
        self.proj = nn.Linear(num_aux * embed_dim, embed_dim, bias=False)
        nn.init.xavier_uniform_(self.proj.weight)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)

    def forward(self, aux_features: Tensor) -> Tensor:
        """``aux_features``: ``[f^1; ...; f^n]`` concatenated on the channels,
        T x B x (n C); returns ``z^f``, T x B x C."""
        return self.dropout_module(self.proj(aux_features))

    def weights(self) -> Sequence[Tensor]:
        """The n matrices ``W_l^{a_i}`` (each C_in x C_out, as in ``f^i W``)."""
        return torch.chunk(self.proj.weight.t(), self.num_aux, dim=0)
