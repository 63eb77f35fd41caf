"""The float16 headroom probe (mlmha_fairseq.evaluation.numerics, python -m
mlmha_fairseq.cli.numerics): its maxima equal a forward and backward computed by hand on a
toy model, and the command runs on a trained checkpoint and refuses bad input in one line."""
import json
import math

import pytest
import torch
from torch import nn

from fairseq_helpers import run_fairseq, train_args
from mlmha_fairseq.cli import numerics as numerics_cli
from mlmha_fairseq.evaluation.numerics import (
    FP16_MAX, NumericsRecorder, headroom_bits, layer_gradient_norms, layer_of, probe_numerics, underflow_margin_bits,
)
from test_eval_bad_input import cli_error


def toy():
    """``y = W2 relu(W1 x + b1) + b2`` with fixed weights, and one input batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return model, torch.randn(5, 3) * 100


def square_loss(model, sample):
    """fairseq's criterion interface: ``sum y^2`` over a sample of size 5."""
    return model(sample).pow(2).sum(), 5, {}


def test_maxima_equal_a_forward_and_backward_computed_by_hand():
    model, x = toy()
    (w1, b1), (w2, b2) = (model[0].weight, model[0].bias), (model[2].weight, model[2].bias)
    with torch.no_grad():
        hidden = x @ w1.T + b1
        active = hidden.clamp(min=0)
        y = active @ w2.T + b2
        grad_y = 2 * y  # d sum(y^2) / dy
        grad_active = grad_y @ w2
        grad_hidden = grad_active * (hidden > 0)
    result = probe_numerics(model, square_loss, [x, x])
    records = result.modules
    assert result.batches == 2
    for name, value, gradient in (("0", hidden, grad_hidden), ("1", active, grad_active), ("2", y, grad_y)):
        assert records[name].max_activation == pytest.approx(value.abs().max().item(), rel=1e-6)
        assert records[name].min_nonzero_activation == pytest.approx(value.abs()[value != 0].min().item(), rel=1e-6)
        assert records[name].max_gradient == pytest.approx(gradient.abs().max().item(), rel=1e-6)
    # layer "0" (Linear 1): the norm of dW1 and db1 of the per-token loss (sum / sample size 5)
    grad_w1, grad_b1 = grad_hidden.T @ x, grad_hidden.sum(dim=0)
    expected = math.sqrt(grad_w1.pow(2).sum() + grad_b1.pow(2).sum()) / 5
    assert result.layer_gradient_norms["0"] == pytest.approx(expected, rel=1e-5)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # left zeroed


def test_parameter_gradient_maxima_equal_the_hand_computed_ones():
    model, x = toy()
    w2 = model[2].weight
    with torch.no_grad():
        hidden = x @ model[0].weight.T + model[0].bias
        active = hidden.clamp(min=0)
        grad_y = 2 * (active @ w2.T + model[2].bias)
        grad_hidden = (grad_y @ w2) * (hidden > 0)
    records = probe_numerics(model, square_loss, [x, x]).modules
    # each batch's own gradients (zeroed in between), not their sum over the two batches
    for name, gradients in (("0", (grad_hidden.T @ x, grad_hidden.sum(dim=0))),
                            ("2", (grad_y.T @ active, grad_y.sum(dim=0)))):
        expected = max(gradient.abs().max().item() for gradient in gradients)
        assert records[name].max_parameter_gradient == pytest.approx(expected, rel=1e-6)
    assert records["1"].max_parameter_gradient == 0.0  # ReLU has no parameters


def test_headroom_and_underflow_margin_in_bits():
    assert headroom_bits(FP16_MAX / 8) == pytest.approx(3.0)
    assert headroom_bits(FP16_MAX * 2) == pytest.approx(-1.0)  # float16 overflows: inf
    assert headroom_bits(math.inf) == headroom_bits(math.nan) == -math.inf
    assert headroom_bits(0.0) is None
    assert underflow_margin_bits(2.0 ** -14) == pytest.approx(10.0)  # float16's smallest normal
    assert underflow_margin_bits(2.0 ** -26) == pytest.approx(-2.0)  # rounds to 0 in float16


def test_recorder_reads_dictionary_outputs_and_non_finite_values():
    class Encoder(nn.Module):
        def forward(self, x):
            return {"encoder_out": [x * 2], "lengths": torch.tensor([3])}

    encoder = Encoder()
    with NumericsRecorder(nn.Sequential(encoder)) as recorder:
        encoder(torch.tensor([1.0, -5.0, float("inf")]))
    assert recorder.records["0"].max_activation == math.inf
    assert headroom_bits(recorder.records["0"].max_activation) == -math.inf


