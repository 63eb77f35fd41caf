"""One grid of runs (systems x training seeds): each run trained with ``fairseq-train``,
decoded with ``fairseq-generate``, detokenized and scored, in its own folder.

Resumable: a run whose scores are written is skipped; a run that was stopped resumes from
its ``checkpoint_last.pt`` (fairseq-train's own restore); a run that fails is reported and the
others go on. Every command is printed with its log file and appended to
``<work_dir>/commands.log``.
"""
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from mlmha_fairseq.child_processes import end_with_parent
from mlmha_fairseq.experiments.systems import SIZES, System
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.output_files import exclusive_folder
from mlmha_fairseq.evaluation.scoring import TextOptions, corpus_score, load_hypotheses, resolve_protocol
from mlmha_fairseq.evaluation.text_io import read_lines, write_text

logger = logging.getLogger("mlmha_fairseq.experiment")
# fairseq-train's --user-dir: the package folder, this file's grandparent (found from the path,
# so that the runner's modules do not depend on the plugin's for it)
USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_SECONDS = 20
STOP_CHECK_SECONDS = 1  # how often a run's ``stop_when`` is asked (it reads the run's log)

MODEL = SIZES["demo"].options()  # the demo's model: d=128, 3+3 layers


class Batching(NamedTuple):
    option: str  # the fairseq-train option that bounds a batch
    size: int
    unit: str


TOKEN_BATCHES = Batching("--max-tokens", 4096, "tokens")


class RunFailed(RuntimeError):
    """A command of one run exited with an error; the message names its log."""


def fairseq(tool: str, *args) -> List[str]:
    return [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]


def fairseq_train(settings: "Settings", *args) -> List[str]:
    """fairseq-train, or the package's :mod:`mlmha_fairseq.cli.train` (fairseq-train's own
    ``main``) for what fairseq's command line gets wrong: ``--bf16`` among the train options
    (fairseq turns it into ``--tpu``, which fails without torch_xla) and a data-parallel run's
    ranks on CPUs."""
    if "--bf16" not in settings.train_args and not settings.data_parallel:
        return fairseq("train", *args)
    return [sys.executable, "-m", "mlmha_fairseq.cli.train", *map(str, args)]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


CHAINED = "During handling of the above exception, another exception occurred:"


def failure_line(log_text: str) -> str:
    """The last line of a failed command's log (e.g. fairseq's one-line error), and, when that
    error was raised while handling another, the first error too: fairseq-train answers a
    ``FloatingPointError`` ("Minimum loss scale reached") by rerunning the step under its
    ``NanDetector``, whose backward hooks raise ``StopIteration`` on modules that return
    dictionaries (fairseq's own encoder included), which would hide the cause."""
    last = (log_text.strip().splitlines() or ["(empty log)"])[-1]
    if CHAINED not in log_text:
        return last
    first_error = (log_text.split(CHAINED)[0].strip().splitlines() or [""])[-1]
    return f"{last} (while handling {first_error})"


