"""Half precision on CPU (torch runs bfloat16 and float16 there): every mechanism's forward
and backward with the model cast to the half type agree with fp32 of the same weights, stay
finite with length-1 sources and either padding side, and incremental decoding keeps
matching the full forward; ``--bf16`` training runs end to end (tests/test_cuda.py repeats
the checks on a GPU)."""
import os
import subprocess
import sys

import pytest
import torch

from fairseq_helpers import assert_incremental_matches_full, generate, hypotheses_and_references, train_args
from mechanisms import MECHANISMS, assert_close_to_fp32, build, loss_and_gradients, padded_logits

# Stated tolerances against fp32, about three times the largest deviation measured over
# all mechanisms at the test size (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCES = {
    torch.bfloat16: dict(logits_atol=0.1, loss_rtol=5e-3, min_grad_cosine=0.998),
    torch.float16: dict(logits_atol=0.015, loss_rtol=1e-3, min_grad_cosine=0.9995),
}
HALF_TYPES = list(TOLERANCES)
# Incremental vs full forward in half precision: the step-by-step and the teacher-forced
# computations round differently.
INCREMENTAL_ATOL = {torch.bfloat16: 0.1, torch.float16: 0.015}


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_forward_backward_in_half_precision_agree_with_fp32(name, dtype):
    model, dictionary = build(name)
    reference = loss_and_gradients(model, dictionary)
    half, _ = build(name)
    assert_close_to_fp32(reference, loss_and_gradients(half.to(dtype), dictionary), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_short_sources_and_either_padding_side_stay_finite_in_half_precision(name, dtype):
    model, dictionary = build(name)
    model.to(dtype)
    left, right = padded_logits(model, dictionary, left_pad=True), padded_logits(model, dictionary, left_pad=False)
    assert torch.isfinite(left).all() and torch.isfinite(right).all()
    torch.testing.assert_close(left, right, atol=TOLERANCES[dtype]["logits_atol"], rtol=0)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("name", MECHANISMS)
def test_incremental_decoding_matches_full_forward_in_half_precision(name, dtype):
    model, dictionary = build(name)
    assert_incremental_matches_full(model.to(dtype), dictionary, atol=INCREMENTAL_ATOL[dtype], rtol=0)


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
