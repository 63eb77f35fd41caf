"""Half precision: every mechanism's forward and backward with the model cast to bfloat16 or
float16 agree with fp32 of the same weights, stay finite with length-1 sources, either
padding side and fully padded rows, and incremental decoding keeps matching the full
forward. On CPU (torch runs both types there) these run in CI; the ``cuda`` copies run on a
GPU (``pytest -m cuda``). ``--bf16`` training runs end to end on CPU."""
import os
import subprocess
import sys

import pytest
import torch

from fairseq_helpers import assert_incremental_matches_full, generate, hypotheses_and_references, train_args
from mlmha_fairseq.modules.multi_layer_attention import MultiLayerMultiheadAttention, parse_variant
from mlmha_fairseq.modules.representation_fusion import FusionOptions, build_fusion
from mechanisms import (
    BASE, BASE_WIDTH_SYSTEMS, DEVICES, HALF_TYPES, MECHANISMS, TOLERANCES, VARIANTS, assert_close_to_fp32, build,
    build_at_base_width, loss_and_gradients, mlmha_with_a_fully_padded_row, padded_logits,
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_forward_backward_in_half_precision_agree_with_fp32(name, dtype, device):
    reference = loss_and_gradients(*build(name, device))
    candidate = loss_and_gradients(*build(name, device, dtype))
    assert_close_to_fp32(reference, candidate, **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_short_sources_and_either_padding_side_stay_finite_in_half_precision(name, dtype, device):
    model, dictionary = build(name, device, dtype)
    left, right = padded_logits(model, dictionary, left_pad=True), padded_logits(model, dictionary, left_pad=False)
    assert torch.isfinite(left).all() and torch.isfinite(right).all()
    torch.testing.assert_close(left, right, atol=TOLERANCES[dtype]["logits_atol"], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_incremental_decoding_matches_full_forward_in_half_precision(name, dtype, device):
    model, dictionary = build(name, device, dtype)
    assert_incremental_matches_full(model, dictionary, atol=TOLERANCES[dtype]["logits_atol"], rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fully_padded_row_stays_finite_in_half_precision(variant, dtype, device):
    module, results = mlmha_with_a_fully_padded_row(variant, device, dtype)
    for out, grad in results:
        assert out.dtype == dtype
        assert torch.isfinite(out).all() and torch.isfinite(grad).all()
        # no context for the empty row: its output is the output projection's bias alone
        torch.testing.assert_close(out[:, 0], module.out_proj.bias.expand(4, 16), atol=0, rtol=0)


def test_bf16_training_round_trip_on_cpu(data_bin, tmp_path):
    """``python -m mlmha_fairseq.cli.train --cpu --bf16`` trains in bfloat16 (fairseq-train
    itself turns --bf16 into --tpu) and its checkpoint decodes."""
    args = train_args(data_bin, tmp_path, "slot_transformer", "--decoder-cross-attention", "multi-layer", "--bf16")
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.train", *map(str, args)],
                            capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ})
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]
    # fairseq's wrapper of the optimizer that keeps fp32 master weights for a half-precision model
    assert state["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"
    assert state["optimizer_history"][-1]["num_updates"] == 3
    hyps, refs = hypotheses_and_references(generate(data_bin, tmp_path / "checkpoint_last.pt"))
    assert len(hyps) == len(refs) == 16


# the batch of the base-width check: 4 sentences of up to 12 source and 10 target tokens
BASE_WIDTH_BATCH = dict(batch_size=4, src_len=12, tgt_len=10)


@pytest.mark.parametrize("name", BASE_WIDTH_SYSTEMS)
def test_base_width_with_trained_magnitudes_stays_finite_and_close_to_fp32_in_fp16(name):
    """At the base width (d = 512, 8 heads, FFN 2,048) with a trained model's magnitudes
    (:func:`mechanisms.grow_to_trained_magnitudes`), float16's unscaled forward and backward
    stay finite (its largest value is 65,504) and agree with fp32 of the
    same weights: logits within 1 % of their largest magnitude, the loss within 1 %, and the
    gradient pointing the same way."""
    reference = loss_and_gradients(*build_at_base_width(name), **BASE_WIDTH_BATCH)
    loss, logits, grads = loss_and_gradients(*build_at_base_width(name, torch.float16),
                                             **BASE_WIDTH_BATCH)
    ref_loss, ref_logits, ref_grads = reference
    assert torch.isfinite(ref_logits).all() and torch.isfinite(ref_grads).all()
    assert torch.isfinite(logits).all(), "non-finite logits in float16"
    assert torch.isfinite(grads).all(), "non-finite gradients in float16"
    torch.testing.assert_close(logits, ref_logits, atol=0.01 * ref_logits.abs().max().item(), rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0.01)
    cosine = torch.nn.functional.cosine_similarity(grads.double(), ref_grads.double(), dim=0).item()
    assert cosine >= 0.99, f"gradient cosine {cosine:.4f} < 0.99"


@pytest.mark.parametrize("autocast", [False, True], ids=["half-model", "autocast"])
@pytest.mark.parametrize("function", ["fnn", "sa"])
def test_mlrf_fusion_in_fp16_does_not_depend_on_the_scale_its_layer_norm_removes(function, autocast):
    """MLRF's FNN and SA fusions end in ``LN(FNN(.))`` (Wang et al. 2018, Eq. 3): scaling the
    FNN's output layer by c leaves their function unchanged, so training does not bound that
    scale (Adam grows such scale-invariant weights, Heo et al. 2021). At the base width with
    normalised states of std 4 (K = 7: the embedding output and six layers), float16 gives the
    function of fp32 whatever the scale: ``c W_b`` with c = 10^5 puts the FNN's output near
    10^5, beyond float16's 65,504. Float16 as ``--fp16`` runs it (the module cast to float16)
    and as ``--amp`` does (float32 weights under autocast to float16)."""
    torch.manual_seed(0)
    fusion = build_fusion(function, 7, BASE.embed_dim, FusionOptions()).eval()
    states = (torch.randn(7, 10, 3, BASE.embed_dim) * 4).requires_grad_()
    layer_embedding = torch.empty(7, BASE.embed_dim).uniform_(-0.1, 0.1)
    expected = fusion(states, layer_embedding)
    direction = torch.randn_like(expected)  # of the gradient: a random linear function of the output
    (expected_grad,) = torch.autograd.grad((expected * direction).sum(), states)
    with torch.no_grad():
        fusion.ffn.fc2.weight.mul_(1e5)
        fusion.ffn.fc2.bias.mul_(1e5)
    if not autocast:
        fusion.half()
    inputs = states.detach().to(torch.float32 if autocast else torch.float16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = fusion(inputs, layer_embedding.to(inputs.dtype))
    (grad,) = torch.autograd.grad((out.float() * direction).sum(), inputs)
    assert autocast or out.dtype == torch.float16  # under autocast, the dtype of the op before
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(out.float(), expected.detach(), atol=0.02, rtol=0)
    cosine = torch.nn.functional.cosine_similarity(grad.double().flatten(), expected_grad.double().flatten(), dim=0)
    assert cosine >= 0.999, f"gradient cosine {cosine:.4f} < 0.999"


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlmha_weights_path_scales_the_query_before_the_product_in_fp16(variant):
    """MLMHA with weights (Eqs. 8-10, the path of need_weights) at the base width in float16:
    queries and keys of +-32 per element give scaled scores of 32 x 32 x 64 / 8 = 8,192 per tap
    (the joint variants sum two taps' products), finite in float16, while the unscaled
    products (65,536 and more) are not; the softmax peaks on the key aligned with the query."""
    torch.manual_seed(0)
    joint, concat = parse_variant(variant)
    module = MultiLayerMultiheadAttention(BASE.embed_dim, BASE.heads, 2, joint, concat, bias=False).half().eval()
    with torch.no_grad():
        for weight in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight):
            weight.copy_(torch.eye(BASE.embed_dim))  # each tap's projection the identity
    signs = torch.randint(0, 2, (5, 1, BASE.embed_dim)).half() * 2 - 1
    query = 32 * signs[:1]  # Tt = 1, B = 1: the sign pattern of key 0
    taps = (32 * signs).expand(2, -1, -1, -1)  # n = 2 taps, Ts = 5
    with torch.no_grad():
        out, weights = module(query, taps, taps, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(weights[0, 0], torch.eye(5)[0].half())