def run_command(command: List[str], log_path: str, work_dir: str,
                on_poll: Optional[Callable[[], None]] = None, env: Optional[Dict[str, str]] = None,
                stop_when: Optional[Callable[[], bool]] = None) -> None:
    """Run ``command`` (``env``: added to its environment) with its output into ``log_path``,
    print and record it in ``<work_dir>/commands.log``; ``on_poll`` is called every
    POLL_SECONDS while it runs. Once ``stop_when()`` is true (asked every STOP_CHECK_SECONDS)
    the command is stopped (SIGTERM) and counts as done.
    Raises :class:`RunFailed` when it fails: the first line says which tool failed and the
    last line of its log (e.g. fairseq's one-line error), then the command and the log's tail."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    line = " ".join(f"{name}={value}" for name, value in sorted((env or {}).items()))
    line = f"{line} {' '.join(command)}".strip()
    logger.info("$ %s\n  (log: %s)", line, log_path)
    with open(os.path.join(work_dir, "commands.log"), "a", encoding="utf-8") as record:
        record.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line} > {log_path}\n")
    start = time.time()
    with open(log_path, "a") as log:  # a resumed run adds to its log
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=end_with_parent,
                                   env={**os.environ, **env} if env else None)
        polled = time.time()
        while True:
            try:
                returncode = process.wait(timeout=STOP_CHECK_SECONDS if stop_when else POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if stop_when and stop_when():
                    process.terminate()
                    process.wait()
                    returncode = 0
                    break
                if on_poll and time.time() - polled >= POLL_SECONDS:
                    on_poll()
                    polled = time.time()
    if returncode != 0:
        with open(log_path, errors="replace") as log:
            text = log.read()
        tool = command[2] if command[1:2] == ["-m"] else command[0]
        raise RunFailed(f"{tool} failed ({returncode}): {failure_line(text)}\n$ {line}\n{text[-2000:]}\n"
                        f"(full log: {log_path})")
    logger.info("  done in %.0f s", time.time() - start)


# what a run converges on: fairseq's --best-checkpoint-metric, and which of a curve's values is best
METRICS = {"bleu": max, "loss": min}
METRIC_NAMES = {"bleu": "BLEU", "loss": "loss"}


class Convergence(NamedTuple):
    """Train until the validation ``metric`` has not improved for ``patience`` evaluations, one
    every ``validate_every`` updates (fairseq's ``--patience``), or until ``max_update``; the
    decoded checkpoint_best.pt is the one of the best value. ``bleu`` (the default) stops on
    the score that is reported; ``loss`` (label-smoothed cross-entropy) is smoother, so that one
    noisy BLEU peak early in training does not spend the patience of a run that still learns.
    ``patience`` 0 never stops a run early: a fixed budget of ``max_update`` with its curve, so
    that the curve, not a stopping rule, says whether a system catches up."""

    validate_every: int
    patience: int
    metric: str = "bleu"

    @property
    def stops_early(self) -> bool:
        return self.patience > 0

    @property
    def metric_name(self) -> str:
        return METRIC_NAMES[self.metric]


EPOCHS_NEVER = 1_000_000  # an epoch interval no run reaches


@dataclass(frozen=True)
class DataParallel:
    """One run trained by ``ranks`` processes, one per Slurm task of its job (see
    :mod:`mlmha_fairseq.experiments.slurm`). The job's tasks fill in the rest: they meet on its
    first node at ``port``; ``attempt`` names this start of the job (its id and requeue count),
    so that a rank never follows an earlier attempt's command."""

    ranks: int
    port: int = 0
    attempt: str = ""


@dataclass
class Settings:
    """What every run of a grid shares."""

    data_bin: str
    target: str
    max_update: int
    beam: int = 4
    batching: Batching = TOKEN_BATCHES
    model_args: List[str] = field(default_factory=lambda: list(MODEL))
    train_args: List[str] = field(default_factory=list)
    generate_args: List[str] = field(default_factory=list)
    average_last: int = 0
    save_interval_updates: int = 0  # 0: max_update / 4
    lr: float = 2e-3
    warmup_updates: int = 0  # 0: max_update / 5
    convergence: Optional[Convergence] = None
    cpu: bool = True  # fairseq's --cpu; False on a machine with GPUs
    corpus_args: List[str] = field(default_factory=list)  # the corpus's --source-lang/--target-lang
    postprocess: List[str] = field(default_factory=lambda: ["--remove-bpe"])  # subwords -> words
    detokenize: bool = True  # Moses-detokenize hypotheses (the target language's)
    env: Dict[str, str] = field(default_factory=dict)  # added to the environment of the run's commands
    data_parallel: Optional[DataParallel] = None  # None: one process per run

    @property
    def device_args(self) -> List[str]:
        return ["--cpu"] if self.cpu else []

    @property
    def data_parallel_args(self) -> List:
        """fairseq-train's options for this run's ranks: fairseq's Slurm initialisation (or, on
        CPUs, :mod:`mlmha_fairseq.cli.train`'s) reads each rank from its task's ``SLURM_*``."""
        if not self.data_parallel:
            return []
        # on CPUs: gloo, and fairseq's own DDP (its torch DDP wrapper passes a device id, which
        # torch refuses for a CPU module); the train options may still choose otherwise
        return ["--distributed-world-size", self.data_parallel.ranks, "--distributed-port", self.data_parallel.port,
                *(["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"] if self.cpu else [])]

    @property
    def stops_early(self) -> bool:
        """Whether runs may stop before ``max_update`` (a convergence with patience)."""
        return bool(self.convergence and self.convergence.stops_early)

    @property
    def budget(self) -> str:
        budget = f"{self.max_update} updates of {self.batching.size:,} {self.batching.unit} each"
        if self.convergence and not self.stops_early:
            budget = f"{budget}, validated every {self.convergence.validate_every} updates"
        elif self.stops_early:
            budget = (f"up to {budget}, stopped when validation {self.convergence.metric_name} has not improved for "
                      f"{self.convergence.patience} evaluations (one every {self.convergence.validate_every} updates)")
        return budget

    def convergence_options(self) -> List:
        """fairseq-train's own options for validation BLEU and loss every K updates,
        checkpoint_best.pt chosen by the metric, and the stop after P evaluations without a gain
        in it (``--patience``); epoch ends neither validate nor save, so that every point of a
        curve is K updates apart. BLEU is validated with either metric: it is the curve."""
        if not self.convergence:
            return []
        every, metric = self.convergence.validate_every, self.convergence.metric
        generation = {"beam": self.beam, "max_len_a": 1.2, "max_len_b": 10}
        return [
            "--eval-bleu", "--eval-bleu-args", json.dumps(generation), "--eval-bleu-remove-bpe",
            "--eval-bleu-detok", "moses", "--eval-bleu-detok-args", json.dumps({"target_lang": self.target}),
            "--best-checkpoint-metric", metric, *(["--maximize-best-checkpoint-metric"] if METRICS[metric] is max else []),
            *(["--patience", self.convergence.patience] if self.convergence.stops_early else []),
            "--validate-interval-updates", every,
            "--validate-interval", EPOCHS_NEVER, "--save-interval", EPOCHS_NEVER, "--log-format", "json",
        ]


@dataclass
class Run:
    """One system trained with one seed, in ``directory``."""

    system: System
    seed: int
    directory: str

    @property
    def name(self) -> str:
        return f"{self.system.name} (seed {self.seed})"

    def path(self, *parts) -> str:
        return os.path.join(self.directory, *parts)

    @property
    def checkpoints(self) -> str:
        return self.path("checkpoints")

    @property
    def finished(self) -> bool:
        return os.path.isfile(self.path("scores.json")) and os.path.isfile(self.path("hypotheses.txt"))

    def hypotheses(self) -> List[str]:
        return read_lines(self.path("hypotheses.txt"))

    def scores(self) -> Dict:
        with open(self.path("scores.json")) as handle:
            return json.load(handle)


def log_text(log_path: str) -> str:
    """A run's log as text, "" while it does not exist (or cannot be read)."""
    try:
        with open(log_path, errors="replace") as log:
            return log.read()
    except OSError:
        return ""


def _last_logged_update(text: str) -> int:
    found = re.findall(r"num_updates\"?[=\s|:\"]+(\d+)", text)  # simple and json log formats
    return int(found[-1]) if found else 0


def last_update(log_path: str) -> int:
    """The last ``num_updates`` fairseq-train logged in the whole log, 0 if none yet."""
    return _last_logged_update(log_text(log_path))


ATTEMPT = "[experiment] training from update "


def mark_attempt(log_path: str, update: int) -> None:
    """Start a training attempt in the run's log: the update of the checkpoint it resumes
    from (0: none), which :func:`attempt_progress` counts from."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"{ATTEMPT}{update}\n")


def attempt_progress(log_path: str) -> Tuple[int, int]:
    """(first, done): the update the run's latest training attempt started from and the last
    update it logged (``first`` until it logs one). Only that attempt counts: an earlier one
    may have logged updates past the checkpoint this one resumed from, so its count would step
    back. A log from before attempts were marked counts whole, from 0."""
    text = log_text(log_path)
    _, marked, attempt = text.rpartition(ATTEMPT)
    if not marked:
        return 0, _last_logged_update(text)
    first, _, logged = attempt.partition("\n")
    return int(first), max(int(first), _last_logged_update(logged))


PARAMS_LINE = re.compile(r"num\. shared model params: ([\d,]+)")  # fairseq_cli.train's count
DONE_LINE = re.compile(r"done training in ([\d.]+) seconds")
WALL = re.compile(r"(?<![\w])wall\"?[=:\s\"]+([\d.]+)")  # json ("wall": "18") and simple (wall=18) formats
INNER_WPS = re.compile(r"(?<![\w])wps\"?[=:\s\"]+([\d.]+)")  # per log interval, not the epoch's train_wps
EPOCH_WPS = re.compile(r"train_wps\"?[=:\s\"]+([\d.]+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \|", re.M)  # fairseq's logging format
# Where an attempt begins: the runner's mark, or fairseq-train's first line (its whole config),
# which also splits the logs written before attempts were marked.
ATTEMPT_START = re.compile(rf"{re.escape(ATTEMPT)}|^(?=[^\n]*\| fairseq_cli\.train \| \{{'_name')", re.M)


def _attempt_seconds(attempt: str) -> Optional[float]:
    """One attempt's training time: its ``done training in``; for one stopped before that line,
    its last ``wall``, or, where that is 0 (fairseq logs ``wall`` 0 after resuming from a
    checkpoint), the time between its first and last timestamped lines."""
    done = DONE_LINE.findall(attempt)
    if done:
        return float(done[-1])
    walls = [float(value) for value in WALL.findall(attempt)]
    if walls and walls[-1] > 0:
        return walls[-1]
    stamps = [datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S") for stamp in STAMP.findall(attempt)]
    if len(stamps) > 1:
        return (stamps[-1] - stamps[0]).total_seconds()
    return walls[-1] if walls else None


def training_costs(log_path: str) -> Dict[str, Optional[float]]:
    """What a run's training log says of its cost, the tables' columns (``COST_COLUMNS`` of
    :mod:`mlmha_fairseq.evaluation.replicates`): ``params``, the trained parameters fairseq-train
    counts (``num. shared model params``); ``train time (s)``, summed over the run's attempts
    (:func:`_attempt_seconds`: an attempt the runner stopped at convergence, or that was killed,
    counts up to its last logged line); ``tokens/s``, fairseq's ``wps`` (target tokens per
    second) averaged over the log intervals, or over the epochs when no interval was logged
    (a run shorter than ``--log-interval``). None for what the log does not hold."""
    text = log_text(log_path)
    params = PARAMS_LINE.findall(text)
    seconds = [value for value in map(_attempt_seconds, ATTEMPT_START.split(text)) if value is not None]
    speeds = [float(value) for value in INNER_WPS.findall(text)] or [float(v) for v in EPOCH_WPS.findall(text)]
    return {"params": float(params[-1].replace(",", "")) if params else None,
            "train time (s)": sum(seconds) if seconds else None,
            "tokens/s": sum(speeds) / len(speeds) if speeds else None}


def usable_last_checkpoint(run: Run) -> int:
    """Before a resume: the number of updates ``checkpoint_last.pt`` holds (0: none).

    fairseq writes a checkpoint through a temporary file, but copies it to the other names
    (``checkpoint_best.pt``, ``checkpoint_last.pt``) in place, so a run stopped during a copy
    leaves a truncated file; a checkpoint that safe loading refuses (:mod:`mlmha_fairseq.compat`)
    must not be trained from either. Such a file is moved aside (``.unsafe`` or ``.unreadable``,
    kept as evidence) and replaced by the newest checkpoint that loads, if any: the newest update
    checkpoint (always written whole) or ``checkpoint_best.pt``. The best one matters where every
    update ends an epoch: fairseq then writes no update checkpoint, and ``checkpoint_best.pt``
    is the file the truncated copy was being made from."""
    from fairseq.checkpoint_utils import checkpoint_paths, load_checkpoint_to_cpu

    from mlmha_fairseq.compat import UnsafeCheckpointError, check_stored_options
    from mlmha_fairseq.evaluation.checkpoint_averaging import CHECKPOINT_PATTERNS
    from mlmha_fairseq.evaluation.model_loading import trained_updates

    last = os.path.join(run.checkpoints, "checkpoint_last.pt")
    if not os.path.isfile(last):
        return 0
    try:
        state = load_checkpoint_to_cpu(last)
        check_stored_options(state)  # options stored as dicts, which unpickling does not check
        return trained_updates(state)
    except Exception as error:  # any unreadable file: torch raises several kinds
        kind = "unsafe" if isinstance(error, UnsafeCheckpointError) else "unreadable"
        os.replace(last, f"{last}.{kind}")
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        logger.warning("  %s is %s (%s): moved to %s.%s", last, kind, reason, last, kind)
    candidates = [(int(updates), path) for path, updates in
                  checkpoint_paths(run.checkpoints, CHECKPOINT_PATTERNS["update"], keep_match=True)[:1]]
    best = os.path.join(run.checkpoints, "checkpoint_best.pt")
    if os.path.isfile(best):
        try:
            candidates.append((trained_updates(load_checkpoint_to_cpu(best)), best))
        except Exception as error:  # truncated or unsafe like the last one: not a candidate
            logger.warning("  %s cannot be resumed from either (%s)", best, type(error).__name__)
    if not candidates:
        logger.warning("  no update checkpoint or checkpoint_best.pt to resume from: training from scratch")
        return 0
    updates, newest = max(candidates)
    shutil.copyfile(newest, last + ".tmp")
    os.replace(last + ".tmp", last)
    logger.warning("  resuming from %s (update %d)", newest, updates)
    return updates


# the runner's own stop, in a run's log, followed by the metric: "... validation BLEU in its last 5
# validations" (the logs of earlier versions, BLEU only, hold the same words)
CONVERGED = "converged: no gain in validation"


def best_point(points: Sequence[Tuple[float, float]], metric: str) -> Tuple[float, float]:
    """The best of a curve's ``(update, value)`` points (in update order) in ``metric``: the
    first of equal bests, as fairseq's ``--patience`` counts an equal value as no improvement."""
    best = METRICS[metric](value for _, value in points)
    return next(point for point in points if point[1] == best)


