"""The benchmark module runs end to end and measures what it says (tiny settings)."""
import json

import pytest
import torch

from mlmha_fairseq.cli import benchmark

TINY = ["--sentences", "2", "--length", "6", "--gen-sentences", "1", "--steps", "1",
        "--vocab-size", "100", "--beam", "2"]


def test_benchmark_writes_ratios_against_fairseq_transformer(tmp_path):
    benchmark.main(["--configs", "mlmha M-01", *TINY, "--output-dir", str(tmp_path)])
    results = {row["name"]: row for row in json.load(open(tmp_path / "benchmark.json"))["results"]}
    assert list(results) == ["transformer", "mlmha M-01"]
    assert results["transformer"]["flop_ratio"] == 1.0
    assert results["mlmha M-01"]["flop_ratio"] > 1.0
    assert results["mlmha M-01"]["params"] > results["transformer"]["params"]
    assert results["transformer"]["sdpa_backend"] == ""  # no MLMHA
    assert results["mlmha M-01"]["sdpa_backend"] in {"flash (cpu)", "math"}
    for name in ("benchmark.csv", "benchmark.md", "benchmark.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_half_precision_training_step_runs_fairseqs_fp16_optimizer():
    """--dtype bf16: the model in bfloat16, updated through fairseq's FP16Optimizer (fp32
    master weights), as fairseq-train --bf16 trains."""
    opts = benchmark.parse_args(TINY + ["--dtype", "bf16", "--device", "cpu"])
    subject = benchmark.Subject("mlmha M-00", opts, torch.device("cpu"))
    before = [p.detach().clone() for p in subject.model.parameters()]
    subject.train_step()
    assert all(p.dtype == torch.bfloat16 for p in subject.model.parameters())
    assert type(subject.optimizer).__name__ == "FP16Optimizer"
    moved = [not torch.equal(b, p) for b, p in zip(before, subject.model.parameters())]
    assert sum(moved) > len(moved) // 2
    assert benchmark.sdpa_backend(subject, opts) in {"flash (cpu)", "math"}


ACTIONS = ("train_step", "generate")


@pytest.fixture(scope="module")
def baseline_flops():
    """fairseq's transformer's FLOPs per action, counted once: a Subject is seeded and its beam
    search forced to ``--length`` tokens, so every count of it is the same."""
    baseline = benchmark.Subject(benchmark.BASELINE, benchmark.parse_args(TINY + ["--device", "cpu"]),
                                 torch.device("cpu"))
    return {action: baseline.flops(action) for action in ACTIONS}


@pytest.mark.parametrize("name", [key for key in benchmark.CONFIGURATIONS if key != benchmark.BASELINE])
def test_every_configuration_counts_its_flops(name, baseline_flops):
    """Each configuration's training step and beam search run under torch's FLOP counter
    (whose module tracker refuses some tensors a model may hand between modules) and cost
    at least what fairseq's transformer costs."""
    subject = benchmark.Subject(name, benchmark.parse_args(TINY + ["--device", "cpu"]), torch.device("cpu"))
    for action in ACTIONS:
        assert subject.flops(action) >= baseline_flops[action] > 0
        if name == "slot_transformer":  # it is fairseq's transformer
            assert subject.flops(action) == baseline_flops[action]
