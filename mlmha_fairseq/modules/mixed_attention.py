"""Mixed Multi-Head Self-Attention (MMA), Cui et al. 2019, §3.

Every head h of an encoder self-attention gets a fixed hard mask ``M^h`` added to its
energies before the softmax (Eq. 7):

    ATT_h(Q, K, V) = Softmax(e_i + M^h_i) V,    M^h_{ij} = 0 (allowed) or -inf

with four head types (Eqs. 8-11; 1 = allowed, rows are queries i, columns keys j):

* ``G`` global: always allowed (the Transformer's head);
* ``L`` local: ``|j - i| <= w``, a window of 2w+1 keys clipped at the sentence edges;
* ``F`` forward: ``j >= i``, itself and *later* positions (the paper's naming, the opposite
  of the RNN convention);
* ``B`` backward: ``j <= i``, itself and *earlier* positions.

``MA = Concat(head_1, ..., head_H) W^O`` is unchanged: :class:`MixedMultiheadAttention` is
fairseq's ``MultiheadAttention`` with the same parameters and state-dict names, so a
specification of global heads only is fairseq's self-attention, and no parameter is added.
Head h owns channels ``[h * d_k, (h + 1) * d_k)`` of the projections, as in fairseq.
"""
import functools
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules import MultiheadAttention
from torch import Tensor

GLOBAL, LOCAL, FORWARD, BACKWARD = "G", "L", "F", "B"
HEAD_TYPES = (GLOBAL, LOCAL, FORWARD, BACKWARD)  # also the row order of _type_masks
# Structural masks kept per (head types, window, length, device): enough for the lengths of
# a training run's buckets without holding on to memory for every length ever seen.
MASK_CACHE_SIZE = 256


def _type_masks(window: int, length: int, device: torch.device) -> Tensor:
    """The four "allowed" masks of Eqs. 8-11, ``4 x T x T`` bool in HEAD_TYPES order."""
    positions = torch.arange(length, device=device)
    offset = positions[None, :] - positions[:, None]  # T x T, j - i
    return torch.stack([
        torch.ones_like(offset, dtype=torch.bool),  # G, Eq. 8
        offset.abs() <= window,  # L, Eq. 9
        offset >= 0,  # F, Eq. 10: itself and later positions
        offset <= 0,  # B, Eq. 11: itself and earlier positions
    ])


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def head_masks(head_types: Tuple[str, ...], window: int, length: int, device: torch.device) -> Tensor:
    """``H x T x T`` bool, True where head h's query i may attend to key j.

    Built once per (head types, window, length, device) and shared by every layer and
    batch; callers must not modify it in place. Boolean, so the same mask
    serves every compute dtype (fp32, fp16, bf16) without fill values.
    """
    with torch.inference_mode(False):  # a cached mask may later be saved for backward
        type_index = torch.tensor([HEAD_TYPES.index(t) for t in head_types], device=device)
        return _type_masks(window, length, device)[type_index]


