"""Checkpoint safety on torch >= 2.6 and bad input: a clear error, a non-zero exit, nothing lost."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from fairseq.data import indexed_dataset

from fairseq_helpers import USER_DIR, binarize_n_way, run_fairseq, train_args
from mlmha_fairseq.data.multi_source_dataset import DataError
from test_multi_source import (
    CHANNELS,
    POSITIONS,
    SPLITS,
    setup_task,
    task_options,
    write_n_way_corpus,
)


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
    assert "Traceback" not in result.stderr and "weights_only" not in result.stderr  # no unsafe advice
    assert result.stderr.strip().splitlines()[-1] == (
        "generate.py: error: the checkpoint holds posix.system, which safe loading refuses: fairseq checkpoints "
        "store no such thing, so the file carries code or was not written by fairseq; do not load it")
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


# --- multi-source data: one line naming the file, exit status 1 ------------------------

def one_line_error(result):
    """The last stderr line of a fairseq tool stopped by the package's UsageError."""
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert ": error: " in last
    return last


@pytest.fixture(scope="module")
def n_way(tmp_path_factory):
    root = tmp_path_factory.mktemp("n_way")
    binarize_n_way(write_n_way_corpus(root), root / "bin")
    for split, _ in SPLITS:
        shutil.copy(root / f"{split}.img.npy", root / "bin" / f"{split}.img.npy")
    return root / "bin"


def copied(data, tmp_path):
    shutil.copytree(data, tmp_path / "bin")
    return tmp_path / "bin"


def test_training_on_misaligned_n_way_files_ends_with_one_line(n_way, tmp_path):
    data = copied(n_way, tmp_path)
    for suffix in ("bin", "idx"):  # train's s2 side (200 lines) as the valid split's (16)
        shutil.copy(data / f"train.s2-tgt.s2.{suffix}", data / f"valid.s2-tgt.s2.{suffix}")
    result = run_fairseq("train", *train_args(data, tmp_path / "ckpt", "multi_source_transformer",
                                              *task_options("s1,s2")), check=False)
    line = one_line_error(result)
    assert f"{data}/valid.s2-tgt.s2.bin has 200 sentences" in line


def test_training_with_image_features_of_the_wrong_row_count_ends_with_one_line(n_way, tmp_path):
    data = copied(n_way, tmp_path)
    np.save(data / "valid.img.npy", np.zeros((15, POSITIONS, CHANNELS), dtype=np.float32))
    result = run_fairseq("train", *train_args(data, tmp_path / "ckpt", "multi_source_transformer",
                                              *task_options("s1,img", "--image-sources", "img")), check=False)
    assert f"{data}/valid.img.npy has 15 rows" in one_line_error(result)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_image_features_with_nan_or_infinite_values_are_refused_when_read(n_way, tmp_path, value):
    """Issue 26: such features passed every check and training ended in fairseq's "gradients
    are Nan/Inf"; they are refused when the task reads the file, which is named with the row."""
    data = copied(n_way, tmp_path)
    features = np.load(data / "valid.img.npy")
    features[7, 1, 2] = value
    np.save(data / "valid.img.npy", features)
    task = setup_task(data, "s1,img", "--image-sources", "img")
    with pytest.raises(DataError, match=rf"^image features {data}/valid\.img\.npy: row 7 \(sentence 8\) holds "
                                        "NaN or infinite values"):
        task.load_dataset("valid")
    task.load_dataset("test")  # the untouched split still loads


def test_training_on_nan_image_features_ends_with_one_line(n_way, tmp_path):
    data = copied(n_way, tmp_path)
    features = np.load(data / "train.img.npy")
    features[-1, 0, 0] = np.nan
    np.save(data / "train.img.npy", features)
    result = run_fairseq("train", *train_args(data, tmp_path / "ckpt", "multi_source_transformer",
                                              *task_options("s1,img", "--image-sources", "img")), check=False)
    assert f"{data}/train.img.npy: row {len(features) - 1}" in one_line_error(result)


def test_an_empty_image_feature_file(n_way, tmp_path):
    data = copied(n_way, tmp_path)
    (data / "test.img.npy").write_bytes(b"")
    with pytest.raises(DataError, match=rf"cannot read image features {data}/test\.img\.npy"):
        setup_task(data, "s1,img", "--image-sources", "img")


def test_pairs_binarized_with_different_targets(n_way, tmp_path):
    """Only the first pair's target is read; a second pair binarized from a reordered
    target (same line count) would pair its source with the wrong sentences."""
    data = copied(n_way, tmp_path)
    prefix = str(data / "valid.s2-tgt.tgt")
    target = indexed_dataset.make_dataset(prefix, impl="mmap")
    sentences = [target[i] for i in reversed(range(len(target)))]
    builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(target))
    for sentence in sentences:
        builder.add_item(sentence)
    builder.finalize(prefix + ".idx")
    task = setup_task(data)
    with pytest.raises(DataError, match=rf"{data}/valid\.s2-tgt\.tgt\.bin differs from "
                                        rf"{data}/valid\.s1-tgt\.tgt\.bin at line 1:"):
        task.load_dataset("valid")
    task.load_dataset("test")  # the untouched split still loads


def test_generation_options_that_conflict_end_with_one_line(trained, data_bin):
    result = run_fairseq("generate", data_bin, "--user-dir", USER_DIR, "--path", trained, "--cpu",
                         "--task", "translation_gnmt", "--gnmt-lenpen", "0.6", "--print-alignment",
                         check=False)
    assert "--gnmt-lenpen cannot be combined with --print-alignment" in one_line_error(result)
