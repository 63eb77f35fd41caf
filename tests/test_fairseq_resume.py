"""fairseq-train's restore, as docs/experiment-runner.md ("stopped and resumed runs") describes
it: a run resumed within its first epoch continues the run that was not stopped bit for bit,
and one resumed after it does not, since the restart builds the batches again with the resume
epoch as the seed of the length sort's tie-breaking (``FairseqTask.get_batch_iterator``). This
is fairseq's behaviour, not the package's: pinned so that the docs change if fairseq's does."""
import re

import pytest
import torch

from fairseq_helpers import run_fairseq, train_args

pytestmark = pytest.mark.cli


def train(data_bin, save_dir, max_update):
    args = train_args(data_bin, save_dir, "transformer", "--dropout", "0.3", "--no-epoch-checkpoints",
                      max_update=max_update)
    return run_fairseq("train", *args)


def weights(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]


def largest_difference(first, second):
    return max((first[name] - second[name]).abs().max().item() for name in first)


def test_a_run_resumed_after_its_first_epoch_departs_from_the_one_not_stopped(data_bin, tmp_path):
    total = 40
    straight = train(data_bin, tmp_path / "straight", total)
    epoch = int(re.search(r"epoch 001 \|.*?num_updates (\d+)", straight.stdout + straight.stderr).group(1))
    assert 2 < epoch < total - 1, epoch
    within, after = tmp_path / "within", tmp_path / "after"
    train(data_bin, within, 2)          # stopped inside the first epoch
    train(data_bin, after, epoch + 1)   # stopped one update into the second
    for save_dir in (within, after):
        resumed = train(data_bin, save_dir, total)
        assert "Loaded checkpoint" in resumed.stdout + resumed.stderr
    reference = weights(tmp_path / "straight")
    assert largest_difference(weights(within), reference) == 0
    assert largest_difference(weights(after), reference) > 1e-4
