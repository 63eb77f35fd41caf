"""The Transformer of Vaswani et al. (2017) written out in plain torch, as an independent
reference for the equation tests (tests/test_equations.py).

Every function reads its weights from a model's ``state_dict()`` by parameter name (the
names fairseq gives them, which checkpoints keep), so the reference shares no code with the
model it checks. Tensors are batch-first, ``B x T x C``; masks are ``True`` where a key is
hidden. fairseq's conventions that are not in the paper are followed where the reference
must match them: embeddings scaled by sqrt(d) plus tensor2tensor's sinusoids, positions
counted from ``pad + 1`` skipping pads, pad rows of the encoder input zeroed, LayerNorm eps
1e-5, the post-norm layer of the paper (Eqs. 2.10-2.11 of the thesis) or the pre-norm layer
``x + Sublayer(LN(x))`` with a final LayerNorm.
"""
import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

Params = Dict[str, Tensor]


def layer_norm(x: Tensor, params: Params, name: str) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], params[f"{name}.weight"], params[f"{name}.bias"], eps=1e-5)


def linear(x: Tensor, params: Params, name: str) -> Tensor:
    """``x W^T + b`` (no bias if the parameter has none)."""
    return F.linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))


def sinusoids(num: int, dim: int, pad: int) -> Tensor:
    """tensor2tensor's sinusoidal table: sin on the first half of the channels, cos on the
    second; the row of the pad index is zero."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num, dtype=torch.float)[:, None] * freq[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    table[pad] = 0
    return table


def embed(tokens: Tensor, params: Params, name: str, pad: int) -> Tensor:
    """``sqrt(d) E[y] + PE(pos)``: B x T -> B x T x C."""
    table = params[f"{name}.weight"]
    not_pad = tokens.ne(pad).long()
    positions = torch.cumsum(not_pad, dim=1) * not_pad + pad
    pe = sinusoids(int(positions.max()) + 1, table.size(1), pad)
    return math.sqrt(table.size(1)) * table[tokens] + pe[positions]


def causal_mask(length: int) -> Tensor:
    """True above the diagonal: position t sees 0..t."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def attention(query: Tensor, memory: Tensor, params: Params, name: str, heads: int,
              key_padding_mask: Optional[Tensor] = None, causal: bool = False) -> Tensor:
    """Multi-head attention: ``Concat_h(softmax(Q W^Q_h (K W^K_h)^T / sqrt(d_k)) V W^V_h) W^O``.

    ``query``: B x T x C, ``memory``: B x S x C (keys and values), ``key_padding_mask``:
    B x S."""
    bsz, tgt_len, dim = query.shape
    head_dim = dim // heads

    def split(x):  # B x L x C -> B x H x L x d_k
        return x.view(bsz, -1, heads, head_dim).transpose(1, 2)

    q = split(linear(query, params, f"{name}.q_proj"))
    k = split(linear(memory, params, f"{name}.k_proj"))
    v = split(linear(memory, params, f"{name}.v_proj"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)  # B x H x T x S
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(causal_mask(tgt_len), float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v  # B x H x T x d_k
    return linear(context.transpose(1, 2).reshape(bsz, tgt_len, dim), params, f"{name}.out_proj")


def ffn(x: Tensor, params: Params, name: str) -> Tensor:
    """``ReLU(x W_1 + b_1) W_2 + b_2``, fairseq's ``fc1``/``fc2`` of layer ``name``."""
    return linear(torch.relu(linear(x, params, f"{name}.fc1")), params, f"{name}.fc2")


def sublayer(x: Tensor, params: Params, norm: str, pre_norm: bool, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Post-norm ``LN(fn(x) + x)`` (the paper) or pre-norm ``x + fn(LN(x))``."""
    if pre_norm:
        return x + fn(layer_norm(x, params, norm))
    return layer_norm(fn(x) + x, params, norm)


SelfAttention = Callable[[Tensor, Params, str, Tensor], Tensor]


def standard_self_attention(heads: int, causal: bool) -> SelfAttention:
    def self_attention(r, params, name, padding_mask):
        return attention(r, r, params, name, heads, padding_mask, causal)
    return self_attention


def encoder(tokens: Tensor, params: Params, heads: int, num_layers: int, pre_norm: bool, pad: int,
            self_attention: Optional[Callable[[int], Optional[SelfAttention]]] = None):
    """Encoder (Eq. 2.10). Returns ``(states, out, padding_mask)``: ``states`` = [embedding
    output, layer 1..L] as fairseq's ``encoder_states``; ``out`` = ``H_e^L`` (after the final
    LayerNorm in pre-norm). ``self_attention(layer)`` may replace a layer's self-attention."""
    padding_mask = tokens.eq(pad)
    x = embed(tokens, params, "encoder.embed_tokens", pad) * (~padding_mask)[..., None]
    states = [x]
    for i in range(num_layers):
        name = f"encoder.layers.{i}"
        attend = (self_attention and self_attention(i)) or standard_self_attention(heads, causal=False)
        x = sublayer(x, params, f"{name}.self_attn_layer_norm", pre_norm,
                     lambda r: attend(r, params, f"{name}.self_attn", padding_mask))
        x = sublayer(x, params, f"{name}.final_layer_norm", pre_norm, lambda h: ffn(h, params, name))
        states.append(x)
    out = layer_norm(x, params, "encoder.layer_norm") if pre_norm else x
    return states, out, padding_mask


def decoder_layer(x: Tensor, memory: Tensor, memory_mask: Tensor, params: Params, name: str,
                  heads: int, pre_norm: bool, after_self_attention: Optional[Tensor] = None,
                  self_attention: Optional[SelfAttention] = None) -> Tensor:
    """Decoder layer (Eq. 2.11): masked self-attention, cross-attention, FFN.

    ``after_self_attention`` (B x T x C) is added right after the self-attention sublayer:
    to ``S_d^l`` in post-norm, to the residual stream in pre-norm (thesis Eq. 4.3, AIF)."""
    attend = self_attention or standard_self_attention(heads, causal=True)
    x = sublayer(x, params, f"{name}.self_attn_layer_norm", pre_norm,
                 lambda h: attend(h, params, f"{name}.self_attn", None))
    if after_self_attention is not None:
        x = x + after_self_attention
    x = sublayer(x, params, f"{name}.encoder_attn_layer_norm", pre_norm,
                 lambda h: attention(h, memory, params, f"{name}.encoder_attn", heads, memory_mask))
    return sublayer(x, params, f"{name}.final_layer_norm", pre_norm, lambda h: ffn(h, params, name))


def decoder_states(prev: Tensor, memories: List[Tensor], memory_mask: Tensor, params: Params,
                   prefix: str, heads: int, pre_norm: bool, pad: int,
                   fused: Optional[List[Tensor]] = None,
                   self_attention: Optional[Callable[[int], Optional[SelfAttention]]] = None) -> List[Tensor]:
    """[embedding output, layer 1..L] of the decoder ``prefix`` (e.g. ``decoder``);
    ``memories[l]`` is layer l's cross-attention memory, ``fused[l]`` what it adds after its
    self-attention."""
    x = embed(prev, params, f"{prefix}.embed_tokens", pad)
    states = [x]
    for i, memory in enumerate(memories):
        attend = self_attention(i) if self_attention else None
        x = decoder_layer(x, memory, memory_mask, params, f"{prefix}.layers.{i}", heads, pre_norm,
                          after_self_attention=fused[i] if fused else None, self_attention=attend)
        states.append(x)
    return states


def decoder_output(top: Tensor, params: Params, prefix: str, pre_norm: bool) -> Tensor:
    """Features (the final LayerNorm in pre-norm) -> logits B x T x V."""
    features = layer_norm(top, params, f"{prefix}.layer_norm") if pre_norm else top
    return features @ params[f"{prefix}.output_projection.weight"].t()
