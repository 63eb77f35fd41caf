"""Every mechanism of the package as a tiny translation model, and the precision checks
that tests/test_half_precision.py (CPU, in CI) and tests/test_cuda.py (GPU) run on them."""
import pytest
import torch
import torch.nn.functional as F

from fairseq_helpers import build_model, full_logits, random_batch

from mlmha_fairseq.experiments.systems import SIZES, SYSTEMS, lookup
from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention, parse_variant
from mlmha_fairseq.modules.multi_layer_attention import VARIANTS  # noqa: F401  (the MLMHA tests of each variant)

# The GPU tier: ``pytest -m cuda`` on a machine with a GPU; skipped, with this reason, elsewhere.
CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False); run `pytest -m cuda` on one"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
HALF_TYPES = [torch.bfloat16, torch.float16]


def without_criterion(options):
    """A system's model options: a training criterion (the joint loss of multi-level
    supervision) is not built with the model."""
    options = list(options)
    if "--criterion" in options:
        at = options.index("--criterion")
        del options[at:at + 2]
    return options


# Stated tolerances of a half-precision run against fp32 of the same weights, about three
# times the largest deviation measured over all mechanisms at the test size on CPU (bf16
# keeps 8 mantissa bits, fp16 11). Incremental decoding against the full forward in half
# precision uses ``logits_atol`` too: the two computations round differently.
TOLERANCES = {
    torch.bfloat16: dict(logits_atol=0.1, loss_rtol=5e-3, min_grad_cosine=0.998),
    torch.float16: dict(logits_atol=0.015, loss_rtol=1e-3, min_grad_cosine=0.9995),
}

# name -> options on top of TINY_MODEL_ARGS (the first is the architecture): the systems of the
# package's one table that the tests build (``test_options`` not None), at the test size.
MECHANISMS = {
    system.key: [system.arch, *without_criterion(system.options), *system.test_options]
    for system in SYSTEMS if system.test_options is not None
}


# The documents' base width (d = 512, 8 heads, FFN 2,048; one embedding matrix shared three
# ways, dropout 0.1) at a depth a CPU runs in seconds: 3 encoder layers (MS-2 needs one above
# layer 2) and 2 decoder layers.
BASE = SIZES["base"]
BASE_WIDTH_ARGS = [*BASE.options(), "--encoder-layers", "3", "--decoder-layers", "2"]
# Every mechanism of MECHANISMS, plus the two systems whose --fp16 training at the base shape
# stopped at fairseq's minimum loss scale (docs/experiment/gpu-base/README.md, "fp16").
STOPPED_IN_FP16 = ("mlrf Both-FNN-SA", "MS-2 + AIF")
BASE_WIDTH_SYSTEMS = [*MECHANISMS, *STOPPED_IN_FP16]
# A trained post-norm model's magnitudes, which a freshly initialised one lacks: the shared
# embedding matrix 2x its initial scale (embedding outputs sqrt(d) E of std 2), every
# LayerNorm gain 4x (normalised states of std 4, up to ~90 in a peaked channel; with the tied
# output matrix, logits up to ~100), and the weights that reach the loss only through a
# LayerNorm 1,000x (MLRF's fusion FNN before its LN, outputs in the thousands: the function
# is scale-invariant, so fp32 computes the same model, and Adam grows such weights' norm
# without bound, Heo et al. 2021, AdamP). The loss is not scaled: fairseq's scaler halves its
# scale at each overflow of the gradients it multiplies, and a collapse below 1 (where the GPU
# runs of MLRF and MS-2 + AIF ended) means that the unscaled computation was not finite.
GROWN_EMBEDDING, GROWN_LAYER_NORM_GAIN, GROWN_SCALE_INVARIANT = 2.0, 4.0, 1000.0


def base_width_options(name):
    """``name``'s architecture and options at the base width. The tests' own depth and head
    overrides (``test_options``) are dropped, but for a deeper encoder that the system needs
    (MS-123 attaches auxiliary decoders to layers 1-3)."""
    system = lookup(name)
    extra = list(system.test_options or ())
    keep = extra[extra.index("--encoder-layers"):][:2] if "--encoder-layers" in extra else []
    return [system.arch, *BASE_WIDTH_ARGS, *without_criterion(system.options), *keep]


