"""The experiment runner on a real Slurm cluster (scripts/start_slurm.sh starts a one-node one
as root; CI does), through submitit: a grid of two systems submitted as jobs, one job cancelled with
scancel, the runner started again resubmits it and collects all; the table equals a local run's."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from fairseq_helpers import DECODING, results_rows
from mlmha_fairseq.cli import experiment
from mlmha_fairseq.experiments.slurm import JOB_FILE, queued_or_running


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True)
    return result.returncode == 0 and "up" in result.stdout


pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not _cluster_up(), reason="no Slurm cluster answers sinfo: "
                                                    "start one with scripts/start_slurm.sh (as root)")]

GRID = """
work_dir = "{work}"
seeds = 1
systems = ["transformer", "MLMHA M-00"]
max_update = 3
beam = 1
""" + DECODING + """
{launcher}
[corpus]
dir = "{corpus}"
"""
ARGS = ["--ar-trials", "20", "--bootstrap-samples", "20"]


def cancel(job_id: str) -> None:
    """scancel, and wait until Slurm no longer lists the job: a runner started before then would
    find it still running and wait for it rather than resubmit its run."""
    subprocess.run(["scancel", job_id], check=True)
    deadline = time.time() + 60
    while queued_or_running(job_id):
        assert time.time() < deadline, f"job {job_id} still queued after scancel"
        time.sleep(1)


def test_a_grid_through_slurm_with_a_cancelled_job_resubmitted_equals_a_local_run(tmp_path, corpus):
    slurm_work, local_work = tmp_path / "slurm", tmp_path / "local"
    launcher = '[launcher]\ncpus_per_run = 1\ntime_min = 10\nwait = {wait}'
    submit_only, collect = tmp_path / "submit.toml", tmp_path / "collect.toml"
    submit_only.write_text(GRID.format(work=slurm_work, corpus=corpus, launcher=launcher.format(wait="false")))
    collect.write_text(GRID.format(work=slurm_work, corpus=corpus, launcher=launcher.format(wait="true")))

    assert experiment.main([str(submit_only), *ARGS]) == 0  # submitted, nothing to table yet
    jobs = sorted(slurm_work.glob(f"runs/*/seed*/{JOB_FILE}"))
    assert len(jobs) == 2
    cancelled = (slurm_work / "runs" / "mlmha-m-00" / "seed1" / JOB_FILE).read_text().strip()
    cancel(cancelled)

    assert experiment.main([str(collect), *ARGS]) == 0  # resubmits the cancelled run, waits for all
    resubmitted = (slurm_work / "runs" / "mlmha-m-00" / "seed1" / JOB_FILE).read_text().strip()
    assert resubmitted != cancelled

    local = tmp_path / "local.toml"
    local.write_text(GRID.format(work=local_work, corpus=corpus, launcher=""))
    assert experiment.main([str(local), *ARGS, "--jobs", "2", "--threads", "1"]) == 0
    assert results_rows(slurm_work) == results_rows(local_work)




def test_a_run_over_two_slurm_tasks_resumes_and_equals_torchrun_over_two_ranks(tmp_path, corpus):
    """tasks_per_run = 2: one run trained data-parallel by the two srun tasks of its job (gloo on
    the CPUs), its job cancelled and resubmitted; the model equals two ranks that torchrun starts
    on the same command."""
    work = tmp_path / "work"
    grid = GRID.replace('"transformer", "MLMHA M-00"', '"transformer"')
    launcher = '[launcher]\ncpus_per_run = 1\ntasks_per_run = 2\ntime_min = 10\nwait = {wait}'
    submit_only, collect = tmp_path / "submit.toml", tmp_path / "collect.toml"
    submit_only.write_text(grid.format(work=work, corpus=corpus, launcher=launcher.format(wait="false")))
    collect.write_text(grid.format(work=work, corpus=corpus, launcher=launcher.format(wait="true")))
    run = work / "runs" / "transformer--fairseq" / "seed1"

    assert experiment.main([str(submit_only), *ARGS]) == 0
    cancelled = (run / JOB_FILE).read_text().strip()
    cancel(cancelled)
    assert experiment.main([str(collect), *ARGS]) == 0
    assert (run / JOB_FILE).read_text().strip() != cancelled  # resubmitted
    assert (run / "scores.json").is_file()
    assert "distributed init (rank 1)" in (run / "logs" / "train.rank1.log").read_text()
    assert json.loads((run / "run.json").read_text())["data-parallel ranks"] == 2

    command = json.loads((run / "training.json").read_text())["training"]["command"]
    assert command[1:3] == ["-m", "mlmha_fairseq.cli.train"]
    save_dir = command.index("--save-dir") + 1
    command[save_dir] = str(tmp_path / "torchrun")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             *command[1:]], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    slurm, torchrun = (torch.load(folder / "checkpoint_last.pt", map_location="cpu", weights_only=False)
                       for folder in (run / "checkpoints", tmp_path / "torchrun"))
    assert slurm["optimizer_history"][-1]["num_updates"] == torchrun["optimizer_history"][-1]["num_updates"] == 3
    assert slurm["model"].keys() == torchrun["model"].keys()
    for name, value in slurm["model"].items():
        torch.testing.assert_close(value, torchrun["model"][name], atol=1e-6, rtol=0, msg=name)
