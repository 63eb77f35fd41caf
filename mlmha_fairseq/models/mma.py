"""Mixed Multi-Head Self-Attention (MMA; Cui et al., WNGT 2019).

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
from dataclasses import dataclass
from typing import FrozenSet, Tuple

from fairseq.models.transformer.transformer_legacy import transformer_iwslt_de_en

from ..errors import UsageError
from ..modules.mixed_attention import HEAD_TYPES, MixedMultiheadAttention
from .layer_selection import ALL_LAYERS, parse_layers
from .options import Mechanism, Option, Switch, register_architecture, register_mechanism
from .slot_transformer import slot_transformer
from .slots import ENCODER_SELF_ATTENTION

logger = logging.getLogger(__name__)

MIXED = "mixed"
DEFAULT_WINDOW = 1  # Table 5: w = 1 is best and is the main result's setting


@dataclass(frozen=True)
class MMAOptions:
    """The head types, window and layers of MMA, validated."""

    head_types: Tuple[str, ...]
    window: int
    layers: FrozenSet[int]  # 0-based

    @classmethod
    def from_cfg(cls, cfg) -> "MMAOptions":
        num_heads = cfg.encoder.attention_heads
        head_types = parse_head_types(cfg.mma_heads, num_heads) if cfg.mma_heads else default_head_types(num_heads)
        if cfg.mma_local_window < 0:
            raise UsageError(f"--mma-local-window {cfg.mma_local_window}: the window must be >= 0")
        layers = parse_layers(cfg.mma_layers, cfg.encoder.layers, "--mma-layers", "encoder")
        return cls(head_types, cfg.mma_local_window, layers)


# the words the help and the messages spell the letters with, accepted as well
HEAD_NAMES = dict(zip(("global", "local", "forward", "backward"), HEAD_TYPES))


def parse_head_types(heads: str, num_heads: int) -> Tuple[str, ...]:
    """``"G,L,F,B"`` or ``"global,local,forward,backward"`` -> ``("G", "L", "F", "B")``
    (case-insensitive), one per head."""
    names = [name.strip() for name in heads.split(",")]
    head_types = tuple(HEAD_NAMES.get(name.lower(), name.upper()) for name in names)
    unknown = [name for name, head_type in zip(names, head_types) if head_type not in HEAD_TYPES]
    if unknown:
        raise UsageError(
            f"--mma-heads {heads!r}: unknown head type(s) {unknown}; give a comma-separated "
            f"list of {', '.join(HEAD_TYPES)} or {', '.join(HEAD_NAMES)}"
        )
    if len(head_types) != num_heads:
        raise UsageError(
            f"--mma-heads {heads!r} lists {len(head_types)} head type(s) for "
            f"--encoder-attention-heads {num_heads}: give exactly one per head"
        )
    return head_types


@functools.lru_cache(maxsize=None)  # one warning per head count and process
def default_head_types(num_heads: int) -> Tuple[str, ...]:
    """[choice] contiguous blocks in the order of
    Concat(head_G, head_L, head_F, head_B), H/4 heads per type: G,L,F,B (4 heads),
    G,G,L,L,F,F,B,B (8). When H is not a multiple of 4 (the paper has no such model) head h
    takes type ``floor(4h / H)``, e.g. G,F for 2 heads, with a warning."""
    head_types = tuple(HEAD_TYPES[h * len(HEAD_TYPES) // num_heads] for h in range(num_heads))
    if num_heads % len(HEAD_TYPES):
        logger.warning("MMA with %d heads, not a multiple of %d: default heads %s (set --mma-heads "
                       "to choose)", num_heads, len(HEAD_TYPES), ",".join(head_types))
    return head_types


MMA = register_mechanism(Mechanism(
    "MMA", Switch(f"--encoder-self-attention {MIXED}",
                  lambda args: getattr(args, "encoder_self_attention", None) == MIXED), (
        Option("--mma-heads", None, "MMA head types in head order, one of G (global), L (local), "
               "F (forward: itself and later), B (backward: itself and earlier) per head, as "
               "letters or words, e.g. G,G,L,L,F,F,B,B or global,local,forward,backward (default: "
               "H/4 heads of each type in blocks G, L, F, B)",
               argparse=dict(metavar="SPEC")),
        Option("--mma-local-window", DEFAULT_WINDOW, "window of the local heads: query i sees keys "
               f"i-W..i+W, in tokens of the model's input, EOS included (default: {DEFAULT_WINDOW})",
               argparse=dict(type=int, metavar="W")),
        Option("--mma-layers", ALL_LAYERS, "encoder layers with MMA, 1-based: 'all' (default), "
               "'none' or a list of layers and ranges such as 1-3,6; the others keep fairseq's "
               "self-attention", argparse=dict(metavar="LAYERS")),
    ), parse=MMAOptions.from_cfg))


@ENCODER_SELF_ATTENTION.register(MIXED, selectable=True)
def build_mixed_attention(cfg, layer_idx, embed_dim):
    """MMA in the layers of ``--mma-layers``; None (fairseq's attention) elsewhere."""
    options = MMA.parsed(cfg)
    if layer_idx not in options.layers:
        return None
    return MixedMultiheadAttention(
        embed_dim, cfg.encoder.attention_heads, options.head_types, options.window,
        dropout=cfg.attention_dropout,
        q_noise=cfg.quant_noise.pq, qn_block_size=cfg.quant_noise.pq_block_size,
    )


@register_architecture("slot_transformer", "mma_transformer_iwslt_de_en")
def mma_transformer_iwslt_de_en(args):
    """IWSLT14 De-En "small" model (Cui et al. 2019, §4.2): fairseq's ``transformer_iwslt_de_en`` (6+6
    layers, d=512, 4 heads, FFN 1024) with dropout 0.3; MMA in every encoder layer, heads
    G,L,F,B (the default for 4 heads), w=1."""
    args.encoder_self_attention = getattr(args, "encoder_self_attention", MIXED)
    args.dropout = getattr(args, "dropout", 0.3)
    transformer_iwslt_de_en(args)
    slot_transformer(args)


@register_architecture("slot_transformer", "mma_transformer_wat")
def mma_transformer_wat(args):
    """WAT17 En-Ja/Ja-En "base" model (Cui et al. 2019, §4.2): fairseq's ``transformer`` (6+6 layers,
    d=512, 8 heads, FFN 2048, dropout 0.1); MMA in every encoder layer, heads
    G,G,L,L,F,F,B,B (the default for 8 heads), w=1 [choice: inferred from Table 1]."""
    args.encoder_self_attention = getattr(args, "encoder_self_attention", MIXED)
    slot_transformer(args)
