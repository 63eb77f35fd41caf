"""Input combination strategies of a multi-source Transformer decoder (Libovický, Helcl and
Mareček, WMT 2018, §3).

Each class is the whole encoder-decoder attention *sublayer* of a decoder layer, residual
connections and layer normalisation included, because the serial strategy chains n
residual sublayers, each with its own LayerNorm, which a drop-in replacement of fairseq's
``encoder_attn`` call (one LayerNorm, one residual around it) cannot express. With
``x`` the sublayer input (the self-attention output after its residual), ``E_k`` the
``S_k x B x C`` output of encoder k and ``m_k`` its ``B x S_k`` padding mask, pre-norm
(``normalize_before``; the reference implementation, RI) computes::

    serial:        h_0 = x;  h_k = h_{k-1} + Drop(A_k(LN_k(h_{k-1}), E_k; m_k));  u = h_n
    parallel:      u = x + sum_k Drop(A_k(LN(x), E_k; m_k))                       (Eq. 4)
    flat:          u = x + Drop(A(LN(x), [E_1; ...; E_n]; [m_1; ...; m_n]))       (Eqs. 5-6)
    hierarchical:  c_k = Drop(A_k(LN(x), E_k; m_k));
                   u_t = x_t + Drop(A_hier(LN(x)_t, [c_1,t; ...; c_n,t]))          (Eqs. 7-8)

and post-norm (fairseq's default) moves every LN after its residual: ``h_k = LN_k(h_{k-1}
+ Drop(A_k(h_{k-1}, E_k)))``, ``u = LN(x + ...)`` with the unnormalised ``x`` as query.

Every per-source attention ``A_k`` is a distinct fairseq ``MultiheadAttention`` with
``encoder_decoder_attention=True``, so its keys and values are projected once per sentence
and cached under its own incremental-state key (one cache per source). The hierarchical second
level runs per target position (its keys are that position's n contexts, never another
position's, so decoding stays causal) and without incremental state.
"""
from typing import Dict, List, Optional, Tuple

import torch
from fairseq.modules import LayerNorm, MultiheadAttention
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]

SERIAL, PARALLEL, FLAT, HIERARCHICAL = "serial", "parallel", "flat", "hierarchical"
STRATEGIES = (SERIAL, PARALLEL, FLAT, HIERARCHICAL)  # [paper] the RI's STRATEGIES list
MEMORY_KEY = "multi_source_memories"  # encoder_out entry: one S_k x B x C tensor per source


def source_memory_extra(k: int) -> str:
    """Name of source k's memory among the decoder layers' per-call extras."""
    return f"source_memory_{k}"


def source_mask_extra(k: int) -> str:
    """Name of source k's padding mask among the decoder layers' per-call extras."""
    return f"source_padding_mask_{k}"


