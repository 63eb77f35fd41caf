"""Data-parallel training on CPU: two ranks (gloo, one process each, loopback) end with
identical parameters, as fairseq's DDP must guarantee, although each saw other batches."""
import os
import socket
import subprocess
import sys

import torch

from fairseq_helpers import train_args

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 300


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_data_parallel(data_bin, tmp_path, arch, *extra, max_update=3):
    port = free_port()
    env = {**os.environ, "DDP_DUMP_DIR": str(tmp_path)}
    ranks = [
        subprocess.Popen(
            [sys.executable, WORKER, *map(str, train_args(data_bin, tmp_path / "ckpt", arch, *extra, max_update=max_update)),
             "--distributed-world-size", str(WORLD_SIZE), "--distributed-rank", str(rank),
             "--distributed-init-method", f"tcp://127.0.0.1:{port}",
             "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp", "--distributed-no-spawn"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    logs = [rank.communicate(timeout=TIMEOUT_S)[0] for rank in ranks]
    for rank, log in zip(ranks, logs):
        assert rank.returncode == 0, log[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)], logs


def assert_ranks_identical_after_training(data_bin, tmp_path, arch, *extra):
    (rank0, rank1), logs = train_data_parallel(data_bin, tmp_path, arch, *extra)
    assert rank0["num_updates"] == rank1["num_updates"] == 3
    assert "distributed init (rank 1)" in "".join(logs)
    assert rank0["params"].keys() == rank1["params"].keys()
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


def test_two_cpu_ranks_hold_identical_parameters(data_bin, tmp_path):
    assert_ranks_identical_after_training(data_bin, tmp_path, "slot_transformer")
