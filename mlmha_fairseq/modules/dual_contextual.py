"""Dual Contextual (DC) module, thesis ch. 5 (Eqs. 5.4-5.7, Fig. 5.2).

The DC module replaces a layer's self-attention sublayer. With ``r`` the sublayer input
(T x B x C):

* Local Contextual Unit (Eq. 5.4): ``r_hat_t = GLU([r_{t-a}; ...; r_{t+b}] W^r + b^r)``
  with ``W^r`` in R^{fd x 2d}, a one-layer 1-D convolution of width f, and
  ``l_c = LN(r_hat + r)``;
* Context Interaction Unit (Eqs. 5.5-5.7): two Feature Interaction (FI) units, multi-head
  attentions without their own output projection, ``h_l = FI(r, l_c)`` (queries from r,
  keys and values from the local representation) and ``h_g = FI(r, r)``, merged by
  ``z_hat = [h_l; h_g] W_z + b_z``;
* ``z^f = LN(z_hat + r)`` (Eq. 5.7).

What this module computes is ``z_hat``: the layer around it (fairseq's encoder or decoder
layer) adds dropout, the residual ``r`` and its ``self_attn_layer_norm``, which is exactly
Eq. 5.7 in a post-norm layer. In a pre-norm layer (``--encoder-normalize-before``) the same
code gives the pre-norm variant: ``r = LN_in(x)`` and ``x <- x + Drop(z_hat)``, the
LayerNorm inside the local unit kept.

Window [choice] (the thesis writes ``[t-f/2, t+f/2]``, f+1 inputs, while ``W^r`` of
Eq. 5.2 has f d rows): exactly f inputs. Encoder: centred, ``a = floor((f-1)/2)`` before and
``b = ceil((f-1)/2)`` after t, so for even f the extra input is on the right (PyTorch's
``padding='same'``; f=2 sees ``[t, t+1]``). Decoder: causal, ``[t-f+1, t]`` (a centred
window would show y_t to the prediction of y_t under teacher forcing).
"""
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules import LayerNorm, MultiheadAttention
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor, nn

IncrementalState = Dict[str, Dict[str, Optional[Tensor]]]
CACHE_KEY = "local_unit_state"
PREVIOUS_INPUTS = "previous_inputs"


def conv_padding(kernel_size: int, causal: bool) -> Tuple[int, int]:
    """Zero inputs added (before, after) the sequence so the output has its length."""
    if kernel_size < 1:
        raise ValueError(f"the kernel size must be >= 1, got {kernel_size}")
    total = kernel_size - 1
    before = total if causal else total // 2
    return before, total - before


def zero_padding(x: Tensor, padding_mask: Optional[Tensor]) -> Tensor:
    """``x`` (T x B x C) with the rows of pad positions (``padding_mask``: B x T, True =
    pad) set to 0, as fairseq's LightConvEncoder does before convolving."""
    if padding_mask is None:
        return x
    return x.masked_fill(padding_mask.transpose(0, 1).unsqueeze(-1).bool(), 0.0)


