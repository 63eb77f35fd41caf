"""A grid's runs as Slurm jobs, through submitit (the library behind hydra's Slurm launcher).

Each unfinished run becomes one job that trains, decodes and scores it in its run folder (the
same :func:`~mlmha_fairseq.experiments.grid.execute` as a local run, so the same results).
The job id is kept in the run folder (``slurm_job``): a runner started again collects finished
runs, leaves queued and running jobs alone, and resubmits a run whose job is gone without
finishing it (cancelled, failed, timed out), which resumes from its ``checkpoint_last.pt``. A
job that Slurm preempts or requeues (``scontrol requeue``) starts again and resumes the same
way; one that reaches its time limit is requeued by submitit (:meth:`RunJob.checkpoint`).

With ``tasks_per_run`` > 1 a run trains data-parallel: its job has that many Slurm tasks
(spread over ``nodes_per_run`` nodes), submitit starts the run's callable in each through
``srun``, and each task's fairseq-train is one rank (fairseq's Slurm initialisation, NCCL, on
GPUs; gloo on CPUs). The first task holds the run folder, trains, decodes and scores; the
others train with it (:func:`~mlmha_fairseq.experiments.grid.follow_training`).
"""
import dataclasses
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments.grid import (Grid, Run, Settings, attempt_progress, execute, follow_training,
                                            publish_training, published_training, slug)
from mlmha_fairseq.output_files import exclusive_folder

logger = logging.getLogger("mlmha_fairseq.experiment")
JOB_FILE = "slurm_job"
POLL_SECONDS = 10


@dataclass(frozen=True)
class SlurmLauncher:
    """The ``[launcher]`` table: what each run's job asks Slurm for."""

    partition: str = ""
    cpus_per_run: int = 1  # per task
    gpus_per_run: int = 0
    tasks_per_run: int = 1  # data-parallel ranks (one Slurm task each)
    nodes_per_run: int = 1
    time_min: int = 60
    mem_gb: int = 0  # 0: the partition's default
    sbatch: Dict[str, str] = field(default_factory=dict)  # further sbatch options, e.g. {"qos": "high"}
    wait: bool = True  # False: submit and exit; start the runner again to collect

    def check(self, where: str) -> None:
        """One line for a request no job can satisfy as the runner uses it."""
        if self.tasks_per_run % self.nodes_per_run:
            raise UsageError(f"{where}: tasks_per_run ({self.tasks_per_run}) must be a multiple of nodes_per_run "
                             f"({self.nodes_per_run}): each node runs the same number of ranks")
        if self.tasks_per_run > 1 and self.gpus_per_run not in (0, self.tasks_per_run):
            raise UsageError(f"{where}: with tasks_per_run = {self.tasks_per_run}, gpus_per_run must be 0 (CPUs) or "
                             f"{self.tasks_per_run} (one GPU per rank), got {self.gpus_per_run}")

    def executor(self, folder: str):
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        parameters = dict(timeout_min=self.time_min, cpus_per_task=self.cpus_per_run,
                          nodes=self.nodes_per_run, tasks_per_node=self.tasks_per_run // self.nodes_per_run,
                          slurm_additional_parameters=dict(self.sbatch))
        if self.partition:
            parameters["slurm_partition"] = self.partition
        if self.gpus_per_run:
            parameters["gpus_per_node"] = self.gpus_per_run // self.nodes_per_run
        if self.mem_gb:
            parameters["mem_gb"] = self.mem_gb
        executor.update_parameters(**parameters)
        return executor


class RunJob:
    """The callable a job runs: one run of the grid, holding its run folder.

    submitit's checkpointing protocol: when the job reaches its time limit or is preempted,
    submitit calls :meth:`checkpoint` and requeues what it returns, this same run, which
    resumes from the checkpoint fairseq-train saved last."""

    def __init__(self, run: Run, settings: Settings, references: List[str], work_dir: str):
        self.run, self.settings, self.references, self.work_dir = run, settings, references, work_dir

    def __call__(self) -> Optional[Dict]:
        settings = self.settings
        if settings.data_parallel:
            import submitit

            task = submitit.JobEnvironment()
            settings = dataclasses.replace(settings, data_parallel=dataclasses.replace(
                settings.data_parallel, port=rendezvous_port(task.job_id),
                attempt=f"{task.job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"))
            if task.global_rank > 0:
                return follow_training(self.run, settings, task.global_rank, self.work_dir)
        with exclusive_folder(self.run.directory, "run folder"):
            try:
                return execute(self.run, settings, self.references, self.work_dir)
            except BaseException:
                if settings.data_parallel and not published_training(self.run, settings)[0]:
                    publish_training(self.run, settings, None)  # the other ranks stop waiting
                raise

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def rendezvous_port(job_id: str) -> int:
    """The port where a job's ranks meet, the same for every task: from the job id, as fairseq
    picks one for a single-node Slurm job (``_infer_single_node_init``)."""
    return 10_000 + int("".join(c for c in job_id if c.isdigit()) or 0) % 50_000


