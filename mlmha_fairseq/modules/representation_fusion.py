"""Multi-layer Representation Fusion (MLRF; Wang et al., COLING 2018, §3).

A fusion layer reads the representations of K layers at one position,
``Z_j = [z_j^0, ..., z_j^L]`` (layer 0 = the embedding output, paper footnote 2), and
returns one vector ``phi(Z_j)`` of the same width (Eq. 3), followed by a LayerNorm:

* AVG (§3.2 "Fusion by Pooling"): ``phi(Z_j) = (1/K) sum_l z_j^l``;
* FNN (§3.2 "Fusion by Feed-forward Neural Network"):
  ``phi(Z_j) = FNN([z~_j^0; ...; z~_j^L])``, one hidden layer over the concatenation;
* SA (§3.2 "Fusion by Multi-hop Self Attention", Eqs. 4-7):
  ``phi(Z_j) = FNN(SelfAtt(Z_j))``, multi-hop attention over the depth axis.

``z~^l = z^l + E_l`` adds the learned layer embedding (Eq. 4). The caller owns the
embedding table (one table is shared by the encoder and the decoder, §3.2) and passes the
rows of the fused layers, ``K x C``. Every module takes the stacked states
``K x T x B x C`` (bottom to top) and returns ``T x B x C``; the fusion is position-wise,
so it is causal and needs no incremental state.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import FairseqDropout, LayerNorm
from torch import Tensor, nn

AVG, FNN, SA = "avg", "fnn", "sa"
FUSION_FUNCTIONS = (AVG, FNN, SA)
# [paper] §4.2: the layer embedding is initialised with U(-0.1, 0.1).
LAYER_EMBEDDING_INIT_RANGE = 0.1


@dataclass(frozen=True)
class FusionOptions:
    """Hyper-parameters of the fusion functions; the defaults are the paper's De-En
    settings (§4.2: d_a = 1024, d_f = 512; n_hop = 4 as in Tables 2-3) and this package's
    readings of what the paper leaves open (marked [choice])."""

    hops: int = 4
    attention_dim: int = 1024  # d_a
    ffn_dim: int = 512  # d_f
    attention_activation: str = "tanh"  # sigma of Eq. 5 [choice: Lin et al. 2017]
    ffn_activation: str = "relu"  # [choice] the Transformer FFN's
    independent_w1: bool = False  # "+ indep. W1" (footnote 4)
    attention_bias: bool = False  # [choice] bias-free W1/W2, as Lin et al. 2017
    dropout: float = 0.0  # on the fusion FNN's hidden layer [choice]
    average_layer_norm: bool = True  # LayerNorm after AVG [choice: "after the fusion layer"]


def build_layer_embedding(num_layers: int, embed_dim: int) -> nn.Embedding:
    """The learned layer embedding ``E`` (Eq. 4): one row per layer index 0..L, not
    pad-zeroed, ``U(-0.1, 0.1)``."""
    table = nn.Embedding(num_layers, embed_dim)
    nn.init.uniform_(table.weight, -LAYER_EMBEDDING_INIT_RANGE, LAYER_EMBEDDING_INIT_RANGE)
    return table


def add_layer_embedding(states: Tensor, layer_embedding: Optional[Tensor]) -> Tensor:
    """Eq. 4: ``z~^l = z^l + E_l``. ``states``: K x T x B x C; ``layer_embedding``: K x C."""
    if layer_embedding is None:
        return states
    return states + layer_embedding[:, None, None, :].type_as(states)


class FeedForward(nn.Module):
    """One-hidden-layer FNN ``W_b act(W_a x + b_a) + b_b`` of the FNN and SA fusions.

    [paper] §4.2: PyTorch's default ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` init. Written
    here because fairseq has no stand-alone FFN module (its FFN is inline in its layers).
    Computed in the input's dtype, the weights cast to it (a no-op unless the fusion passes
    a float32 input to a half-precision model: :func:`normalised_ffn`).
    """

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, activation: str,
                 dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)
        self.activation_fn = utils.get_activation_fn(activation)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation_fn(F.linear(x, self.fc1.weight.to(x.dtype), self.fc1.bias.to(x.dtype)))
        return F.linear(self.dropout_module(hidden), self.fc2.weight.to(x.dtype), self.fc2.bias.to(x.dtype))


class FloatLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (the same parameters) computed in at least float32 and returned in
    its input's dtype: fairseq's ``Fp32LayerNorm``, which would also round a float64 input to
    float32."""

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        return F.layer_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), self.bias.to(dtype),
                            self.eps).type_as(x)


