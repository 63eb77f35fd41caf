"""Layer aggregation (thesis §3.2.1): one joint source memory.

Every module maps stacked encoder states ``n x T x B x C`` (bottom to top) to
the memory that replaces ``H_e^L`` as keys/values of every decoder
cross-attention: ``T x B x C`` for the four thesis variants, one memory per
decoder layer (``M x T x B x C``) for Transparent Attention.
"""

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import FairseqDropout, LayerNorm
from torch import Tensor, nn

# The iterative variants combine two inputs per step: [previous aggregate; new tap].
PAIR = 2


class WeightedSum(nn.Module):
    """WS unit (Eq. 3.1): ``sum_i r_i W^i``, a full d x d matrix per input.

    Over all n taps it is S-Agg (Fig. 3.2a; the MLMHA paper's Linear Feature
    Combination). No bias, no LayerNorm, no activation [code ``LinearAggregation``].
    ``weight``: b x C x C, slice i stored out x in like ``nn.Linear``.
    """

    def __init__(self, num_inputs: int, embed_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_inputs, embed_dim, embed_dim))
        for input_weight in self.weight:
            # [choice] Glorot uniform per matrix, the Keras Dense default of [code].
            nn.init.xavier_uniform_(input_weight)

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs``: b x T x B x C -> T x B x C."""
        return torch.einsum("itbc,idc->tbd", inputs, self.weight)


class Aggregate(nn.Module):
    """AGG unit (Eq. 3.3): ``LN(Dropout(FFN(Concat(r_1..r_b))) + sum_i r_i)``.

    Over all n taps it is C-Agg (Fig. 3.2c, Eq. 3.4).
    FFN: b*C -> d_ff -> C with ReLU and activation dropout [code
    ``SimpleIterativeAggregatorNode``]; the concatenation is along channels.
    """

    def __init__(
        self,
        num_inputs: int,
        embed_dim: int,
        ffn_embed_dim: int,
        dropout: float,
        activation_dropout: float,
    ):
        super().__init__()
        self.fc1 = nn.Linear(num_inputs * embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.activation_dropout_module = FairseqDropout(
            activation_dropout, module_name=self.__class__.__name__
        )
        self.dropout_module = FairseqDropout(
            dropout, module_name=self.__class__.__name__
        )
        self.layer_norm = LayerNorm(embed_dim)

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs``: b x T x B x C -> T x B x C."""
        num_inputs, length, bsz, embed_dim = inputs.shape
        # b x T x B x C -> T x B x (b*C), input-major channels
        concat = inputs.permute(1, 2, 0, 3).reshape(length, bsz, num_inputs * embed_dim)
        hidden = self.activation_dropout_module(F.relu(self.fc1(concat)))
        residual = inputs.sum(dim=0)
        return self.layer_norm(self.dropout_module(self.fc2(hidden)) + residual)


class IterativeAggregation(nn.Module):
    """Iterative scheme (Eqs. 3.2 / 3.5): ``H_1 = f_1``, ``H_i = U_i([H_{i-1}; f_i])``.

    ``U_i`` (i = 2..n, unshared) is a WS unit (Iter-S-Agg) or an AGG unit
    (Iter-C-Agg). The thesis writes ``[f_i, H_{i-1}]``; the input order is
    [previous aggregate; new tap] as in the authors' code [code]. For a WS unit
    the order only fixes the parameter layout; for AGG it fixes the
    concatenation. Either way n = 2 is exactly the non-iterative variant.
    """

    def __init__(self, num_taps: int, build_unit: Callable[[], nn.Module]):
        super().__init__()
        self.units = nn.ModuleList(build_unit() for _ in range(num_taps - 1))

    def forward(self, taps: Tensor) -> Tensor:
        """``taps``: n x T x B x C -> T x B x C."""
        aggregate = taps[0]
        for unit, tap in zip(self.units, taps[1:]):
            aggregate = unit(torch.stack((aggregate, tap), dim=0))
        return aggregate


class TransparentCombination(nn.Module):
    """Transparent Attention (Bapna et al. 2018, §3).

    Decoder layer j attends to ``z_j = sum_i softmax_i(W[:, j]) H_e^i`` over all
    L+1 encoder states, the embedding output included. ``weight``:
    (L+1) x M scalars, initialised to zeros (uniform mixture).
    """

    def __init__(self, num_states: int, num_decoder_layers: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_states, num_decoder_layers))

    def forward(self, states: Tensor) -> Tensor:
        """``states``: (L+1) x T x B x C -> M x T x B x C."""
        mixture = utils.softmax(self.weight, dim=0).type_as(states)  # (L+1) x M
        return torch.einsum("lm,ltbc->mtbc", mixture, states)


# Thesis §3.2.1 names, then the MLMHA paper's names for its re-implemented baselines (its §5.4).
S_AGG, ITER_S_AGG, C_AGG, ITER_C_AGG = "s-agg", "iter-s-agg", "c-agg", "iter-c-agg"
LAYER_AGGREGATION_NAMES = (S_AGG, ITER_S_AGG, C_AGG, ITER_C_AGG)
LAYER_AGGREGATION_ALIASES: Dict[str, str] = {
    "linear-combination": S_AGG,
    "iterative-combination": ITER_C_AGG,
}
LAYER_AGGREGATION_CHOICES = LAYER_AGGREGATION_NAMES + tuple(LAYER_AGGREGATION_ALIASES)


def build_layer_aggregation(
    name: str,
    num_taps: int,
    embed_dim: int,
    ffn_embed_dim: int,
    dropout: float,
    activation_dropout: float,
) -> nn.Module:
    """Build a thesis §3.2.1 aggregation (taps n x T x B x C -> T x B x C) by name.

    S-Agg: ``WS([f_1..f_n])`` (Fig. 3.2a); Iter-S-Agg: iterated 2-input WS
    (Eq. 3.2); C-Agg: ``AGG([f_1..f_n])`` (Eq. 3.4); Iter-C-Agg: iterated
    2-input AGG (Eq. 3.5).
    """
    canonical = LAYER_AGGREGATION_ALIASES.get(name, name)
    if canonical not in LAYER_AGGREGATION_NAMES:
        raise ValueError(
            f"unknown layer aggregation {name!r}; "
            f"expected one of {LAYER_AGGREGATION_CHOICES}"
        )
    if num_taps < 1:
        raise ValueError(f"the number of taps n must be >= 1, got {num_taps}")

    def aggregate(num_inputs: int) -> Aggregate:
        return Aggregate(
            num_inputs, embed_dim, ffn_embed_dim, dropout, activation_dropout
        )

    if canonical == S_AGG:
        return WeightedSum(num_taps, embed_dim)
    if canonical == ITER_S_AGG:
        return IterativeAggregation(num_taps, lambda: WeightedSum(PAIR, embed_dim))
    if canonical == C_AGG:
        return aggregate(num_taps)
    return IterativeAggregation(num_taps, lambda: aggregate(PAIR))