def allowed_keys(structural: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """The heads' masks AND-ed with the key padding mask.

    ``structural``: ``H x T x T``; ``key_padding_mask``: ``B x T``, True at pads.
    Returns ``1 x H x T x T`` without padding, else ``B x H x T x T`` (True = allowed).

    A query row can lose every key: a pad query of a B or L head in a left-padded batch
    only sees pad keys (an F or L head in a right-padded one), which would give a softmax
    over nothing, NaN outputs, and NaN in real tokens one layer later (``0 * NaN``).
    Such rows attend to themselves instead. Rows of real tokens always keep their
    diagonal, and a pad row that still sees some real key is left as fairseq computes it,
    so outputs equal fairseq's attention wherever fairseq's are finite.
    """
    if key_padding_mask is None:
        return structural.unsqueeze(0)
    allowed = structural.unsqueeze(0) & ~key_padding_mask.bool()[:, None, None, :]
    empty_rows = ~allowed.any(dim=-1, keepdim=True)  # B x H x T x 1
    diagonal = torch.eye(structural.size(-1), dtype=torch.bool, device=structural.device)
    return allowed | (empty_rows & diagonal)


class MixedMultiheadAttention(MultiheadAttention):
    """Encoder self-attention whose heads have fixed hard masks (Eqs. 7-11).

    Same constructor as fairseq's ``MultiheadAttention`` plus ``head_types`` (one of
    G/L/F/B per head, in head order) and ``window`` (w of the local heads, in tokens of
    the model's input, EOS included, as the paper's
    positions). Self-attention only: no
    incremental state, no ``static_kv``, no extra ``attn_mask``.

    Without attention weights requested (the encoder layer's call) the heads run in one
    ``F.scaled_dot_product_attention`` call with a boolean mask; with ``need_weights`` the
    energies are computed explicitly and returned as fairseq does (head-averaged
    ``B x T x S``, or ``H x B x T x S`` with ``need_head_weights``). [choice] xFormers
    attention is never used by these heads.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_types: Sequence[str], window: int, **kwargs):
        super().__init__(embed_dim, num_heads, self_attention=True, **kwargs)
        head_types = tuple(head_types)
        if len(head_types) != num_heads:
            raise ValueError(f"{len(head_types)} head types {head_types} for {num_heads} heads")
        unknown = sorted(set(head_types) - set(HEAD_TYPES))
        if unknown:
            raise ValueError(f"unknown head type(s) {unknown}; expected some of {HEAD_TYPES}")
        if window < 0:
            raise ValueError(f"local window {window}: must be >= 0")
        self.head_types = head_types
        self.window = window

    def extra_repr(self) -> str:
        return f"head_types={','.join(self.head_types)}, window={self.window}"

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """``query``/``key``/``value``: T x B x C (the same tensor in fairseq's encoder);
        ``key_padding_mask``: B x T, True at pads. Returns T x B x C and the weights."""
        if incremental_state is not None or static_kv or before_softmax or attn_mask is not None:
            raise ValueError(
                "MixedMultiheadAttention is an encoder self-attention: incremental_state, "
                "static_kv, before_softmax and an extra attn_mask are not supported"
            )
        need_weights = need_weights or need_head_weights
        length, batch_size, _ = query.size()
        q, k, v = (self._split_heads(proj(x), batch_size) for proj, x in
                   ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)))
        structural = head_masks(self.head_types, self.window, length, query.device)
        allowed = allowed_keys(structural, key_padding_mask)  # (1 or B) x H x T x T
        if need_weights:
            context, weights = self._explicit_attention(q, k, v, allowed)
        else:
            dropout_p = self.dropout_module.p if self._dropout_active() else 0.0
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=self.scaling
            )
            weights = None
        # B x H x T x d_k -> T x B x C, heads concatenated in order (Eq. 4)
        context = context.permute(2, 0, 1, 3).reshape(length, batch_size, self.embed_dim)
        output = self.out_proj(context)
        if weights is not None:
            weights = weights.transpose(0, 1)  # H x B x T x S, as fairseq
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return output, weights

    def _split_heads(self, x: Tensor, batch_size: int) -> Tensor:
        """T x B x C -> B x H x T x d_k; head h = channels [h d_k, (h+1) d_k)."""
        return x.view(-1, batch_size, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _dropout_active(self) -> bool:
        return self.training or self.dropout_module.apply_during_inference

    def _explicit_attention(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tuple[Tensor, Tensor]:
        """Eq. 7 with the probabilities kept: B x H x T x d_k context, B x H x T x S fp32."""
        energies = torch.matmul(q * self.scaling, k.transpose(-1, -2))  # B x H x T x S
        energies = energies.masked_fill(~allowed, float("-inf"))
        weights = utils.softmax(energies, dim=-1)  # fp32, as fairseq's softmax
        probs = self.dropout_module(weights.type_as(q))
        return torch.matmul(probs, v), weights