def _validations_since_best(lines: Sequence[str], until: float = float("inf"), metric: str = "bleu") -> int:
    from mlmha_fairseq.evaluation.text_io import InputError
    from mlmha_fairseq.evaluation.training_curves import log_curves

    try:
        points = [point for point in log_curves(lines, metric)["valid"] if point[0] <= until]
    except InputError:  # no validation logged yet
        return 0
    return len(points) - 1 - points.index(best_point(points, metric)) if points else 0


def validations_since_best(log_path: str, until: float = float("inf"), metric: str = "bleu") -> int:
    """The validations a run's log records (up to update ``until``) after its best validation
    ``metric`` (the first of equal bests: fairseq's ``--patience`` counts an equal value as no
    improvement); 0 without any. fairseq logs the loss to 3 decimals, so a gain under 0.0005,
    which its own count sees, reads here as a tie."""
    return _validations_since_best(log_text(log_path).splitlines(), until, metric)


def converged_over_attempts(log_path: str, convergence: Convergence) -> bool:
    """Whether a run's log (all its attempts) shows ``patience`` validations without a gain in
    the metric, the last one's checkpoint saved (fairseq logs "Saved checkpoint" once every
    copy is written), so that stopping the run there loses nothing. Asked every
    STOP_CHECK_SECONDS: the log is read once."""
    text = log_text(log_path)
    return (_validations_since_best(text.splitlines(), metric=convergence.metric) >= convergence.patience
            and text.rfind("Saved checkpoint") > text.rfind('"valid_bleu"'))