def queued_or_running(job_id: str) -> bool:
    """Whether Slurm still has the job (pending, running, requeued, ...): squeue, which needs
    no accounting database, unlike sacct."""
    try:
        result = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                timeout=60)
    except FileNotFoundError:
        raise UsageError("[launcher] needs Slurm's squeue and sbatch on this machine's PATH") from None
    return result.returncode == 0 and bool(result.stdout.strip())


def recorded_job(run: Run) -> Optional[str]:
    try:
        with open(run.path(JOB_FILE), encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def submit(grid: Grid, references: List[str], launcher: SlurmLauncher) -> List[Tuple[Run, str]]:
    """Submit every unfinished run that has no live job; with ``launcher.wait``, wait for all
    and return the failures as (run, message); otherwise return at once."""
    executor = None
    waiting: Dict[str, Run] = {}
    # the job's node, not this one, has the GPUs; its threads are the CPUs it asked for
    threads = str(launcher.cpus_per_run)
    settings = dataclasses.replace(grid.settings, cpu=not launcher.gpus_per_run,
                                   env={**grid.settings.env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
    for number, run in enumerate(grid.runs, 1):
        if run.finished:
            logger.info("run %d of %d, %s: finished earlier, skipped", number, len(grid.runs), run.name)
            continue
        job_id = recorded_job(run)
        if job_id and queued_or_running(job_id):
            logger.info("run %d of %d, %s: Slurm job %s still queued or running", number, len(grid.runs), run.name,
                        job_id)
        else:
            if executor is None:
                executor = launcher.executor(os.path.join(grid.work_dir, "slurm"))
            executor.update_parameters(name=slug(f"{run.system.name} seed{run.seed}"))
            if job_id:
                logger.info("run %d of %d, %s: Slurm job %s ended without finishing it: resubmitted", number,
                            len(grid.runs), run.name, job_id)
            job_id = executor.submit(RunJob(run, settings, references, grid.work_dir)).job_id
            os.makedirs(run.directory, exist_ok=True)
            with open(run.path(JOB_FILE), "w", encoding="utf-8") as handle:
                handle.write(job_id + "\n")
            logger.info("run %d of %d, %s: submitted as Slurm job %s", number, len(grid.runs), run.name, job_id)
        waiting[job_id] = run
    if not launcher.wait:
        if waiting:
            logger.info("%d job(s) submitted or running; start the runner again to collect them", len(waiting))
        return []
    return wait_for(waiting, grid.settings.max_update)


def wait_for(waiting: Dict[str, Run], max_update: int) -> List[Tuple[Run, str]]:
    """Poll until no job of ``waiting`` is left in the queue; a run whose job left without
    finishing it is a failure, with the tail of its job's log."""
    failures = []
    while waiting:
        for job_id, run in list(waiting.items()):
            if queued_or_running(job_id):
                continue
            del waiting[job_id]
            if run.finished:
                logger.info("%s: Slurm job %s finished", run.name, job_id)
            else:
                message = f"Slurm job {job_id} ended without finishing the run (see {run.directory}/logs and the " \
                          "runner's slurm/ folder); start the runner again to resubmit it"
                logger.error("%s FAILED: %s", run.name, message)
                failures.append((run, message))
        if waiting:
            logger.info("%d Slurm job(s) queued or running: %s", len(waiting), "; ".join(
                f"{job_id} {run.name} {attempt_progress(run.path('logs', 'train.log'))[1]}/{max_update} updates"
                for job_id, run in sorted(waiting.items())))
            time.sleep(POLL_SECONDS)
    return failures