@with_incremental_state
class LocalContextualUnit(nn.Module):
    """Eq. 5.4: ``l_c = LN(Drop(GLU(conv_f(r))) + r)``.

    ``conv`` holds ``W^r`` as torch's ``Conv1d`` weight (2d x d x f; ``W^r``'s row block
    for offset k is ``weight[:, :, k].T``) and ``b^r``; the convolution is computed as a
    matmul over the unfolded windows (see ``forward``).

    Pad positions are zeroed before the convolution, so a real position sees zeros beyond
    its sentence whatever the amount of padding, left or right; they are zeroed again in
    ``l_c`` so that no pad row carries values. Dropout on ``r_hat`` before the residual
    [choice] (the thesis does not say).

    Causal units decode incrementally: the cache holds the last f-1 (zeroed) inputs per
    sentence, time-major ``(f-1) x B x C``, zeros before the first step (the left padding).
    """

    def __init__(self, embed_dim: int, kernel_size: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.kernel_size = kernel_size
        self.causal = causal
        self.padding = conv_padding(kernel_size, causal)
        self.conv = nn.Conv1d(embed_dim, 2 * embed_dim, kernel_size)
        self.layer_norm = LayerNorm(embed_dim)
        self.dropout_module = FairseqDropout(dropout, module_name=self.__class__.__name__)

    def forward(
        self,
        r: Tensor,
        padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
    ) -> Tensor:
        """``r``: T x B x C (with ``incremental_state``: the new steps only);
        ``padding_mask``: B x T, True = pad. Returns ``l_c``: T x B x C."""
        inputs = zero_padding(r, padding_mask)
        if incremental_state is None:
            before, after = self.padding
            window = F.pad(inputs, (0, 0, 0, 0, before, after))  # (T + f - 1) x B x C
        else:
            window = self._extend_cache(inputs, incremental_state)
        # The convolution as one matmul over the windows: (T + f - 1) x B x C -> T x B x C x f
        # (position t's window, as Conv1d's weight orders it) -> T x B x 2C. Same FLOPs as the
        # convolution, without its per-call cost at a one-position decoding step.
        windows = window.unfold(0, self.kernel_size, 1).flatten(2)
        projected = F.linear(windows, self.conv.weight.flatten(1), self.conv.bias)
        r_hat = F.glu(projected, dim=-1)  # T x B x C: a * sigmoid(b), [a; b] = projected
        local = self.layer_norm(self.dropout_module(r_hat) + r)
        return zero_padding(local, padding_mask)

    def _extend_cache(self, inputs: Tensor, incremental_state: IncrementalState) -> Tensor:
        """The cached f-1 inputs followed by the new ones; keeps the last f-1."""
        if not self.causal:
            raise ValueError("only a causal (decoder) local unit decodes incrementally")
        history = self.kernel_size - 1
        buffer = self.get_incremental_state(incremental_state, CACHE_KEY)
        if buffer is None:
            previous = inputs.new_zeros(history, *inputs.shape[1:])
        else:
            previous = buffer[PREVIOUS_INPUTS]
        window = torch.cat([previous, inputs], dim=0)  # (f - 1 + T) x B x C
        kept = window[window.size(0) - history:]
        self.set_incremental_state(incremental_state, CACHE_KEY, {PREVIOUS_INPUTS: kept})
        return window

    def reorder_incremental_state(self, incremental_state: IncrementalState, new_order: Tensor):
        """Select the cached inputs of the surviving hypotheses (batch dim 1); rows may be
        repeated or dropped (beam search)."""
        buffer = self.get_incremental_state(incremental_state, CACHE_KEY)
        if buffer is None:
            return incremental_state
        reordered = {PREVIOUS_INPUTS: buffer[PREVIOUS_INPUTS].index_select(1, new_order)}
        return self.set_incremental_state(incremental_state, CACHE_KEY, reordered)


class FeatureInteraction(MultiheadAttention):
    """FI unit (Eqs. 5.5-5.6): fairseq's multi-head attention with bias-free q/k/v
    projections [code] (the thesis' code base has bias-free attention).

    The FI units have no output projection of their own: ``[h_l; h_g] W_z`` equals
    ``h_l W_z^(l) + h_g W_z^(g)`` with ``W_z^(l)``, ``W_z^(g)`` the two d x d row blocks of
    ``W_z``, so each unit's bias-free ``out_proj`` *is* its block of ``W_z`` and the merge
    is a sum (same function, same parameter count; each block is Xavier-initialised on its
    own). Its incremental cache (keys and values so far) is fairseq's, under its own key.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, self_attention: bool):
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=False,
                         self_attention=self_attention)
        # fairseq's fast path hands torch.cat((q_bias, k_bias, v_bias)) to torch and fails
        # on bias-free projections; fairseq's own path computes the same attention.
        self.skip_embed_dim_check = True


class DualContextual(nn.Module):
    """The DC module (Fig. 5.2) with the call signature of fairseq's ``self_attn``.

    Returns ``z_hat`` (Eq. 5.7 before the residual and LayerNorm, which the layer adds) and,
    when asked, the weights of the self-attention FI unit ``h_g = FI(r, r)`` in fairseq's
    format, so the package's attention analyses run unchanged.

    Masks: both FI units get the key padding mask and ``attn_mask`` (the decoder's causal
    mask). Incremental state: the local unit's last f-1 inputs and both FI units' keys and
    values; fairseq's decoder reorders each of them once by walking its modules, so this
    module deliberately has no ``reorder_incremental_state`` of its own (it would reorder
    its children twice).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel_size: int,
        causal: bool,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads  # read by fairseq's decoder layer (self.nh)
        self.head_dim = embed_dim // num_heads
        self.local_unit = LocalContextualUnit(embed_dim, kernel_size, causal, dropout)
        self.local_interaction = FeatureInteraction(embed_dim, num_heads, attention_dropout,
                                                    self_attention=False)
        self.global_interaction = FeatureInteraction(embed_dim, num_heads, attention_dropout,
                                                     self_attention=True)
        self.merge_bias = nn.Parameter(torch.zeros(embed_dim))  # b_z

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor] = None,
        value: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[IncrementalState] = None,
        need_weights: bool = False,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Eqs. 5.4-5.7 on ``query`` = r (T x B x C; fairseq passes the same tensor as
        ``key`` and ``value`` of a self-attention). Returns ``z_hat``: T x B x C and the
        ``h_g`` weights (B x T x S, or H x B x T x S with ``need_head_weights``) or None."""
        if static_kv:
            raise ValueError("the Dual Contextual module is a self-attention (static_kv=False)")
        local = self.local_unit(query, key_padding_mask, incremental_state)
        h_local, _ = self.local_interaction(
            query=query, key=local, value=local, key_padding_mask=key_padding_mask,
            incremental_state=incremental_state, need_weights=False, attn_mask=attn_mask,
        )
        h_global, weights = self.global_interaction(
            query=query, key=query, value=query, key_padding_mask=key_padding_mask,
            incremental_state=incremental_state, need_weights=need_weights,
            attn_mask=attn_mask, need_head_weights=need_head_weights,
        )
        return h_local + h_global + self.merge_bias, weights

    def _get_input_buffer(self, incremental_state: Optional[IncrementalState]):
        """The self-attention unit's cache (fairseq's decoder layer looks for
        ``prev_key`` in ``self_attn``'s buffer)."""
        return self.global_interaction._get_input_buffer(incremental_state)
