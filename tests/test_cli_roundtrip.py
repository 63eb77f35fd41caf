"""fairseq-preprocess -> fairseq-train --user-dir mlmha_fairseq -> fairseq-interactive, resuming,
and --user-dir by name. Every architecture's train -> generate -> score round trip, with what
it must have learned, is in tests/test_learning.py."""
import re

import torch

from fairseq_helpers import USER_DIR, run_fairseq, train_args


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