def train(run: Run, settings: Settings, work_dir: str, on_poll=None) -> None:
    """fairseq-train into ``run.checkpoints``; fairseq restores ``checkpoint_last.pt`` there
    when a previous attempt was stopped. Keeps the last update checkpoints for averaging.

    With ``[convergence]``, a resumed fairseq-train would count ``--patience`` afresh from its
    own first validation (fairseq keeps no count in checkpoints) and stop later than an
    uninterrupted run whose best came before the interruption. So the runner counts over the
    whole log: a resumed run is stopped (its stop recorded in the log as CONVERGED) once the
    log shows ``patience`` validations without a gain and the last one's checkpoint saved, within
    STOP_CHECK_SECONDS, long before its next validation; it is not started at all when the
    log already shows them. (Bounding the attempt with ``--max-update`` instead would change
    the schedules that fairseq derives from it: cosine, tri-stage, polynomial decay.) A run
    trained from its start is stopped by fairseq's own count, which is then the same."""
    interval = (settings.convergence.validate_every if settings.convergence
                else settings.save_interval_updates or max(1, settings.max_update // 4))
    done = usable_last_checkpoint(run)
    if done >= settings.max_update:
        publish_training(run, settings, None)
        # fairseq-train steps before it checks --max-update, so restarting it here would train
        # one update past the budget (a runner stopped after training, before train.done)
        logger.info("  %s holds %d updates, the budget: not trained again", run.checkpoints, done)
        write_text(run.path("train.done"), "")
        return
    log_path = run.path("logs", "train.log")
    resumed_to_converge = bool(settings.stops_early and done)
    # up to the checkpoint it resumes from: later validations (a run stopped before their
    # save) are done again
    convergence = settings.convergence
    if resumed_to_converge and validations_since_best(log_path, done, convergence.metric) >= convergence.patience:
        publish_training(run, settings, None)
        record_convergence(run, convergence, "not trained again")
        return
    system = run.system
    command = fairseq_train(
        settings, settings.data_bin, "--user-dir", USER_DIR, *settings.corpus_args, *system.task_options,
        "--arch", system.arch,
        *settings.model_args,
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", f"{settings.lr:g}",
        "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", settings.warmup_updates or max(1, settings.max_update // 5),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        settings.batching.option, settings.batching.size, "--max-update", settings.max_update,
        "--save-dir", run.checkpoints, "--no-epoch-checkpoints",
        "--save-interval-updates", interval, "--keep-interval-updates", max(1, settings.average_last),
        "--seed", run.seed, *settings.device_args, *settings.data_parallel_args,
        "--num-workers", "0", "--log-interval", "25", "--no-progress-bar",
        *settings.convergence_options(),
        *settings.train_args,
        *system.options,  # last: a system may replace the criterion
    )
    stop_when = training_stop(run, settings, resumed_to_converge)
    publish_training(run, settings, {"command": command, "resumed_to_converge": resumed_to_converge})
    mark_attempt(log_path, done)
    run_command(command, log_path, work_dir, on_poll, settings.env, stop_when)
    if stop_when and stop_when():
        record_convergence(run, convergence, "stopped")
    else:
        write_text(run.path("train.done"), "")


def training_stop(run: Run, settings: Settings, resumed_to_converge: bool) -> Optional[Callable[[], bool]]:
    """When the runner stops a resumed fairseq-train (see :func:`train`): every rank of a
    data-parallel run asks the same question of the same log, so that all stop together."""
    if not resumed_to_converge:
        return None
    return lambda: converged_over_attempts(run.path("logs", "train.log"), settings.convergence)


TRAINING_FILE = "training.json"  # the first rank's fairseq-train command, for the other ranks


def publish_training(run: Run, settings: Settings, training: Optional[Dict]) -> None:
    """For a data-parallel run, tell the other ranks what this attempt trains: ``training``
    (the command), or None when the first rank trains nothing. Only the first rank reads and
    repairs the run folder (:func:`usable_last_checkpoint`), so the others wait for this."""
    if settings.data_parallel:
        write_text(run.path(TRAINING_FILE), json.dumps({"attempt": settings.data_parallel.attempt,
                                                        "training": training}) + "\n")


def published_training(run: Run, settings: Settings) -> Tuple[bool, Optional[Dict]]:
    """Whether the first rank published this attempt's training yet, and what it published."""
    try:
        with open(run.path(TRAINING_FILE), encoding="utf-8") as handle:
            published = json.load(handle)
    except (OSError, ValueError):  # not yet written, or an earlier attempt's being replaced
        return False, None
    if published.get("attempt") != settings.data_parallel.attempt:
        return False, None
    return True, published["training"]


def follow_training(run: Run, settings: Settings, rank: int, work_dir: str, wait_seconds: float = 1.0) -> None:
    """A data-parallel run's rank > 0: wait for the first rank's command of this attempt
    (:func:`publish_training`) and run it with its own log, ``logs/train.rank<r>.log``."""
    published, training = published_training(run, settings)
    while not published:
        time.sleep(wait_seconds)
        published, training = published_training(run, settings)
    if training is None:
        logger.info("  %s: rank %d: the first rank trains nothing in this attempt", run.name, rank)
        return
    run_command(training["command"], run.path("logs", f"train.rank{rank}.log"), work_dir, env=settings.env,
                stop_when=training_stop(run, settings, training["resumed_to_converge"]))


def record_convergence(run: Run, convergence: Convergence, action: str) -> None:
    """Mark a run converged by the runner's count: in its log, where the curve report reads
    the stop, and by ``train.done``."""
    log_path = run.path("logs", "train.log")
    spent = validations_since_best(log_path, metric=convergence.metric)
    stop = f"{CONVERGED} {convergence.metric_name} in its last {spent} validations"
    logger.info("  %s: %s: %s", run.name, stop, action)
    with open(log_path, "a") as log:
        log.write(f"[experiment] {stop}\n")
    write_text(run.path("train.done"), "")


def checkpoint_to_decode(run: Run, settings: Settings) -> str:
    """checkpoint_best.pt, or the average of the last ``average_last`` update checkpoints
    (as the papers average their last checkpoints), made once."""
    if settings.average_last <= 0:
        return os.path.join(run.checkpoints, "checkpoint_best.pt")
    from mlmha_fairseq.evaluation.checkpoint_averaging import average_checkpoints, last_checkpoints, save_checkpoint

    averaged = os.path.join(run.checkpoints, f"checkpoint_average_last{settings.average_last}.pt")
    if not os.path.isfile(averaged):
        paths = last_checkpoints(run.checkpoints, settings.average_last, kind="update")
        logger.info("  averaging %s", ", ".join(os.path.basename(p) for p in paths))
        save_checkpoint(average_checkpoints(paths), averaged + ".tmp")
        os.replace(averaged + ".tmp", averaged)
    return averaged


def decode(run: Run, settings: Settings, checkpoint: str, output: str, work_dir: str, *extra) -> str:
    """fairseq-generate of the test set into ``output``; returns its generate-test.txt."""
    # --required-batch-size-multiple 1: fairseq's default of 8 drops the last test sentences
    run_command(fairseq(
        "generate", settings.data_bin, "--user-dir", USER_DIR, *settings.corpus_args, *run.system.task_options,
        *extra, "--path", checkpoint, "--beam", settings.beam,
        *settings.postprocess, "--batch-size", "64", "--required-batch-size-multiple", "1",
        "--max-len-a", "1.2", "--max-len-b", "10", *settings.device_args, "--results-path", output,
        *settings.generate_args,
    ), run.path("logs", f"{os.path.basename(output)}.log"), work_dir, env=settings.env)
    return os.path.join(output, "generate-test.txt")


def detokenized(generate_output: str, target: Optional[str]) -> List[str]:
    """The hypotheses of a fairseq-generate output, in input order, Moses-detokenized for the
    language ``target`` (None: as fairseq-generate wrote them)."""
    return load_hypotheses(generate_output, resolve_protocol("sacrebleu"),
                           TextOptions(input_format="generate", detokenize_lang=target))


RUN_SETTINGS = "run.json"


def run_settings(run: Run, settings: Settings, references: Sequence[str]) -> Dict:
    """What a run's results depend on, as its folder records it (:data:`RUN_SETTINGS`): the
    system, the seed, the data, the budget and schedule, decoding, and the test references it
    is scored against (their SHA-256). Not the device or the environment, which a resumed run
    may change."""
    import hashlib

    return {
        "arch": run.system.arch, "system options": [str(a) for a in run.system.options],
        "task options": [str(a) for a in run.system.task_options], "seed": run.seed,
        "data_bin": os.path.abspath(settings.data_bin), "corpus options": [str(a) for a in settings.corpus_args],
        "max_update": settings.max_update, "lr": settings.lr, "warmup_updates": settings.warmup_updates,
        "batching": [settings.batching.option, settings.batching.size],
        "model_args": list(settings.model_args), "train_args": list(settings.train_args),
        "save_interval_updates": settings.save_interval_updates, "average_last": settings.average_last,
        "convergence": list(settings.convergence) if settings.convergence else None,
        "beam": settings.beam, "generate_args": list(settings.generate_args),
        "postprocess": list(settings.postprocess), "detokenize": settings.detokenize,
        "test references sha256": hashlib.sha256("\n".join(references).encode("utf-8")).hexdigest(),
        # each rank trains on its own batches: the batch of an update grows with the ranks
        "data-parallel ranks": settings.data_parallel.ranks if settings.data_parallel else 1,
    }


# settings added to run.json after its first version, with the value older folders were trained with
LATER_RUN_SETTINGS = {"data-parallel ranks": 1}


def check_run_settings(runs: Sequence[Run], settings: Settings, references: Sequence[str]) -> None:
    """Refuse a run folder trained (or being trained) with other settings than this grid's,
    naming the first setting that differs: it would be skipped (finished) or resumed (not)
    and reported under this grid's settings. An unfinished run may resume to another
    ``max_update`` (a stopped attempt continues to the new cap; its record is updated when it
    resumes). Folders of earlier versions, and runs restored from records, hold no settings and
    are taken as they are."""
    for run in runs:
        try:
            with open(run.path(RUN_SETTINGS), encoding="utf-8") as handle:
                stored = json.load(handle)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as error:
            raise UsageError(f"run folder {run.directory}: {RUN_SETTINGS} cannot be read ({error}): move the run "
                             "folder away") from None
        current = run_settings(run, settings, references)
        differing = [key for key in current if stored.get(key, LATER_RUN_SETTINGS.get(key)) != current[key]
                     and (run.finished or key != "max_update")]
        if differing:
            key = differing[0]
            state = "trained" if run.finished else "partly trained"
            raise UsageError(
                f"run folder {run.directory} was {state} with {key} = {stored.get(key, LATER_RUN_SETTINGS.get(key))!r}, "
                f"this grid has "
                f"{current[key]!r}" + (f" (and {len(differing) - 1} more setting(s) differ)" if len(differing) > 1 else "")
                + ": its results would be reported under this grid's settings; use another work_dir, or move the "
                  "run folder away to train it again")


def execute(run: Run, settings: Settings, references: List[str], work_dir: str, on_poll=None) -> Dict:
    """Train (unless done), decode, detokenize and score one run; write hypotheses.txt and
    scores.json (last, so that a run is finished only once both are there)."""
    from mlmha_fairseq.evaluation.meteor import UNAVAILABLE, corpus_meteor, load_wordnet

    start = time.time()
    if not os.path.isfile(run.path("train.done")):  # a new run, or one resumed to this grid's max_update
        write_text(run.path(RUN_SETTINGS), json.dumps(run_settings(run, settings, references), indent=2) + "\n")
    if not os.path.isfile(run.path("train.done")):
        train(run, settings, work_dir, on_poll)
    else:
        publish_training(run, settings, None)
    checkpoint = checkpoint_to_decode(run, settings)
    hypotheses = detokenized(decode(run, settings, checkpoint, run.path("generate"), work_dir),
                             settings.target if settings.detokenize else None)
    write_text(run.path("hypotheses.txt"), "\n".join(hypotheses) + "\n")
    bleu = corpus_score(hypotheses, [references], resolve_protocol("sacrebleu"))
    chrf = corpus_score(hypotheses, [references], resolve_protocol("chrf"))
    wordnet = load_wordnet()
    meteor = corpus_meteor(hypotheses, [references], wordnet)
    scores = {"system": run.system.name, "seed": run.seed, "bleu": bleu.score, "chrf": chrf.score,
              "meteor": meteor, "meteor_note": wordnet.reason, "bleu_signature": bleu.signature,
              "chrf_signature": chrf.signature, "checkpoint": checkpoint, "seconds": time.time() - start}
    write_text(run.path("scores.json"), json.dumps(scores, indent=2) + "\n")
    logger.info("  %s: BLEU %.2f, chrF %.2f, METEOR %s", run.name, bleu.score, chrf.score,
                UNAVAILABLE if meteor is None else f"{meteor:.2f}")
    return scores


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


class Grid:
    """Every run of ``systems`` x ``seeds`` under ``<work_dir>/runs``, each one skipped when
    finished; progress lines with elapsed and estimated remaining time."""

    def __init__(self, systems: Sequence[System], seeds: Sequence[int], settings: Settings, work_dir: str,
                 folder_prefix: str = ""):
        self.settings, self.work_dir = settings, work_dir
        # seed by seed, so that a grid stopped half-way has pairs of runs to compare
        self.runs = [Run(system, seed, os.path.join(work_dir, "runs", slug(f"{folder_prefix} {system.name}"),
                                                    f"seed{seed}"))
                     for seed in seeds for system in systems]
        self.start = time.time()
        self.jobs = 1  # runs at a time (execute's), for the time estimate

    def _progress(self, number: int, run: Run, run_start: float) -> None:
        """One line per running run: its updates in this attempt (:func:`attempt_progress`),
        and the grid's remaining training time at this run's speed with ``self.jobs`` runs at
        a time (an upper bound when runs may stop early at convergence)."""
        first_update, done = attempt_progress(run.path("logs", "train.log"))
        left = sum(self.settings.max_update - (
            done if other is run else attempt_progress(other.path("logs", "train.log"))[1])
            for other in self.runs if not other.finished)
        seconds = (time.time() - run_start) / max(1, done - first_update)
        bound = "at most " if self.settings.stops_early else ""
        remaining = f"{bound}~{minutes(left * seconds / self.jobs)}" if done > first_update else "unknown"
        logger.info("run %d of %d, %s: %d/%d updates; elapsed %s, remaining %s (training)", number,
                    len(self.runs), run.name, done, self.settings.max_update, minutes(time.time() - self.start),
                    remaining)

    def execute(self, references: List[str], after_run: Optional[Callable[[Run], None]] = None,
                jobs: int = 1, slot_env: Optional[Callable[[int], Dict[str, str]]] = None) -> List[Tuple[Run, str]]:
        """Run what is not finished, ``jobs`` runs at a time; return the failures as (run,
        message) in the grid's order. ``slot_env(k)`` is added to the environment of the
        commands of the runs in slot k (0 .. jobs-1: its threads, its GPU). ``after_run`` is
        called after each finished run (e.g. extra decodings)."""
        self.jobs = jobs
        slots: "queue.Queue[int]" = queue.Queue()
        for slot in range(jobs):
            slots.put(slot)

        def in_a_slot(number: int, run: Run) -> List[Tuple[Run, str]]:
            slot = slots.get()
            try:
                settings = self.settings
                if slot_env:
                    settings = dataclasses.replace(settings, env={**settings.env, **slot_env(slot)})
                return self._execute_one(number, run, references, after_run, settings)
            finally:
                slots.put(slot)

        # threads only wait for their fairseq commands: the runs themselves are processes
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            outcomes = list(pool.map(in_a_slot, range(1, len(self.runs) + 1), self.runs))
        return [failure for failures in outcomes for failure in failures]

    def _execute_one(self, number: int, run: Run, references: List[str], after_run, settings: Settings
                     ) -> List[Tuple[Run, str]]:
        if run.finished:
            logger.info("run %d of %d, %s: finished earlier, skipped", number, len(self.runs), run.name)
        else:
            verb = "resumes from its last checkpoint" if os.path.isfile(
                os.path.join(run.checkpoints, "checkpoint_last.pt")) else "starts"
            logger.info("run %d of %d, %s: %s (up to %d updates, %s)", number, len(self.runs), run.name, verb,
                        settings.max_update, run.directory)
            run_start = time.time()
            try:
                with exclusive_folder(run.directory, "run folder"):
                    execute(run, settings, references, self.work_dir,
                            lambda: self._progress(number, run, run_start))
            except (RunFailed, UsageError, ValueError) as failure:
                logger.error("run %d of %d, %s FAILED: %s", number, len(self.runs), run.name, failure)
                return [(run, str(failure).splitlines()[0])]
        if after_run:
            try:
                after_run(run)
            except (RunFailed, UsageError, ValueError) as failure:
                logger.error("%s: FAILED: %s", run.name, failure)
                return [(run, str(failure).splitlines()[0])]
        return []

    def costs(self) -> Dict[str, Dict[int, Dict[str, Optional[float]]]]:
        """{system: {seed: :func:`training_costs`}} of the finished runs."""
        costs: Dict[str, Dict[int, Dict[str, Optional[float]]]] = {}
        for run in self.runs:
            if run.finished:
                costs.setdefault(run.system.name, {})[run.seed] = training_costs(run.path("logs", "train.log"))
        return costs

    def hypotheses(self) -> List[Tuple[str, Dict[int, List[str]]]]:
        """[(system, {seed: hypotheses})] of the finished runs, in the grid's order."""
        systems: Dict[str, Dict[int, List[str]]] = {}
        for run in self.runs:
            if run.finished:
                systems.setdefault(run.system.name, {})[run.seed] = run.hypotheses()
        return list(systems.items())


def report_failures(failures: List[Tuple[Run, str]]) -> None:
    if failures:
        logger.error("%d run(s) failed (the others completed; rerun to retry them):", len(failures))
        for run, message in failures:
            logger.error("  %s: %s", run.name, message)