def grow_to_trained_magnitudes(model):
    """Scale ``model``'s weights in place to :data:`GROWN_EMBEDDING` and the other grown
    magnitudes above; returns ``model``."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                parameter.mul_(GROWN_EMBEDDING)
            elif ".ffn.fc2." in name:  # the MLRF fusion FNN's output layer, before its LayerNorm
                parameter.mul_(GROWN_SCALE_INVARIANT)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.mul_(GROWN_LAYER_NORM_GAIN)
    return model


def build_at_base_width(name, dtype=torch.float32, seed=0):
    """``name`` at the base width with grown magnitudes, cast to ``dtype``, in eval mode (no
    dropout: fp32 and half precision compute the same function)."""
    torch.manual_seed(seed)
    model = grow_to_trained_magnitudes(build_model(*base_width_options(name)))
    return model.to(dtype=dtype).eval(), model.decoder.dictionary


def build(name, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    arch, *options = MECHANISMS[name]
    model = build_model(arch, *options)
    return model.to(device=device, dtype=dtype).eval(), model.decoder.dictionary


def loss_and_gradients(model, dictionary, left_pad=True, **batch):
    """Teacher-forced cross-entropy of a padded batch (fp32 reduction), its logits and the
    gradient of every parameter, flattened into one fp32 vector. ``batch``: random_batch's
    sizes."""
    src, lengths, prev = random_batch(dictionary, left_pad=left_pad, **batch)
    device = next(model.parameters()).device
    src, lengths, prev = src.to(device), lengths.to(device), prev.to(device)
    model.zero_grad()
    logits = full_logits(model, src, lengths, prev)
    target = torch.roll(prev, -1, dims=1)
    loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach().float().cpu(), logits.detach().float().cpu(), grads.cpu()


def assert_close_to_fp32(reference, candidate, logits_atol, loss_rtol, min_grad_cosine):
    """``candidate`` (a half-precision run) agrees with ``reference`` (the fp32 run of the
    same weights): logits within ``logits_atol``, the loss within ``loss_rtol`` relative,
    and the gradient pointing the same way (cosine similarity)."""
    ref_loss, ref_logits, ref_grads = reference
    loss, logits, grads = candidate
    assert torch.isfinite(logits).all() and torch.isfinite(grads).all()
    torch.testing.assert_close(logits, ref_logits, atol=logits_atol, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=loss_rtol)
    assert grads.numel() == ref_grads.numel()
    cosine = F.cosine_similarity(grads, ref_grads, dim=0).item()
    assert cosine >= min_grad_cosine, f"gradient cosine {cosine:.4f} < {min_grad_cosine}"


def short_and_padded_batch(dictionary, left_pad):
    """Four sources of lengths 1 (EOS alone), 2, 5 and 7, padded on one side."""
    lengths = torch.tensor([1, 2, 5, 7])
    src = torch.full((4, 7), dictionary.pad())
    gen = torch.Generator().manual_seed(0)
    for row, length in enumerate(lengths.tolist()):
        words = torch.randint(dictionary.nspecial, len(dictionary), (length,), generator=gen)
        words[-1] = dictionary.eos()
        if left_pad:
            src[row, 7 - length:] = words
        else:
            src[row, :length] = words
    prev = torch.randint(dictionary.nspecial, len(dictionary), (4, 5), generator=gen)
    prev[:, 0] = dictionary.eos()
    return src, lengths, prev


def padded_logits(model, dictionary, left_pad):
    device = next(model.parameters()).device
    src, lengths, prev = short_and_padded_batch(dictionary, left_pad)
    with torch.no_grad():
        return full_logits(model, src.to(device), lengths.to(device), prev.to(device)).float().cpu()


def mlmha_with_a_fully_padded_row(variant, device, dtype):
    """MLMHA's output and query gradient (training mode, with and without weights) for a
    batch whose first source is padding only."""
    torch.manual_seed(0)
    joint, concat = parse_variant(variant)
    module = MultiLayerMultiheadAttention(16, 4, 3, joint, concat, bias=True).to(device=device, dtype=dtype).train()
    query = torch.randn(4, 3, 16, device=device, dtype=dtype, requires_grad=True)
    taps = torch.randn(3, 6, 3, 16, device=device, dtype=dtype)
    mask = torch.arange(6, device=device)[None, :] >= torch.tensor([0, 6, 4], device=device)[:, None]
    results = []
    for need_weights in (False, True):
        out, _ = module(query, taps, taps, key_padding_mask=mask, need_weights=need_weights)
        (grad,) = torch.autograd.grad(out.float().sum(), query)
        results.append((out, grad))
    return module, results
