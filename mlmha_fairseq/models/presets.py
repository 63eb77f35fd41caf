"""Model sizes and settings shared by the presets of the MLMHA paper and the thesis.

A preset function sets only what the user did not give (``getattr(args, x, default)``), then
completes the rest with the slot Transformer's defaults (fairseq's ``transformer``).
"""
from .slot_transformer import slot_transformer


def set_sizes(args, embed_dim: int, heads: int, ffn: int, encoder_layers: int, decoder_layers: int):
    """A preset's model sizes, for what the user did not give. The decoder's width and FFN
    follow the encoder's (fairseq's convention), so ``--encoder-embed-dim`` alone resizes
    both."""
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", embed_dim)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", ffn)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", heads)
    args.encoder_layers = getattr(args, "encoder_layers", encoder_layers)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", args.encoder_embed_dim)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", args.encoder_ffn_embed_dim)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", heads)
    args.decoder_layers = getattr(args, "decoder_layers", decoder_layers)


def thesis_small(args):
    """The "small" IWSLT Transformer of the MLMHA paper and the thesis: d=256, 4 heads, FFN
    1024, 4+4 layers (Ampomah et al. 2020, §5.2; thesis §3.3.2; thesis Table 5.1 prints FFN
    512, read as a typo: its baselines are chapter 3's, trained with 1024)."""
    set_sizes(args, embed_dim=256, heads=4, ffn=1024, encoder_layers=4, decoder_layers=4)
    thesis_settings(args)


def thesis_base(args):
    """The documents' "base" WMT'14 En-De Transformer: d=512, 8 heads, FFN 2048, 6+6 layers
    (fairseq's defaults)."""
    thesis_settings(args)


def thesis_pre_norm(args):
    """Pre-norm layers with final LayerNorms, as the authors' released code that ran the
    thesis' chapter 3 and 4 experiments (every sublayer ``x + Dropout(Sublayer(LN(x)))``); the
    Source Feature Collector and the auxiliary decoders then give every collected encoder
    layer its own LayerNorm, as that code does. The thesis' equations are post-norm: the
    ``*_post_norm`` presets."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)


def post_norm(args):
    """Post-norm layers (the documents' equations, fairseq's default), before a preset."""
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", False)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", False)


def thesis_settings(args):
    """Dropout 0.1 (thesis §3.3.2, §4.3.2 and Table 5.1), attention and ReLU dropout 0.1 (the
    authors' released code) and one shared vocabulary (Ampomah et al. 2020, §5.1; thesis §3.3.1)
    tied three ways (``--share-all-embeddings``)."""
    args.dropout = getattr(args, "dropout", 0.1)
    args.attention_dropout = getattr(args, "attention_dropout", 0.1)
    args.activation_dropout = getattr(args, "activation_dropout", 0.1)
    args.share_all_embeddings = getattr(args, "share_all_embeddings", True)
    slot_transformer(args)
