"""Data-parallel training on CPU: two ranks (gloo, one process each, loopback) end with
identical parameters, as fairseq's DDP must guarantee, although each saw other batches;
started one by one or by torchrun, and equal to one process that accumulates the same
batches."""
import argparse
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from fairseq_helpers import USER_DIR, train_args
from mlmha_fairseq.cli import train as cli_train
from mlmha_fairseq.errors import UsageError

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 300


def worker_env():
    """The environment of the rank processes: the package imported from the folder the tests
    pass as --user-dir (fairseq refuses a --user-dir whose package is already imported from
    another path, e.g. the link in site-packages)."""
    paths = [os.path.dirname(USER_DIR), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_data_parallel(data_bin, tmp_path, arch, *extra, max_update=3):
    port = free_port()
    env = {**worker_env(), "DDP_DUMP_DIR": str(tmp_path)}
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


# the slot model, and a mechanism whose auxiliary decoder feeds only the joint loss
TORCHRUN_SYSTEMS = {
    "slot_transformer": ["slot_transformer"],
    "ms_transformer": ["ms_transformer", "--aux-decoder-layers", "1",
                       "--criterion", "multi_decoder_label_smoothed_cross_entropy"],
}
# Without dropout, two ranks of one batch each and one process accumulating both batches
# (--update-freq 2) compute the same update: fairseq shards the same shuffled batches over
# the ranks in turn and sums the gradients over the same sample size.
DETERMINISTIC = ["--dropout", "0", "--ddp-backend", "legacy_ddp"]


def run_dumping(command, dump_dir):
    dump_dir.mkdir(exist_ok=True)
    result = subprocess.run(command, env={**worker_env(), "DDP_DUMP_DIR": str(dump_dir), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


# CI: the mechanism (the slot model's ranks are compared above, and under torchrun by `make exhaustive`)
@pytest.mark.parametrize("system", [pytest.param(name, marks=[pytest.mark.exhaustive] if name == "slot_transformer"
                                                 else []) for name in TORCHRUN_SYSTEMS])
def test_torchrun_two_cpu_ranks_equal_one_process_over_the_same_batches(system, data_bin, tmp_path):
    """``torchrun --nproc_per_node 2 -m mlmha_fairseq.cli.train ... --cpu --distributed-backend
    gloo`` (tests/ddp_worker.py standing in for it, to read every rank's parameters)."""
    arch, *extra = TORCHRUN_SYSTEMS[system]
    args = [*map(str, train_args(data_bin, tmp_path / "ckpt", arch, *extra, *DETERMINISTIC)),
            "--distributed-backend", "gloo"]
    log = run_dumping([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                       WORKER, *args], tmp_path / "ranks")
    assert "distributed init (rank 1): env://" in log
    rank0, rank1 = (torch.load(tmp_path / "ranks" / f"rank{r}.pt") for r in range(2))
    single_args = [*map(str, train_args(data_bin, tmp_path / "ckpt1", arch, *extra, *DETERMINISTIC)),
                   "--update-freq", "2"]
    run_dumping([sys.executable, WORKER, *single_args], tmp_path / "single")
    single = torch.load(tmp_path / "single" / "rank0.pt")

    assert rank0["num_updates"] == rank1["num_updates"] == single["num_updates"] == 3
    assert rank0["params"].keys() == rank1["params"].keys() == single["params"].keys()
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name
        assert not torch.equal(value, rank0["initial"][name]), f"{name} did not move"
        # summation order of the all-reduce aside, the same arithmetic
        torch.testing.assert_close(value, single["params"][name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("backend", ["nccl"])
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.cuda
def test_spawned_gpu_ranks_hold_identical_parameters(backend, data_bin, tmp_path):
    """fairseq's own launch: one spawned process per GPU (``--distributed-world-size 2``
    without ``--distributed-no-spawn``; fairseq refuses this path on CPUs)."""
    args = [arg for arg in map(str, train_args(data_bin, tmp_path / "ckpt", "ms_transformer", "--aux-decoder-layers", "1",
                                               "--criterion", "multi_decoder_label_smoothed_cross_entropy"))
            if arg != "--cpu"]
    run_dumping([sys.executable, WORKER, *args, "--distributed-world-size", "2", "--distributed-backend", backend],
                tmp_path / "ranks")
    rank0, rank1 = (torch.load(tmp_path / "ranks" / f"rank{r}.pt") for r in range(2))
    assert rank0["num_updates"] == rank1["num_updates"] == 3
    for name, value in rank0["params"].items():
        assert torch.equal(value, rank1["params"][name]), name


SRUN_TASK = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[7-8]"}


def srun_args(world_size=2):
    return argparse.Namespace(distributed_world_size=world_size, distributed_port=12345,
                              distributed_init_method=None, distributed_rank=0, distributed_no_spawn=False)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol (scripts/start_slurm.sh)")
def test_a_cpu_task_of_srun_meets_on_the_first_node_with_its_slurm_rank(monkeypatch):
    """What fairseq's Slurm initialisation derives on GPUs (which fails on CPUs:
    mlmha_fairseq/cli/train.py), from the same variables; the run itself is in the Slurm tier
    (tests/test_experiment_slurm.py)."""
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)
    args = srun_args()
    cli_train.slurm_cpu_rank(args)
    assert (args.distributed_init_method, args.distributed_rank, args.distributed_no_spawn) == (
        "tcp://node7:12345", 1, True)


def test_a_cpu_run_whose_world_size_is_not_its_task_count_is_refused(monkeypatch):
    for name, value in SRUN_TASK.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=r"--distributed-world-size 4 does not match this Slurm step's 2 task"):
        cli_train.slurm_cpu_rank(srun_args(4))