class InputCombination(nn.Module):
    """Base of the four strategies: per-source attentions, LayerNorms and dropout.

    ``forward(x, memories, padding_masks, incremental_state, need_weights,
    need_head_weights) -> (u, attn)`` with ``x``, ``u``: ``T x B x C``; ``memories``: n
    tensors ``S_k x B x C``; ``padding_masks``: n tensors ``B x S_k`` (True = pad).
    ``attn`` is the attention over the primary source (``primary_index``: what fairseq's
    alignment output reports), in
    fairseq's layout (``B x T x S`` averaged over heads, ``H x B x T x S`` with
    ``need_head_weights``). The weights over the other sources and the hierarchical
    second-level weights are not returned: the attention dumps record them with forward hooks
    on ``attentions`` and ``hier_attention``
    (:func:`mlmha_fairseq.evaluation.multi_source_attention.record`).
    """

    memory_key = MEMORY_KEY
    strategy = ""

    def __init__(self, embed_dim: int, num_heads: int, num_sources: int, memory_dim: int,
                 dropout: float, attention_dropout: float, normalize_before: bool,
                 primary_index: int = 0):
        super().__init__()
        if not 0 <= primary_index < num_sources:
            raise ValueError(f"primary source {primary_index} of {num_sources} sources")
        self.num_sources = num_sources
        self.normalize_before = normalize_before
        self.primary_index = primary_index
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)
        self.attentions = nn.ModuleList(
            MultiheadAttention(embed_dim, num_heads, kdim=memory_dim, vdim=memory_dim,
                               dropout=attention_dropout, encoder_decoder_attention=True)
            for _ in range(self._num_attentions())
        )
        self.layer_norms = nn.ModuleList(LayerNorm(embed_dim) for _ in range(self._num_layer_norms()))

    def cross_attention_sublayer(self, x, encoder_out, encoder_padding_mask, incremental_state,
                                 extras: Dict[str, Tensor], need_weights: bool, need_head_weights: bool):
        """The call of the decoder layer whose cross-attention sublayer this is: the n
        memories and masks arrive as the layer's per-call extras, one tensor each (a list in
        one argument would be a constant to fairseq's activation checkpointing); without
        them, ``encoder_out`` and ``encoder_padding_mask`` are the lists."""
        if source_memory_extra(0) in extras:
            encoder_out = [extras[source_memory_extra(k)] for k in range(self.num_sources)]
            encoder_padding_mask = [extras[source_mask_extra(k)] for k in range(self.num_sources)]
        return self(x, encoder_out, encoder_padding_mask, incremental_state,
                    need_weights=need_weights, need_head_weights=need_head_weights)

    def _num_attentions(self) -> int:
        return self.num_sources

    def _num_layer_norms(self) -> int:
        return 1

    def _check_sources(self, memories: List[Tensor], padding_masks: List[Optional[Tensor]]):
        if len(memories) != self.num_sources or len(padding_masks) != self.num_sources:
            raise ValueError(f"{self.strategy} combination built for {self.num_sources} sources "
                             f"got {len(memories)} memories and {len(padding_masks)} masks")

    def _attend(self, k: int, query: Tensor, memory: Tensor, padding_mask: Optional[Tensor],
                incremental_state: Optional[IncrementalState], need_weights: bool,
                need_head_weights: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """Attention ``k`` over one memory; K/V are cached per sentence (static_kv)."""
        return self.attentions[k](
            query=query, key=memory, value=memory, key_padding_mask=padding_mask,
            incremental_state=incremental_state, static_kv=True,
            need_weights=need_weights, need_head_weights=need_head_weights,
        )

    def _pre(self, x: Tensor, norm: int = 0) -> Tensor:
        return self.layer_norms[norm](x) if self.normalize_before else x

    def _post(self, x: Tensor, norm: int = 0) -> Tensor:
        return x if self.normalize_before else self.layer_norms[norm](x)


class SerialCombination(InputCombination):
    """Serial (Fig. 1a): one residual cross-attention sublayer per source, in source order,
    each with its own LayerNorm; the query of sublayer k is the output of sublayer k-1."""

    strategy = SERIAL

    def _num_layer_norms(self) -> int:
        return self.num_sources

    def forward(self, x, memories, padding_masks, incremental_state=None, need_weights=False,
                need_head_weights=False):
        self._check_sources(memories, padding_masks)
        weights = []
        for k, (memory, mask) in enumerate(zip(memories, padding_masks)):
            context, w = self._attend(k, self._pre(x, k), memory, mask, incremental_state,
                                      need_weights, need_head_weights)
            x = self._post(x + self.dropout_module(context), k)  # T x B x C
            weights.append(w)
        return x, weights[self.primary_index]


class ParallelCombination(InputCombination):
    """Parallel (Fig. 1b, Eq. 4): every source attended with the same query; the contexts
    are summed, not averaged (Eq. 4), each after its own dropout (RI)."""

    strategy = PARALLEL

    def forward(self, x, memories, padding_masks, incremental_state=None, need_weights=False,
                need_head_weights=False):
        self._check_sources(memories, padding_masks)
        query = self._pre(x)
        total, weights = x, []
        for k, (memory, mask) in enumerate(zip(memories, padding_masks)):
            context, w = self._attend(k, query, memory, mask, incremental_state,
                                      need_weights, need_head_weights)
            total = total + self.dropout_module(context)  # T x B x C
            weights.append(w)
        return self._post(total), weights[self.primary_index]


class FlatCombination(InputCombination):
    """Flat (Fig. 1c, Eqs. 5-6): one attention, with shared projections, over the
    concatenation along time of all encoder states; one joint distribution. Masks are
    concatenated in the same order, so pads in the middle of the
    concatenation are masked."""

    strategy = FLAT

    def _num_attentions(self) -> int:
        return 1

    def forward(self, x, memories, padding_masks, incremental_state=None, need_weights=False,
                need_head_weights=False):
        self._check_sources(memories, padding_masks)
        memory = torch.cat(memories, dim=0)  # (S_1 + ... + S_n) x B x C
        mask = torch.cat([_mask_or_zeros(m, e) for m, e in zip(padding_masks, memories)], dim=1)
        context, w = self._attend(0, self._pre(x), memory, mask, incremental_state,
                                  need_weights, need_head_weights)
        per_source = None if w is None else list(w.split([e.size(0) for e in memories], dim=-1))
        u = self._post(x + self.dropout_module(context))
        return u, None if per_source is None else per_source[self.primary_index]


class HierarchicalCombination(InputCombination):
    """Hierarchical (Fig. 1d, Eqs. 7-8): per-source attentions give n contexts per target
    position; a second attention with its own projections and ``hier_heads`` heads, keys
    and values = the n contexts of that position only, no mask, attention-weight dropout =
    the general dropout rate (RI), combines them. With one source it is not the standard
    decoder: the softmax over one context is 1, leaving the linear map ``c W^V W^O``."""

    strategy = HIERARCHICAL

    def __init__(self, embed_dim: int, num_heads: int, num_sources: int, memory_dim: int,
                 dropout: float, attention_dropout: float, normalize_before: bool,
                 primary_index: int = 0, hier_heads: Optional[int] = None):
        super().__init__(embed_dim, num_heads, num_sources, memory_dim, dropout,
                         attention_dropout, normalize_before, primary_index)
        self.hier_attention = MultiheadAttention(embed_dim, hier_heads or num_heads, dropout=dropout)

    def forward(self, x, memories, padding_masks, incremental_state=None, need_weights=False,
                need_head_weights=False):
        self._check_sources(memories, padding_masks)
        tgt_len, bsz, dim = x.size()
        query = self._pre(x)
        contexts, weights = [], []
        for k, (memory, mask) in enumerate(zip(memories, padding_masks)):
            context, w = self._attend(k, query, memory, mask, incremental_state,
                                      need_weights, need_head_weights)
            contexts.append(self.dropout_module(context))
            weights.append(w)
        # per position (Eq. 7, RI's reshape to [B*T, n, d]): query 1 x (T*B) x C over the
        # n x (T*B) x C contexts of the same position; no incremental state (the keys change at every step)
        stacked = torch.stack(contexts).view(self.num_sources, tgt_len * bsz, dim)
        combined, _ = self.hier_attention(
            query=query.reshape(1, tgt_len * bsz, dim), key=stacked, value=stacked,
            need_weights=False,
        )
        u = self._post(x + self.dropout_module(combined.view(tgt_len, bsz, dim)))
        return u, weights[self.primary_index]


def _mask_or_zeros(mask: Optional[Tensor], memory: Tensor) -> Tensor:
    """A ``B x S`` padding mask (all False when the source has none)."""
    if mask is not None:
        return mask.bool()
    return memory.new_zeros(memory.size(1), memory.size(0), dtype=torch.bool)


COMBINATIONS = {
    SERIAL: SerialCombination,
    PARALLEL: ParallelCombination,
    FLAT: FlatCombination,
    HIERARCHICAL: HierarchicalCombination,
}


def build_input_combination(strategy: str, embed_dim: int, num_heads: int, num_sources: int,
                            memory_dim: int, dropout: float, attention_dropout: float,
                            normalize_before: bool, primary_index: int = 0,
                            hier_heads: Optional[int] = None) -> InputCombination:
    """The sublayer of ``strategy`` (one of :data:`STRATEGIES`)."""
    if strategy not in COMBINATIONS:
        raise ValueError(f"unknown combination strategy {strategy!r}; expected one of {STRATEGIES}")
    if hier_heads is not None and strategy != HIERARCHICAL:
        raise ValueError("hier_heads applies to the hierarchical strategy only")
    extra = {"hier_heads": hier_heads} if strategy == HIERARCHICAL else {}
    return COMBINATIONS[strategy](embed_dim, num_heads, num_sources, memory_dim, dropout,
                                  attention_dropout, normalize_before, primary_index, **extra)
