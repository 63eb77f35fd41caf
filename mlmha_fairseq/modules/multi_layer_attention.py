"""Multi-Layer Multi-Head Attention (MLMHA), Ampomah et al. 2020, §4.1 / thesis §3.2.2.

The decoder's encoder-decoder attention attends directly to the n stacked taps
``F^s = [f_1, ..., f_n]`` of the Source Feature Collector. Every tap has its own
query, key and value projection; one output projection ``W_o`` follows.

Computation: the joint variants run ONE attention call whose per-head query and
key are the concatenation of the n per-tap heads. A dot product over the
concatenation is the sum of the n per-tap dot products, so its logits are
exactly ``sum_i alpha^i`` (Eq. 9) when the scale ``1/sqrt(d_k)`` is passed
explicitly. The layer-specific variants run one call with ``n * H`` heads
(Eq. 8).
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]

# Ampomah et al. 2020, Table 1: variant M-ij, i = 0 joint / 1 layer-specific attention
# weights, j = 0 concatenated / 1 summed contexts.
M_00, M_01, M_10, M_11 = "M-00", "M-01", "M-10", "M-11"
VARIANTS = (M_00, M_01, M_10, M_11)

# fairseq's MultiheadAttention initialises q/k/v with this Xavier gain; the same gain keeps
# n = 1 identical to the standard cross-attention at initialisation.
QKV_INIT_GAIN = 1 / math.sqrt(2)
CACHE_KEY = "mlmha_state"


def parse_variant(name: str) -> Tuple[bool, bool]:
    """Map a paper variant name (Table 1) to ``(joint_weights, concat_contexts)``."""
    if name not in VARIANTS:
        raise ValueError(
            f"unknown MLMHA variant {name!r}; expected one of {sorted(VARIANTS)}"
        )
    return name[2] == "0", name[3] == "0"


def _attention_masks(key_padding_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Turn fairseq's ``B x Ts`` pad mask (True = pad) into attention masks.

    Returns ``attend`` (B x 1 x 1 x Ts, True = take part) and ``empty``
    (B x 1 x 1 x 1, True = every key is a pad). A fully padded row attends to
    all its keys so that its softmax stays finite; its weights and context are
    zeroed afterwards, so no NaN appears in the forward or the backward pass.
    """
    pad = key_padding_mask.bool()
    empty = pad.all(dim=-1, keepdim=True)
    attend = ~pad | empty
    return attend[:, None, None, :], empty[:, None, None, :]


