"""The GPU tier (``pytest -m cuda``; skipped with a reason without a GPU): every architecture
trains through fairseq-train in each of fairseq's half-precision modes, and every mechanism's
fp32 forward on the GPU equals its forward on the CPU. The half-precision model checks of
tests/test_half_precision.py have ``cuda`` copies too."""
import re

import pytest
import torch

from fairseq_helpers import full_logits, random_batch, run_fairseq, train_args
from mechanisms import CUDA_MARKS, MECHANISMS, build
from test_learning import PACKAGE_ARCHS

pytestmark = CUDA_MARKS

# fairseq's mixed-precision modes; --bf16 runs through mlmha_fairseq.cli.train, since
# fairseq-train turns it into --tpu.
PRECISIONS = {
    "fp16": ["--fp16"],
    "bf16": ["--bf16"],
    "amp": ["--amp"],
    "memory-efficient-fp16": ["--memory-efficient-fp16"],
}
UPDATES = 30
# fp32 on both devices with TF32 off: only the order of floating-point sums differs.
CUDA_CPU_ATOL = 1e-4


def gpu_train_args(data_bin, save_dir, arch, *extra):
    """The round trips' training options, on the GPU: a larger learning rate and more updates,
    so that the loss must fall, and every update logged."""
    args = train_args(data_bin, save_dir, arch, "--no-save", *extra, max_update=UPDATES)
    args = [arg for arg in args if arg != "--cpu"]
    args[args.index("--lr") + 1] = "0.005"
    return args


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", PACKAGE_ARCHS)
def test_training_in_half_precision_reduces_the_loss(arch, precision, data_bin, tmp_path):
    args = gpu_train_args(data_bin, tmp_path, arch, *PRECISIONS[precision])
    if precision == "bf16":
        result = run_fairseq("train", *args, module="mlmha_fairseq.cli.train")
    else:
        result = run_fairseq("train", *args)
    log = result.stdout + result.stderr
    losses = [float(loss) for loss in re.findall(r"train_inner.*?loss=([^,\s]+)", log)]
    updates = [int(n) for n in re.findall(r"num_updates=(\d+)", log)]
    assert updates and updates[-1] == UPDATES, log[-3000:]
    assert all(map(lambda loss: loss == loss and loss != float("inf"), losses)), losses
    # fp16's loss scaler skips an update when gradients overflow; a loop of overflows would
    # leave the count behind. Allow the few skips of the scaler's first calibration.
    assert len(re.findall(r"gradient overflow detected", log)) <= 3, log[-3000:]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses


@pytest.mark.parametrize("name", MECHANISMS)
def test_fp32_forward_on_the_gpu_equals_the_cpu(name, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model, dictionary = build(name)
    src, lengths, prev = random_batch(dictionary)
    with torch.no_grad():
        expected = full_logits(model, src, lengths, prev)
        model.cuda()
        actual = full_logits(model, src.cuda(), lengths.cuda(), prev.cuda()).cpu()
    torch.testing.assert_close(actual, expected, atol=CUDA_CPU_ATOL, rtol=0)
