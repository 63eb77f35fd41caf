import pytest
import torch

from mlmha_fairseq.cli import average_checkpoints as average_cli
from mlmha_fairseq.evaluation.checkpoint_averaging import average_checkpoints, last_checkpoints
from mlmha_fairseq.evaluation.text_io import InputError


def minimal_state(seed, num_updates):
    """A checkpoint made of tensors and plain containers only."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "args": None,
        "cfg": None,
        "model": {
            "weight": torch.randn(3, 4, generator=generator),
            "half": torch.randn(5, generator=generator).half(),
            "steps": torch.tensor([seed], dtype=torch.long),
        },
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "Adam",
                               "lr_scheduler_state": {}, "num_updates": num_updates}],
        "extra_state": {"train_iterator": {"epoch": seed}},
        "last_optimizer_state": None,
    }


@pytest.fixture
def checkpoints(tmp_path):
    states = [minimal_state(seed, 100 * seed) for seed in (1, 2, 3)]
    paths = []
    for epoch, state in enumerate(states, start=1):
        path = tmp_path / f"checkpoint{epoch}.pt"
        torch.save(state, path)
        paths.append(str(path))
    return states, paths


def test_average_floats_keep_rest_from_last(checkpoints):
    states, paths = checkpoints
    averaged = average_checkpoints(paths)
    expected = sum(s["model"]["weight"] for s in states) / 3
    torch.testing.assert_close(averaged["model"]["weight"], expected)
    expected_half = (sum(s["model"]["half"].double() for s in states) / 3).half()
    assert averaged["model"]["half"].dtype == torch.float16
    torch.testing.assert_close(averaged["model"]["half"], expected_half)
    assert torch.equal(averaged["model"]["steps"], states[-1]["model"]["steps"])
    assert averaged["extra_state"]["train_iterator"]["epoch"] == 3


def test_last_checkpoints_oldest_first(checkpoints):
    _, paths = checkpoints
    directory = paths[0].rsplit("/", 1)[0]
    assert last_checkpoints(directory, 2) == paths[1:]
    assert last_checkpoints(directory, 2, upper_bound=2) == paths[:2]
    with pytest.raises(InputError, match="need 4"):
        last_checkpoints(directory, 4)


def test_incompatible_checkpoints(tmp_path, checkpoints):
    _, paths = checkpoints
    other = minimal_state(4, 0)
    other["model"]["weight"] = torch.zeros(2, 2)
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(InputError, match="shape"):
        average_checkpoints([paths[0], str(tmp_path / "other.pt")])
    with pytest.raises(InputError, match="not found"):
        average_checkpoints([paths[0], str(tmp_path / "missing.pt")])


def test_cli_from_directory(tmp_path, checkpoints):
    states, paths = checkpoints
    output = tmp_path / "avg" / "averaged.pt"
    average_cli.main(["--input-dir", str(tmp_path), "--num-epoch-checkpoints", "2",
                      "--output", str(output)])
    averaged = torch.load(output)
    torch.testing.assert_close(averaged["model"]["weight"],
                               (states[1]["model"]["weight"] + states[2]["model"]["weight"]) / 2)


def test_cli_needs_a_count_with_directory(tmp_path, capsys, checkpoints):
    with pytest.raises(SystemExit) as exit_info:
        average_cli.main(["--input-dir", str(tmp_path), "--output", str(tmp_path / "x.pt")])
    assert exit_info.value.code == 2
    assert "--num-epoch-checkpoints" in capsys.readouterr().err


def test_cli_round_trip_with_fairseq_model(tmp_path):
    pytest.importorskip("mlmha_fairseq.compat")
    from fairseq import checkpoint_utils

    from fixtures.tiny_fairseq import build_task_and_model, save_checkpoint, write_data_bin

    data = write_data_bin(str(tmp_path / "data-bin"))
    paths, models = [], []
    for seed in (1, 2):
        cfg, _, model = build_task_and_model(data, seed=seed)
        paths.append(save_checkpoint(str(tmp_path / f"checkpoint{seed}.pt"), cfg, model))
        models.append(model)
    output = str(tmp_path / "averaged.pt")
    average_cli.main(["--inputs", *paths, "--output", output])
    loaded, _, _ = checkpoint_utils.load_model_ensemble_and_task([output], arg_overrides={"data": data})
    name = "encoder.layers.0.self_attn.q_proj.weight"
    expected = (models[0].state_dict()[name] + models[1].state_dict()[name]) / 2
    torch.testing.assert_close(loaded[0].state_dict()[name], expected)