@with_incremental_state
class MultiLayerMultiheadAttention(nn.Module):
    """MLMHA sublayer (Eqs. 7-12): attention of the decoder over n encoder taps.

    Drop-in replacement for ``TransformerDecoderLayerBase.encoder_attn``: the
    ``key`` argument carries the stacked taps ``n x Ts x B x C`` (bottom to top).
    Written on ``F.scaled_dot_product_attention`` rather than as a fairseq
    ``MultiheadAttention``, which projects one key sequence with one projection:
    here each of the n taps has its own, and the joint variants sum n logits.

    Parameters (state-dict keys), row-major like ``nn.Linear`` (out x in):
    ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``: ``n x d x d``, slice
    i is ``W^{q,(i)}`` etc.; with ``bias`` also ``{q,k,v}_proj_bias``: ``n x d``;
    ``out_proj``: ``nn.Linear(n*d or d, d)`` over the layer-major concatenation
    ``[c^1 heads | c^2 heads | ...]`` (Eq. 12).

    Optional sharing, off by default as in the authors' code, which has both flags:
    ``share_query`` keeps one query projection for all n taps (``q_proj_*`` with a
    leading size 1 instead of n), ``share_kv`` one key and one value projection
    applied to every tap (``K_i = f_i W^k``, ``V_i = f_i W^v``). Which projections
    are per tap is the same in every variant M-00..M-11.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_taps: int,
        joint_weights: bool,
        concat_contexts: bool,
        dropout: float = 0.0,
        bias: bool = False,
        share_query: bool = False,
        share_kv: bool = False,
        dropped_layer_index: Optional[int] = None,
        memory_key: str = "encoder_out",
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}"
            )
        if num_taps < 1:
            raise ValueError(f"num_taps must be >= 1, got {num_taps}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_taps = num_taps
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.joint_weights = joint_weights
        self.concat_contexts = concat_contexts
        self.dropout_module = FairseqDropout(
            dropout, module_name=self.__class__.__name__
        )

        query_taps = 1 if share_query else num_taps  # projections held
        kv_taps = 1 if share_kv else num_taps
        self.q_proj_weight = nn.Parameter(torch.empty(query_taps, embed_dim, embed_dim))
        self.k_proj_weight = nn.Parameter(torch.empty(kv_taps, embed_dim, embed_dim))
        self.v_proj_weight = nn.Parameter(torch.empty(kv_taps, embed_dim, embed_dim))
        if bias:
            self.q_proj_bias = nn.Parameter(torch.empty(query_taps, embed_dim))
            self.k_proj_bias = nn.Parameter(torch.empty(kv_taps, embed_dim))
            self.v_proj_bias = nn.Parameter(torch.empty(kv_taps, embed_dim))
        else:
            self.register_parameter("q_proj_bias", None)
            self.register_parameter("k_proj_bias", None)
            self.register_parameter("v_proj_bias", None)
        context_dim = num_taps * embed_dim if concat_contexts else embed_dim
        self.out_proj = nn.Linear(context_dim, embed_dim, bias=bias)
        self.memory_key = memory_key  # the encoder_out entry the decoder hands as the taps
        self.dropped_layer_index = dropped_layer_index
        self.reset_parameters()

    def reset_parameters(self):
        """Per-tap init identical to fairseq's ``MultiheadAttention``."""
        for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            for tap_weight in weight:  # d x d: Xavier fans must be per tap
                nn.init.xavier_uniform_(tap_weight, gain=QKV_INIT_GAIN)
        # fairseq keeps nn.Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        # for the q/k/v biases and zeroes only the output bias.
        bound = 1 / math.sqrt(self.embed_dim)
        for proj_bias in (self.q_proj_bias, self.k_proj_bias, self.v_proj_bias):
            if proj_bias is not None:
                nn.init.uniform_(proj_bias, -bound, bound)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    @property
    def dropped_layer_index(self) -> Optional[int]:
        """Tap index (0..n-1) removed for the Table 7 ablation, bias-free reading.

        Its keys and values are zero, i.e. its logits leave the joint sum and
        ``c^i = 0`` (excluded from a sum): the same as zeroing ``f_i`` when the
        projections have no bias.
        """
        return self._dropped_layer_index

    @dropped_layer_index.setter
    def dropped_layer_index(self, index: Optional[int]):
        """Settable for analyses that ablate one tap of a trained model."""
        if index is not None and not 0 <= index < self.num_taps:
            raise ValueError(
                f"dropped_layer_index must be in [0, {self.num_taps - 1}], got {index}"
            )
        self._dropped_layer_index = index

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        static_kv: bool = True,
        need_weights: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Eqs. 7-12. ``query``: Tt x B x C; ``key``: taps n x Ts x B x C.

        ``value`` is ignored (the taps are both keys and values). With
        ``incremental_state``, the taps and ``key_padding_mask`` are read at the
        first step only; later steps reuse the cached projections. Returns the
        output Tt x B x C and, if requested, the attention weights as fairseq's
        ``MultiheadAttention`` does: H x B x Tt x Ts with ``need_head_weights``,
        else B x Tt x Ts averaged over heads. Layer-specific weights are
        averaged over the taps.
        """
        if not static_kv:
            raise ValueError("MLMHA attends to static encoder taps (static_kv=True)")
        need_weights = need_weights or need_head_weights
        cache = self._cached_taps(incremental_state)
        if cache is None:
            if key is None:
                raise ValueError("the encoder taps (key) are needed at the first step")
            cache = self._prepare_taps(key, key_padding_mask)
            if incremental_state is not None:
                self._set_input_buffer(incremental_state, cache)
        query_heads = self._project_query(query)
        if need_weights:
            context, probs = self._attend_with_weights(query_heads, cache)
            weights = self._report_weights(probs, need_head_weights)
        else:
            context = self._attend_fused(query_heads, cache)
            weights = None
        return self.out_proj(self._merge_contexts(context, query.size(0))), weights

    def _cached_taps(
        self, incremental_state: Optional[IncrementalState]
    ) -> Optional[Dict[str, Optional[Tensor]]]:
        """The projected taps of this sentence, if an earlier step computed them."""
        buffer = self._get_input_buffer(incremental_state)
        return buffer if "key" in buffer else None

    def _prepare_taps(
        self, taps: Tensor, key_padding_mask: Optional[Tensor]
    ) -> Dict[str, Optional[Tensor]]:
        """Keys, values and masks of one batch of sentences, in attention layout."""
        key, value = self._project_taps(taps)
        cache: Dict[str, Optional[Tensor]] = {"key": key, "value": value}
        if key_padding_mask is not None:
            cache["attend"], cache["empty"] = _attention_masks(key_padding_mask)
        return cache

    def _project_taps(self, taps: Tensor) -> Tuple[Tensor, Tensor]:
        """Eqs. 7-8: ``K_i = f_i W^{k,(i)}``, ``V_i = f_i W^{v,(i)}`` for all taps.

        ``taps``: n x Ts x B x C. Returns the key in head layout (see
        ``_to_heads``) and the value in head layout, summed over taps for the
        joint-sum variant (M-01: ``sum_i alpha_hat V_i = alpha_hat sum_i V_i``).
        """
        if taps.size(0) != self.num_taps:
            raise ValueError(f"expected {self.num_taps} taps, got {taps.size(0)}")
        key = self._project_per_tap(taps, self.k_proj_weight, self.k_proj_bias)
        value = self._project_per_tap(taps, self.v_proj_weight, self.v_proj_bias)
        if self.joint_weights and not self.concat_contexts:
            return self._to_heads(key), value.sum(dim=1)
        return self._to_heads(key), self._to_heads(value)

    def _project_per_tap(
        self, taps: Tensor, weight: Tensor, bias: Optional[Tensor]
    ) -> Tensor:
        """``f_i W_i^T + b_i`` for every tap i in one batched matmul (with
        ``share_kv`` the one ``W``, ``b`` broadcast to every tap).

        n x Ts x B x C -> B x n x H x Ts x d_k (a view of the n x (Ts*B) x C result).
        """
        num_taps, src_len, bsz, embed_dim = taps.shape
        flat = taps.reshape(num_taps, src_len * bsz, embed_dim)
        weight_t = weight.transpose(1, 2).expand(num_taps, -1, -1)
        if bias is None:
            projected = torch.bmm(flat, weight_t)
        else:
            projected = torch.baddbmm(bias.unsqueeze(1).expand(num_taps, -1, -1), flat, weight_t)
        projected = self._drop_tap(projected)
        per_tap_shape = (num_taps, src_len, bsz, self.num_heads, self.head_dim)
        return projected.view(per_tap_shape).permute(2, 0, 3, 1, 4)

    def _drop_tap(self, projected: Tensor) -> Tensor:
        """Zero the projection of ``dropped_layer_index`` (n x N x C)."""
        if self._dropped_layer_index is None:
            return projected
        index = torch.tensor([self._dropped_layer_index], device=projected.device)
        return projected.index_fill(0, index, 0.0)

    def _project_query(self, query: Tensor) -> Tensor:
        """Eq. 7 query side: all n ``Q W^{q,(i)}`` in one matmul, in head layout
        (with ``share_query`` the one ``Q W^q``, repeated for every tap)."""
        tgt_len, bsz, _ = query.shape
        query_taps = self.q_proj_weight.size(0)  # n, or 1 with share_query
        weight = self.q_proj_weight.view(query_taps * self.embed_dim, self.embed_dim)
        bias = None if self.q_proj_bias is None else self.q_proj_bias.view(-1)
        projected = F.linear(query, weight, bias)  # Tt x B x (n*C), tap-major
        # Tt x B x (n*C) -> B x n x H x Tt x d_k (a view)
        per_tap_shape = (tgt_len, bsz, query_taps, self.num_heads, self.head_dim)
        per_tap = projected.view(per_tap_shape).expand(-1, -1, self.num_taps, -1, -1)
        return self._to_heads(per_tap.permute(1, 2, 3, 0, 4))

    def _to_heads(self, per_tap: Tensor) -> Tensor:
        """B x n x H x T x d_k -> the attention-call layout of this variant.

        Joint (Eq. 9): B x H x T x (n*d_k), the n per-tap heads concatenated, so
        one dot product sums the n per-tap scores. Layer-specific (Eq. 8):
        B x (n*H) x T x d_k, one attention head per (tap, head).
        """
        bsz, num_taps, num_heads, length, head_dim = per_tap.shape
        if self.joint_weights:
            return per_tap.permute(0, 2, 3, 1, 4).reshape(
                bsz, num_heads, length, num_taps * head_dim
            )
        return per_tap.reshape(bsz, num_taps * num_heads, length, head_dim)

    def _attention_dropout_p(self) -> float:
        """The probability FairseqDropout would use now (it honours retain-dropout)."""
        active = self.training or self.dropout_module.apply_during_inference
        return self.dropout_module.p if active else 0.0

    def _attend_fused(
        self, query: Tensor, cache: Dict[str, Optional[Tensor]]
    ) -> Tensor:
        """Eqs. 8-10 without weights: one fused SDPA call (B x H' x Tt x E_v)."""
        key, value = cache["key"], cache["value"]
        attend, empty = cache.get("attend"), cache.get("empty")
        assert key is not None and value is not None
        context = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attend,
            dropout_p=self._attention_dropout_p(),
            scale=self.scaling,  # 1/sqrt(d_k) of one tap, not of the concatenation
        )
        if empty is not None:
            context = context.masked_fill(empty, 0.0)
        return context

    def _attend_with_weights(
        self, query: Tensor, cache: Dict[str, Optional[Tensor]]
    ) -> Tuple[Tensor, Tensor]:
        """Eqs. 8-10 with explicit probabilities (B x H' x Tt x Ts, fp32 softmax).

        Pads are masked with -inf after the n scores are summed (masking each score
        first would add -inf terms and give NaN).
        Returns the context (B x H' x Tt x E_v) and the pre-dropout probabilities.
        """
        key, value = cache["key"], cache["value"]
        attend, empty = cache.get("attend"), cache.get("empty")
        assert key is not None and value is not None
        # the query scaled before the product, as fairseq's MultiheadAttention does: the
        # unscaled sum over d_k (n*d_k in the joint variants) would reach float16's 65,504
        # sqrt(d_k) times sooner
        scores = torch.matmul(query * self.scaling, key.transpose(-1, -2))
        if attend is not None:
            scores = scores.masked_fill(~attend, float("-inf"))
        probs = utils.softmax(scores, dim=-1).type_as(scores)
        if empty is not None:
            probs = probs.masked_fill(empty, 0.0)
        return torch.matmul(self.dropout_module(probs), value), probs

    def _report_weights(self, probs: Tensor, need_head_weights: bool) -> Tensor:
        """B x H' x Tt x Ts -> H x B x Tt x Ts, or B x Tt x Ts averaged over heads.

        Layer-specific: mean over taps of the per-tap probabilities (each tap's
        distribution sums to one, so their mean is a distribution over the source).
        """
        bsz, _, tgt_len, src_len = probs.shape
        probs = probs.view(bsz, -1, self.num_heads, tgt_len, src_len).mean(dim=1)
        if need_head_weights:
            return probs.transpose(0, 1)
        return probs.mean(dim=1)

    def _merge_contexts(self, context: Tensor, tgt_len: int) -> Tensor:
        """Eqs. 11-12: contexts (B x H' x Tt x E_v) -> ``Ĉ``: Tt x B x (n*C or C).

        Concatenation is layer-major, ``[c^1 heads | c^2 heads | ...]`` [code].
        """
        bsz = context.size(0)
        if self.joint_weights and self.concat_contexts:
            # B x H x Tt x (n*d_k) -> B x n x H x Tt x d_k
            per_tap = context.view(
                bsz, self.num_heads, tgt_len, self.num_taps, self.head_dim
            ).permute(0, 3, 1, 2, 4)
        elif self.joint_weights:
            per_tap = context.unsqueeze(1)  # already alpha_hat sum_i V_i
        else:
            per_tap = context.view(
                bsz, self.num_taps, self.num_heads, tgt_len, self.head_dim
            )
            if not self.concat_contexts:
                per_tap = per_tap.sum(dim=1, keepdim=True)
        # B x n' x H x Tt x d_k -> Tt x B x (n' * C)
        return per_tap.permute(3, 0, 1, 2, 4).reshape(tgt_len, bsz, -1)

    def reorder_incremental_state(
        self, incremental_state: IncrementalState, new_order: Tensor
    ) -> IncrementalState:
        """Select the cached taps of the surviving hypotheses.

        As fairseq's encoder-decoder attention does: an order of the cached batch
        size only moves hypotheses among the beams of their sentence, which share
        the sentence's encoder output, so the cache stays as it is. Copying it would
        cost n times the keys and values of a standard cross-attention at every
        beam step. Any other order (finished sentences leaving the batch) selects rows.
        """
        buffer = self._get_input_buffer(incremental_state)
        if not buffer or buffer["key"].size(0) == new_order.size(0):
            return incremental_state
        for name, cached in buffer.items():
            if cached is not None:
                buffer[name] = cached.index_select(0, new_order)
        return self._set_input_buffer(incremental_state, buffer)

    def _get_input_buffer(
        self, incremental_state: Optional[IncrementalState]
    ) -> Dict[str, Optional[Tensor]]:
        buffer = self.get_incremental_state(incremental_state, CACHE_KEY)
        return {} if buffer is None else buffer

    def _set_input_buffer(
        self, incremental_state: IncrementalState, buffer: Dict[str, Optional[Tensor]]
    ) -> IncrementalState:
        return self.set_incremental_state(incremental_state, CACHE_KEY, buffer)