def normalised_ffn(ffn: FeedForward, layer_norm: FloatLayerNorm, x: Tensor) -> Tensor:
    """``LN(FNN(x))`` of the FNN and SA fusions (Eq. 3), computed in at least float32 and
    returned in ``x``'s dtype. The LayerNorm removes any scale of the FNN's output, so the
    loss does not bound the scale of ``W_b`` (nor of ``W_a``, through the ReLU), and Adam grows
    such scale-invariant weights (Heo et al. 2021, AdamP): the FNN's output can outgrow
    float16's 65,504 while the model's function does not change. In float32 (range 3.4e38) it
    cannot; the normalised output is cast back, as fairseq's ``Fp32LayerNorm`` casts its own.
    Autocast (``--amp``) is off inside, or it would run the FNN's matrix products in float16."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return layer_norm(ffn(x.to(dtype))).type_as(x)


class AverageFusion(nn.Module):
    """AVG: ``LN((1/K) sum_l z_j^l)``. No layer embedding: before a mean it would only add
    the constant ``mean_l E_l`` (Eq. 4)."""

    def __init__(self, embed_dim: int, layer_norm: bool = True):
        super().__init__()
        self.layer_norm = LayerNorm(embed_dim) if layer_norm else None

    def forward(self, states: Tensor, layer_embedding: Optional[Tensor] = None) -> Tensor:
        """``states``: K x T x B x C -> T x B x C (``layer_embedding`` is ignored)."""
        fused = states.mean(dim=0)
        return self.layer_norm(fused) if self.layer_norm is not None else fused


class FeedForwardFusion(nn.Module):
    """FNN: ``LN(FNN([z~^0; ...; z~^L]))``, layer-major concatenation ``K*C -> d_f -> C``."""

    def __init__(self, num_states: int, embed_dim: int, options: FusionOptions):
        super().__init__()
        self.ffn = FeedForward(num_states * embed_dim, options.ffn_dim, embed_dim,
                               options.ffn_activation, options.dropout)
        self.layer_norm = FloatLayerNorm(embed_dim)  # see normalised_ffn

    def forward(self, states: Tensor, layer_embedding: Optional[Tensor] = None) -> Tensor:
        """``states``: K x T x B x C, ``layer_embedding``: K x C -> T x B x C."""
        states = add_layer_embedding(states, layer_embedding)
        num_states, length, bsz, embed_dim = states.shape
        # K x T x B x C -> T x B x (K*C), [z~^0 | z~^1 | ...]
        concat = states.permute(1, 2, 0, 3).reshape(length, bsz, num_states * embed_dim)
        return normalised_ffn(self.ffn, self.layer_norm, concat)


class LayerAttention(nn.Module):
    """Hop weights over the depth axis, Eqs. 5-6:
    ``e^l = W2^T sigma(W1^T z~^l)``, ``a_p^l = softmax_l(e_p^l)``.

    ``W1``: ``nn.Linear(C, d_a)`` shared by the K layers, or with ``independent_w1`` one
    matrix per layer, ``w1``: K x C x d_a (in x out) ("+ indep. W1", footnote 4).
    ``W2``: ``nn.Linear(d_a, n_hop)``, one column per hop. Bias-free unless ``bias``.
    """

    def __init__(self, num_states: int, embed_dim: int, options: FusionOptions):
        super().__init__()
        self.independent_w1 = options.independent_w1
        if self.independent_w1:
            self.w1 = nn.Parameter(torch.empty(num_states, embed_dim, options.attention_dim))
            bias = torch.empty(num_states, options.attention_dim) if options.attention_bias else None
            self.w1_bias = None if bias is None else nn.Parameter(bias)
            self._reset_independent_w1(embed_dim)
        else:
            self.w1 = nn.Linear(embed_dim, options.attention_dim, bias=options.attention_bias)
        self.w2 = nn.Linear(options.attention_dim, options.hops, bias=options.attention_bias)
        self.activation_fn = utils.get_activation_fn(options.attention_activation)

    def _reset_independent_w1(self, fan_in: int):
        """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` per layer, as ``nn.Linear`` ([paper] §4.2)."""
        bound = 1 / math.sqrt(fan_in)
        nn.init.uniform_(self.w1, -bound, bound)
        if self.w1_bias is not None:
            nn.init.uniform_(self.w1_bias, -bound, bound)

    def forward(self, states: Tensor) -> Tensor:
        """``states``: z~ as K x T x B x C -> hop weights ``a``: T x B x n_hop x K."""
        if self.independent_w1:
            hidden = torch.einsum("ktbc,kca->ktba", states, self.w1)  # K x T x B x d_a
            if self.w1_bias is not None:
                hidden = hidden + self.w1_bias[:, None, None, :]
        else:
            hidden = self.w1(states)
        energies = self.w2(self.activation_fn(hidden))  # Eq. 5: K x T x B x n_hop
        # Eq. 6: softmax over the layers, in fp32 as fairseq's attention
        return utils.softmax(energies.permute(1, 2, 3, 0), dim=-1).type_as(states)


class SelfAttentionFusion(nn.Module):
    """SA: ``LN(FNN([s~_1; ...; s~_{n_hop}]))`` with ``s~_p = sum_l a_p^l z~^l`` (Eq. 7).

    The flattened 2D representation is hop-major (``n_hop*C -> d_f -> C``). No penalty
    term ``||AA^T - I||`` (not in the paper). ``attention`` returns the hop weights, so a
    forward hook on it records them (Fig. 5 analysis).
    """

    def __init__(self, num_states: int, embed_dim: int, options: FusionOptions):
        super().__init__()
        self.attention = LayerAttention(num_states, embed_dim, options)
        self.ffn = FeedForward(options.hops * embed_dim, options.ffn_dim, embed_dim,
                               options.ffn_activation, options.dropout)
        self.layer_norm = FloatLayerNorm(embed_dim)  # see normalised_ffn

    def forward(self, states: Tensor, layer_embedding: Optional[Tensor] = None) -> Tensor:
        """``states``: K x T x B x C, ``layer_embedding``: K x C -> T x B x C."""
        states = add_layer_embedding(states, layer_embedding)
        weights = self.attention(states)  # T x B x n_hop x K
        hops = torch.einsum("tbpk,ktbc->tbpc", weights, states)  # Eq. 7: T x B x n_hop x C
        return normalised_ffn(self.ffn, self.layer_norm, hops.flatten(2))


def build_fusion(function: str, num_states: int, embed_dim: int, options: FusionOptions) -> nn.Module:
    """The fusion ``function`` (avg, fnn or sa) over ``num_states`` = K layers."""
    if num_states < 1:
        raise ValueError(f"the number of fused layers K must be >= 1, got {num_states}")
    if function == AVG:
        return AverageFusion(embed_dim, options.average_layer_norm)
    if function == FNN:
        return FeedForwardFusion(num_states, embed_dim, options)
    if function == SA:
        return SelfAttentionFusion(num_states, embed_dim, options)
    raise ValueError(f"unknown fusion function {function!r}; expected one of {FUSION_FUNCTIONS}")