def test_layer_of_groups_parameters_by_layer():
    assert layer_of("encoder.layers.3.self_attn.k_proj.weight") == "encoder.layers.3"
    assert layer_of("decoder.aux_decoders.0.layers.1.fc1.bias") == "decoder.aux_decoders.0.layers.1"
    assert layer_of("encoder.embed_tokens.weight") == "encoder.embed_tokens"
    model, x = toy()
    model(x).sum().backward()
    assert list(layer_gradient_norms(model)) == ["0", "2"]


@pytest.fixture(scope="module")
def checkpoint(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("numerics")
    run_fairseq("train", *train_args(data_bin, save_dir, "slot_transformer", max_update=1))
    return save_dir / "checkpoint_last.pt"


def test_command_writes_one_row_per_module_and_the_layer_gradient_norms(checkpoint, data_bin, tmp_path, capsys):
    prefix = tmp_path / "out"
    numerics_cli.main([str(checkpoint), str(checkpoint), "--names", "a", "b", "--data-bin", str(data_bin),
                       "--split", "valid", "--max-batches", "2", "--output-prefix", str(prefix)])
    assert "least float16 headroom" in capsys.readouterr().out
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result["models"]) == {"a", "b"} and result["models"]["a"]["batches"] == 1  # 16 sentences
    modules = {row["module"]: row for row in result["models"]["a"]["modules"]}
    assert modules["encoder.layers.2.final_layer_norm"]["activation_headroom_log2"] > 5
    assert modules["decoder.output_projection"]["gradient_headroom_log2"] > 0
    layers = [row["layer"] for row in result["models"]["a"]["layer_gradient_norms"]]
    assert {"encoder.layers.0", "encoder.layers.2", "decoder.layers.1"} <= set(layers)
    assert result["models"]["a"] == {**result["models"]["b"], "checkpoint": str(checkpoint)}
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0].startswith("model,module,max_abs_activation,activation_headroom_log2")
    assert len(lines) == 1 + 2 * len(modules)
    assert (tmp_path / "out.png").stat().st_size > 0


@pytest.mark.parametrize("options, message", [
    (["--split", "nosuch"], "--split nosuch"),
    (["--max-batches", "0"], "--max-batches: must be at least 1"),
])
def test_bad_input_is_refused_in_one_line(checkpoint, data_bin, tmp_path, capsys, options, message):
    line = cli_error(numerics_cli.main, [checkpoint, "--data-bin", data_bin, "--output-prefix", tmp_path / "out",
                                         *options], capsys)
    assert message in line
    assert not list(tmp_path.glob("out*"))


@pytest.fixture(scope="module")
def run_folder(data_bin, tmp_path_factory):
    """A run's save directory with the update checkpoints of updates 1 and 2."""
    save_dir = tmp_path_factory.mktemp("numerics-run")
    run_fairseq("train", *train_args(data_bin, save_dir, "slot_transformer", "--save-interval-updates", "1",
                                     "--keep-interval-updates", "-1", max_update=2))
    return save_dir


def test_a_save_directory_is_probed_as_a_series_in_update_order(run_folder, data_bin, tmp_path, capsys):
    prefix, alone = tmp_path / "series", tmp_path / "alone"
    numerics_cli.main([str(run_folder), "--names", "run", "--data-bin", str(data_bin), "--output-prefix", str(prefix)])
    assert "run (update 2)" in capsys.readouterr().out
    numerics_cli.main([str(run_folder / "checkpoint_1_2.pt"), "--data-bin", str(data_bin),
                       "--output-prefix", str(alone)])
    run = json.loads((tmp_path / "series.json").read_text())["models"]["run"]
    assert run["run"] == str(run_folder)
    assert [entry["update"] for entry in run["checkpoints"]] == [1, 2]
    assert run["checkpoints"][1] == json.loads((tmp_path / "alone.json").read_text())["models"]["checkpoint_1_2.pt"]
    assert run["checkpoints"][0]["modules"] != run["checkpoints"][1]["modules"]  # one update apart
    lines = (tmp_path / "series.csv").read_text().splitlines()
    assert lines[0].endswith(",update") and {line.rsplit(",", 1)[1] for line in lines[1:]} == {"1", "2"}
    assert (tmp_path / "series-over-training.png").stat().st_size > 0
    assert not (tmp_path / "series.png").exists()  # no single checkpoint to draw per module


def test_a_folder_without_update_checkpoints_is_refused_in_one_line(checkpoint, data_bin, tmp_path, capsys):
    line = cli_error(numerics_cli.main, [checkpoint.parent, "--names", "run", "--data-bin", data_bin,
                                         "--output-prefix", tmp_path / "out"], capsys)
    assert "no update checkpoints (checkpoint_EPOCH_UPDATE.pt" in line
    assert not list(tmp_path.glob("out*"))


def test_a_missing_checkpoint_is_refused_in_one_line(data_bin, tmp_path, capsys):
    line = cli_error(numerics_cli.main, [tmp_path / "missing.pt", "--data-bin", data_bin], capsys)
    assert "checkpoint not found" in line
