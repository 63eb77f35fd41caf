"""fairseq-preprocess -> fairseq-train --user-dir mlmha_fairseq -> fairseq-generate /
fairseq-interactive -> sacrebleu, on a tiny corpus, for every architecture of the package."""
import re

import pytest
import torch
from fairseq.models import ARCH_MODEL_REGISTRY

from fairseq_helpers import USER_DIR, assert_round_trip, run_fairseq, train_args

import mlmha_fairseq  # noqa: F401  (registers the architectures)

# every architecture of the package that runs on fairseq's translation task (the multi-source
# ones need their own task and have their own round trips in tests/test_multi_source.py)
PACKAGE_ARCHS = sorted(
    arch for arch, model in ARCH_MODEL_REGISTRY.items()
    if model.__module__.startswith("mlmha_fairseq.") and not getattr(model, "is_multi_source", False)
)


@pytest.mark.parametrize("arch", PACKAGE_ARCHS)
def test_train_generate_score(arch, data_bin, tmp_path):
    assert_round_trip(data_bin, tmp_path, arch)


def test_interactive_translates_stdin(data_bin, tmp_path):
    run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer"))
    result = run_fairseq(
        "interactive", data_bin, "--user-dir", USER_DIR,
        "--path", tmp_path / "checkpoint_last.pt", "--cpu", "--beam", "2",
        "--source-lang", "src", "--target-lang", "tgt",
        input="w1 w2 w3\nw4 w5\n",
    )
    assert len(re.findall(r"^H-\d+\t", result.stdout, flags=re.M)) == 2


def test_resume_continues_update_count(data_bin, tmp_path):
    run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer", max_update=3))
    resumed = run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer", max_update=5))
    assert re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ 3 updates\)", resumed.stdout + resumed.stderr)
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 5


def test_user_dir_by_name_from_any_directory(tmp_path):
    """``--user-dir mlmha_fairseq`` resolves outside the repository once installed, and
    an unknown slot value is refused by argparse with the valid choices."""
    result = run_fairseq(
        "train", "data", "--user-dir", "mlmha_fairseq", "--arch", "slot_transformer",
        "--decoder-cross-attention", "bogus", check=False, cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "argument --decoder-cross-attention: invalid choice: 'bogus'" in result.stderr
