"""Mixed Multi-Head Self-Attention (MMA; Cui et al., WNGT 2019; seed 002, spec A).

Fills the encoder self-attention slot with :class:`MixedMultiheadAttention`
(``--encoder-self-attention mixed``): every head has a fixed hard mask, global (G),
local window +-w (L), forward (F: itself and later positions) or backward (B: itself and
earlier positions). No parameter is added (Table 1: "+0"). The decoder is unchanged.

Options: ``--mma-heads`` (one type per head), ``--mma-local-window``, ``--mma-layers``, and
``--encoder-no-token-positional-embeddings`` (Table 3's "- Position Embedding", which removes
the encoder's positions only; fairseq's ``--no-token-positional-embeddings`` removes both).

Presets: ``mma_transformer_iwslt_de_en`` (IWSLT14 De-En, Tables 2-5) and
``mma_transformer_wat`` (WAT17 En-Ja/Ja-En, Table 1).
"""
import functools
import logging
from typing import Tuple

from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import transformer_iwslt_de_en
from fairseq.utils import safe_getattr

from ..modules.mixed_attention import HEAD_TYPES, MixedMultiheadAttention
from .layer_selection import ALL_LAYERS, parse_layers
from .slot_transformer import slot_transformer
from .slots import ENCODER_SELF_ATTENTION, register_model_hook, register_options

logger = logging.getLogger(__name__)

MIXED = "mixed"
DEFAULT_WINDOW = 1  # Table 5: w = 1 is best and is the main result's setting


def add_args(parser):
    """Options of MMA (fairseq passes its model argument group)."""
    parser.add_argument("--mma-heads", metavar="SPEC",
                        help="MMA head types in head order, one of G (global), L (local), "
                             "F (forward: itself and later), B (backward: itself and earlier) "
                             "per head, e.g. G,G,L,L,F,F,B,B (default: H/4 heads of each type "
                             "in blocks G, L, F, B)")
    parser.add_argument("--mma-local-window", type=int, metavar="W",
                        help=f"window of the local heads: query i sees keys i-W..i+W, in tokens "
                             f"of the model's input, EOS included (default: {DEFAULT_WINDOW})")
    parser.add_argument("--mma-layers", metavar="LAYERS",
                        help="encoder layers with MMA, 1-based: 'all' (default), 'none' or a list of "
                             "layers and ranges such as 1-3,6; the others keep fairseq's "
                             "self-attention")
    parser.add_argument("--encoder-no-token-positional-embeddings", action="store_true",
                        help="no positional embeddings in the encoder; the decoder keeps them "
                             "(MMA paper, Table 3)")


def set_defaults(args):
    args.mma_heads = getattr(args, "mma_heads", None)
    args.mma_local_window = getattr(args, "mma_local_window", DEFAULT_WINDOW)
    args.mma_layers = getattr(args, "mma_layers", ALL_LAYERS)
    args.encoder_no_token_positional_embeddings = getattr(args, "encoder_no_token_positional_embeddings", False)


register_options(add_args, set_defaults)


def parse_head_types(spec: str, num_heads: int) -> Tuple[str, ...]:
    """``"G,L,F,B"`` -> ``("G", "L", "F", "B")`` (case-insensitive), one per head (spec P3)."""
    head_types = tuple(name.strip().upper() for name in spec.split(","))
    unknown = [name for name in head_types if name not in HEAD_TYPES]
    if unknown:
        raise ValueError(
            f"--mma-heads {spec!r}: unknown head type(s) {unknown}; give a comma-separated "
            f"list of {', '.join(HEAD_TYPES)} (global, local, forward, backward)"
        )
    if len(head_types) != num_heads:
        raise ValueError(
            f"--mma-heads {spec!r} lists {len(head_types)} head type(s) for "
            f"--encoder-attention-heads {num_heads}: give exactly one per head"
        )
    return head_types


@functools.lru_cache(maxsize=None)  # one warning per head count, not one per layer
def default_head_types(num_heads: int) -> Tuple[str, ...]:
    """[choice] (spec A.2.3 item 1) contiguous blocks in the order of
    Concat(head_G, head_L, head_F, head_B), H/4 heads per type: G,L,F,B (4 heads),
    G,G,L,L,F,F,B,B (8). When H is not a multiple of 4 (the paper has no such model) head h
    takes type ``floor(4h / H)``, e.g. G,F for 2 heads, with a warning."""
    head_types = tuple(HEAD_TYPES[h * len(HEAD_TYPES) // num_heads] for h in range(num_heads))
    if num_heads % len(HEAD_TYPES):
        logger.warning("MMA with %d heads, not a multiple of %d: default heads %s (set --mma-heads "
                       "to choose)", num_heads, len(HEAD_TYPES), ",".join(head_types))
    return head_types


def _window(cfg) -> int:
    window = safe_getattr(cfg, "mma_local_window")
    window = DEFAULT_WINDOW if window is None else window
    if window < 0:
        raise ValueError(f"--mma-local-window {window}: the window must be >= 0")
    return window


def _head_types(cfg) -> Tuple[str, ...]:
    num_heads = cfg.encoder.attention_heads
    spec = safe_getattr(cfg, "mma_heads")
    return parse_head_types(spec, num_heads) if spec else default_head_types(num_heads)


@ENCODER_SELF_ATTENTION.register(MIXED, selectable=True)
def build_mixed_attention(cfg, layer_idx, embed_dim):
    """MMA in the layers of ``--mma-layers``; None (fairseq's attention) elsewhere."""
    head_types, window = _head_types(cfg), _window(cfg)
    if layer_idx not in parse_layers(safe_getattr(cfg, "mma_layers") or ALL_LAYERS, cfg.encoder.layers,
                                      "--mma-layers", "encoder"):
        return None
    return MixedMultiheadAttention(
        embed_dim, cfg.encoder.attention_heads, head_types, window,
        dropout=cfg.attention_dropout,
        q_noise=cfg.quant_noise.pq, qn_block_size=cfg.quant_noise.pq_block_size,
    )


@register_model_hook
def drop_encoder_positions(model):
    """``--encoder-no-token-positional-embeddings``: the encoder's token embeddings carry no
    position (Table 3); the decoder keeps its positional embeddings. Runs before a
    checkpoint is loaded, so learned encoder positions are neither built nor expected."""
    if safe_getattr(model.encoder.cfg, "encoder_no_token_positional_embeddings", False):
        model.encoder.embed_positions = None


@register_model_architecture("slot_transformer", "mma_transformer_iwslt_de_en")
def mma_transformer_iwslt_de_en(args):
    """IWSLT14 De-En "small" model (spec A.4): fairseq's ``transformer_iwslt_de_en`` (6+6
    layers, d=512, 4 heads, FFN 1024) with dropout 0.3; MMA in every encoder layer, heads
    G,L,F,B (the default for 4 heads), w=1."""
    args.encoder_self_attention = getattr(args, "encoder_self_attention", MIXED)
    args.dropout = getattr(args, "dropout", 0.3)
    transformer_iwslt_de_en(args)
    slot_transformer(args)


@register_model_architecture("slot_transformer", "mma_transformer_wat")
def mma_transformer_wat(args):
    """WAT17 En-Ja/Ja-En "base" model (spec A.4): fairseq's ``transformer`` (6+6 layers,
    d=512, 8 heads, FFN 2048, dropout 0.1); MMA in every encoder layer, heads
    G,G,L,L,F,F,B,B (the default for 8 heads), w=1 [choice: inferred, spec A.2.1]."""
    args.encoder_self_attention = getattr(args, "encoder_self_attention", MIXED)
    slot_transformer(args)
