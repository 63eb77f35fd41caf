"""Checkpoint safety on torch >= 2.6 and bad input: a clear error, a non-zero exit, nothing lost."""
import os
import subprocess
import sys

import pytest
import torch

from fairseq_helpers import USER_DIR, run_fairseq, train_args


class _RunsCommandWhenUnpickled:
    """What a malicious checkpoint carries: unpickling it runs a shell command."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("trained")
    run_fairseq("train", *train_args(data_bin, save_dir, "slot_transformer"))
    return save_dir / "checkpoint_last.pt"


def test_checkpoint_needs_the_allow_list_and_loads_with_weights_only(trained):
    """Without the package, torch's weights-only loading refuses fairseq's checkpoint;
    with it, the same default loading succeeds."""
    load = f"import torch; torch.load({str(trained)!r})"
    bare = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True)
    assert bare.returncode != 0 and "argparse.Namespace" in bare.stderr
    plugin = subprocess.run([sys.executable, "-c", "import mlmha_fairseq; " + load], capture_output=True, text=True)
    assert plugin.returncode == 0, plugin.stderr


def test_checkpoint_with_a_pickled_callable_is_refused(trained, data_bin, tmp_path):
    sentinel = tmp_path / "code-was-run"
    state = torch.load(trained, weights_only=False)
    state["extra_state"]["payload"] = _RunsCommandWhenUnpickled(sentinel)
    malicious = tmp_path / "malicious.pt"
    torch.save(state, malicious)

    result = run_fairseq(
        "generate", data_bin, "--user-dir", USER_DIR, "--path", malicious, "--cpu", check=False
    )
    assert result.returncode != 0
    assert "Weights only load failed" in result.stderr
    assert "posix.system" in result.stderr or "os.system" in result.stderr
    assert not sentinel.exists()


def test_corrupt_checkpoint_fails_and_is_not_overwritten(trained, data_bin, tmp_path):
    corrupt = tmp_path / "checkpoint_last.pt"
    corrupt.write_bytes(trained.read_bytes()[:1000])
    before = corrupt.read_bytes()

    generate = run_fairseq("generate", data_bin, "--user-dir", USER_DIR, "--path", corrupt, "--cpu", check=False)
    assert generate.returncode != 0
    assert "failed finding central directory" in generate.stderr

    resume = run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer"), check=False)
    assert resume.returncode != 0
    assert corrupt.read_bytes() == before


def test_missing_data_directory(tmp_path):
    missing = tmp_path / "no-such-dir"
    result = run_fairseq("train", *train_args(missing, tmp_path, "slot_transformer"), check=False)
    assert result.returncode != 0
    assert f"No such file or directory: '{missing}'" in result.stderr
