"""Experiment runner: a grid of systems x training seeds from a TOML file, each run trained
with ``fairseq-train``, decoded with ``fairseq-generate``, detokenized and scored, then one
MultEval-style table (mean ± sd over seeds, s_sel, approximate randomization over the
replicates, sacreBLEU's paired bootstrap per seed) as Markdown, LaTeX, JSON and PNG.

Resumable: a run whose scores are written is skipped; a run that was stopped resumes from
its ``checkpoint_last.pt`` (fairseq-train's own restore); a run that fails is reported and the
others go on (exit status 1 at the end, as when no run of the baseline has finished and so no
table is written). Every command is printed with its log file and appended to
``<work_dir>/commands.log``.

Usage: ``python -m mlmha_fairseq.cli.experiment CONFIG [--seeds N] [--work-dir DIR]``;
``examples/experiment/demo.toml`` is the quick demo's grid with 3 seeds. Config keys::

    work_dir = "work-experiment"  # runs/, logs/, results.* (relative to the current folder)
    seeds = [1, 2, 3]  # or a count: 3 = seeds 1..3
    baseline = "transformer"  # default: the first system
    systems = ["transformer", "mlmha M-00",  # names of mlmha_fairseq.cli.systems
               { name = "M-00 no dropout", base = "mlmha M-00", args = ["--dropout", "0"] },
               { name = "my system", arch = "slot_transformer", args = ["--layer-aggregation", "s-agg"] }]
    max_update = 400
    beam = 4
    max_tokens = 4096  # or batch_size = 96 (sentences)
    average_last = 0  # k > 0: decode the average of the last k update checkpoints
    save_interval_updates = 100  # default: max_update / 4
    model_args = [...]  # default: the demo's model (d=128, 3+3 layers)
    train_args = []  # added to every fairseq-train command
    generate_args = []  # added to every fairseq-generate command

    [corpus]  # an existing mlmha_fairseq.cli.build_corpus output ...
    dir = "work-demo/corpus-fr"
    # ... or what to build (into work_dir/corpus-<sources> unless dir is given)
    sources = ["fr"]
    target = "en"
    train_verses = 10000
    bpe_merges = 4000
"""
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlmha_fairseq
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.cli.systems import System, lookup
from mlmha_fairseq.corpus.builder import MANIFEST
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.output_files import exclusive_folder
from mlmha_fairseq.evaluation.scoring import TextOptions, corpus_score, load_hypotheses, resolve_protocol
from mlmha_fairseq.evaluation.text_io import read_lines, write_text

logger = logging.getLogger("mlmha_fairseq.experiment")
USER_DIR = os.path.dirname(os.path.abspath(mlmha_fairseq.__file__))
POLL_SECONDS = 20
UPDATE_CHECKPOINT = r"checkpoint_\d+_(\d+)\.pt"  # fairseq's name of the checkpoint after update N

# the demo's model: d=128, 3+3 layers
MODEL = [
    "--encoder-layers", "3", "--decoder-layers", "3",
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings", "--dropout", "0.1",
]


class Batching(NamedTuple):
    option: str  # the fairseq-train option that bounds a batch
    size: int
    unit: str


TOKEN_BATCHES = Batching("--max-tokens", 4096, "tokens")


class RunFailed(RuntimeError):
    """A command of one run exited with an error; the message names its log."""


def fairseq(tool: str, *args) -> List[str]:
    return [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _end_with_parent() -> None:
    """In the child, before exec: ask Linux to send SIGTERM when the runner's thread that
    started it dies, even by SIGKILL, so that no fairseq-train outlives the runner and keeps
    writing into a run folder that a rerun trains again. Other systems have no such request;
    there a killed runner's children must be stopped by hand."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_command(command: List[str], log_path: str, work_dir: str,
                on_poll: Optional[Callable[[], None]] = None) -> None:
    """Run ``command`` with its output into ``log_path``, print and record it in
    ``<work_dir>/commands.log``; ``on_poll`` is called every POLL_SECONDS while it runs.
    Raises :class:`RunFailed` when it fails: the first line says which tool failed and the
    last line of its log (e.g. fairseq's one-line error), then the command and the log's tail."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    line = " ".join(command)
    logger.info("$ %s\n  (log: %s)", line, log_path)
    with open(os.path.join(work_dir, "commands.log"), "a", encoding="utf-8") as record:
        record.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line} > {log_path}\n")
    start = time.time()
    with open(log_path, "a") as log:  # a resumed run adds to its log
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_end_with_parent)
        while True:
            try:
                returncode = process.wait(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if on_poll:
                    on_poll()
    if returncode != 0:
        with open(log_path, errors="replace") as log:
            tail = log.read()[-2000:]
        last = (tail.strip().splitlines() or ["(empty log)"])[-1]
        tool = command[2] if command[1:2] == ["-m"] else command[0]
        raise RunFailed(f"{tool} failed ({returncode}): {last}\n$ {line}\n{tail}\n(full log: {log_path})")
    logger.info("  done in %.0f s", time.time() - start)


MAX_TOKENS_PER_VERSE = 50


def corpus_is_built(corpus_dir: str, sources: Sequence[str], target: str, train_verses: Optional[int],
                    bpe_merges: int) -> bool:
    """Whether ``corpus_dir`` holds a finished build with these settings: the builder writes
    its manifest last (atomically), so a manifest means every file is in place."""
    try:
        with open(os.path.join(corpus_dir, MANIFEST), encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, ValueError):
        return False
    return (manifest.get("sources") == list(sources) and manifest.get("target") == target
            and manifest.get("train_selection", {}).get("max_train_verses") == train_verses
            and manifest.get("train_selection", {}).get("max_tokens_per_verse") == MAX_TOKENS_PER_VERSE
            and manifest.get("bpe", {}).get("merges_requested") == bpe_merges)


def build_corpus(sources: Sequence[str], target: str, corpus_dir: str, train_verses: Optional[int],
                 bpe_merges: int, work_dir: str) -> None:
    """The verse-aligned Bible corpus with ``mlmha_fairseq.cli.build_corpus``, unless an
    earlier run already built it with the same settings (a rerun resumes the grid, it does
    not rebuild the data its finished runs were trained on)."""
    if corpus_is_built(corpus_dir, sources, target, train_verses, bpe_merges):
        logger.info("  corpus %s: built earlier with these settings, kept", corpus_dir)
        return
    options = ["--sources", *sources, "--target", target, "--out-dir", corpus_dir,
               "--max-tokens-per-verse", str(MAX_TOKENS_PER_VERSE), "--bpe-merges", str(bpe_merges)]
    if train_verses:
        options += ["--max-train-verses", str(train_verses)]
    try:
        run_command([sys.executable, "-m", "mlmha_fairseq.cli.build_corpus", *options],
                    os.path.join(work_dir, "logs", f"corpus-{'-'.join(sources)}.log"), work_dir)
    except RunFailed as failure:
        sys.exit(str(failure))


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

    @property
    def budget(self) -> str:
        return f"{self.max_update} updates of {self.batching.size:,} {self.batching.unit} each"


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


def last_update(log_path: str) -> int:
    """The last ``num_updates`` fairseq-train logged, 0 if none yet."""
    if not os.path.isfile(log_path):
        return 0
    with open(log_path, errors="replace") as log:
        found = re.findall(r"num_updates[=\s|]+(\d+)", log.read())
    return int(found[-1]) if found else 0


def usable_last_checkpoint(run: Run) -> int:
    """Before a resume: the number of updates ``checkpoint_last.pt`` holds (0: none).

    fairseq writes each update checkpoint through a temporary file, but copies it to
    ``checkpoint_last.pt`` in place, so a run stopped during that copy leaves a truncated file;
    a checkpoint that safe loading refuses (:mod:`mlmha_fairseq.compat`) must not be trained
    from either. Such a file is moved aside (``.unsafe`` or ``.unreadable``, kept as evidence)
    and replaced by the newest update checkpoint that loads, if any."""
    from fairseq.checkpoint_utils import checkpoint_paths, load_checkpoint_to_cpu

    from mlmha_fairseq.compat import UnsafeCheckpointError

    last = os.path.join(run.checkpoints, "checkpoint_last.pt")
    if not os.path.isfile(last):
        return 0
    try:
        state = load_checkpoint_to_cpu(last)
    except Exception as error:  # any unreadable file: torch raises several kinds
        kind = "unsafe" if isinstance(error, UnsafeCheckpointError) else "unreadable"
        os.replace(last, f"{last}.{kind}")
        reason = " ".join(str(error).split())[:300] or type(error).__name__
        logger.warning("  %s is %s (%s): moved to %s.%s", last, kind, reason, last, kind)
        newest = checkpoint_paths(run.checkpoints, UPDATE_CHECKPOINT)
        if not newest:
            logger.warning("  no update checkpoint to resume from: training from scratch")
            return 0
        shutil.copyfile(newest[0], last + ".tmp")
        os.replace(last + ".tmp", last)
        logger.warning("  resuming from %s", newest[0])
        return int(re.search(UPDATE_CHECKPOINT, os.path.basename(newest[0])).group(1))
    return int(state.get("optimizer_history", [{}])[-1].get("num_updates", 0))


def train(run: Run, settings: Settings, work_dir: str, on_poll=None) -> None:
    """fairseq-train into ``run.checkpoints``; fairseq restores ``checkpoint_last.pt`` there
    when a previous attempt was stopped. Keeps the last update checkpoints for averaging."""
    interval = settings.save_interval_updates or max(1, settings.max_update // 4)
    done = usable_last_checkpoint(run)
    if done >= settings.max_update:
        # fairseq-train steps before it checks --max-update, so restarting it here would train
        # one update past the budget (a runner stopped after training, before train.done)
        logger.info("  %s holds %d updates, the budget: not trained again", run.checkpoints, done)
        write_text(run.path("train.done"), "")
        return
    system = run.system
    run_command(fairseq(
        "train", settings.data_bin, "--user-dir", USER_DIR, *system.task_options, "--arch", system.arch,
        *settings.model_args,
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "2e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", max(1, settings.max_update // 5),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        settings.batching.option, settings.batching.size, "--max-update", settings.max_update,
        "--save-dir", run.checkpoints, "--no-epoch-checkpoints",
        "--save-interval-updates", interval, "--keep-interval-updates", max(1, settings.average_last),
        "--seed", run.seed, "--cpu", "--num-workers", "0", "--log-interval", "25", "--no-progress-bar",
        *settings.train_args,
        *system.options,  # last: a system may replace the criterion
    ), run.path("logs", "train.log"), work_dir, on_poll)
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
        "generate", settings.data_bin, "--user-dir", USER_DIR, *run.system.task_options, *extra,
        "--path", checkpoint, "--beam", settings.beam,
        "--remove-bpe", "--batch-size", "64", "--required-batch-size-multiple", "1",
        "--max-len-a", "1.2", "--max-len-b", "10", "--cpu", "--results-path", output,
        *settings.generate_args,
    ), run.path("logs", f"{os.path.basename(output)}.log"), work_dir)
    return os.path.join(output, "generate-test.txt")


def detokenized(generate_output: str, target: str) -> List[str]:
    """The hypotheses of a fairseq-generate output, in input order, Moses-detokenized."""
    return load_hypotheses(generate_output, resolve_protocol("sacrebleu"),
                           TextOptions(input_format="generate", detokenize_lang=target))


def execute(run: Run, settings: Settings, references: List[str], work_dir: str, on_poll=None) -> Dict:
    """Train (unless done), decode, detokenize and score one run; write hypotheses.txt and
    scores.json (last, so that a run is finished only once both are there)."""
    from mlmha_fairseq.evaluation.meteor import UNAVAILABLE, corpus_meteor, load_wordnet

    start = time.time()
    if not os.path.isfile(run.path("train.done")):
        train(run, settings, work_dir, on_poll)
    checkpoint = checkpoint_to_decode(run, settings)
    hypotheses = detokenized(decode(run, settings, checkpoint, run.path("generate"), work_dir), settings.target)
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
        self.trained_updates = 0  # in this session, for the time estimate
        self.training_seconds = 0.0

    def _progress(self, number: int, run: Run, run_start: float, first_update: int) -> None:
        done = last_update(run.path("logs", "train.log"))
        left = self.settings.max_update - done
        left += sum(self.settings.max_update for later in self.runs[number:] if not later.finished)
        updates = self.trained_updates + max(0, done - first_update)
        seconds = self.training_seconds + time.time() - run_start
        remaining = f"~{minutes(left * seconds / updates)}" if updates else "unknown"
        logger.info("run %d of %d, %s: %d/%d updates; elapsed %s, remaining %s (training)", number,
                    len(self.runs), run.name, done, self.settings.max_update, minutes(time.time() - self.start),
                    remaining)

    def execute(self, references: List[str],
                after_run: Optional[Callable[[Run], None]] = None) -> List[Tuple[Run, str]]:
        """Run what is not finished; return the failures as (run, message).
        ``after_run`` is called after each finished run (e.g. extra decodings)."""
        failures = []
        for number, run in enumerate(self.runs, 1):
            if run.finished:
                logger.info("run %d of %d, %s: finished earlier, skipped", number, len(self.runs), run.name)
            else:
                first_update = last_update(run.path("logs", "train.log"))
                verb = "resumes from its last checkpoint" if os.path.isfile(
                    os.path.join(run.checkpoints, "checkpoint_last.pt")) else "starts"
                logger.info("run %d of %d, %s: %s (%d updates, %s)", number, len(self.runs), run.name, verb,
                            self.settings.max_update, run.directory)
                run_start = time.time()
                try:
                    with exclusive_folder(run.directory, "run folder"):
                        execute(run, self.settings, references, self.work_dir,
                                lambda: self._progress(number, run, run_start, first_update))
                except (RunFailed, UsageError, ValueError) as failure:
                    logger.error("run %d of %d, %s FAILED: %s", number, len(self.runs), run.name, failure)
                    failures.append((run, str(failure).splitlines()[0]))
                    continue
                finally:
                    self.trained_updates += max(0, last_update(run.path("logs", "train.log")) - first_update)
                    self.training_seconds += time.time() - run_start
            if after_run:
                try:
                    after_run(run)
                except (RunFailed, UsageError, ValueError) as failure:
                    logger.error("%s: FAILED: %s", run.name, failure)
                    failures.append((run, str(failure).splitlines()[0]))
        return failures

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


# ---------------------------------------------------------------------------------------------
# the configuration file


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _arguments(value) -> bool:
    """A list of command-line words (numbers allowed: TOML writes 0.1 unquoted)."""
    return isinstance(value, list) and all(isinstance(a, (str, int, float)) and not isinstance(a, bool)
                                           for a in value)


def _texts(value) -> bool:
    return isinstance(value, list) and bool(value) and all(_text(v) for v in value)


def _seeds(value) -> bool:
    return _positive(value) or (isinstance(value, list) and bool(value) and all(_positive(s) for s in value)
                                and len(set(value)) == len(value))


# key: (check, what a valid value is); every key of a table is checked before anything runs
SCHEMA = {
    "work_dir": (_text, "a folder name"),
    "seeds": (_seeds, "a positive count or a list of distinct positive integers"),
    "baseline": (_text, "a system name"),
    "systems": (lambda v: isinstance(v, list) and bool(v), "a list of systems"),
    "max_update": (_positive, "a positive integer"),
    "beam": (_positive, "a positive integer"),
    "max_tokens": (_positive, "a positive integer"),
    "batch_size": (_positive, "a positive integer"),
    "average_last": (_count, "an integer >= 0"),
    "save_interval_updates": (_count, "an integer >= 0"),
    "model_args": (_arguments, "a list of command-line words"),
    "train_args": (_arguments, "a list of command-line words"),
    "generate_args": (_arguments, "a list of command-line words"),
    "corpus": (lambda v: isinstance(v, dict), "a table ([corpus])"),
}
CORPUS_SCHEMA = {
    "dir": (_text, "a folder"),
    "sources": (_texts, "a list of language codes"),
    "target": (_text, "a language code"),
    "train_verses": (_positive, "a positive integer"),
    "bpe_merges": (_positive, "a positive integer"),
}
SYSTEM_SCHEMA = {
    "name": (_text, "a name"),
    "base": (_text, "a system name"),
    "arch": (_text, "a registered architecture"),
    "args": (_arguments, "a list of command-line words"),
}
KNOWN_KEYS = set(SCHEMA)


def check_table(table: Dict, schema: Dict, where: str) -> None:
    """One line naming the first unknown key or the first value of the wrong type."""
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {unknown}; known: {sorted(schema)}")
    for key, value in table.items():
        valid, expected = schema[key]
        if not valid(value):
            raise UsageError(f"{where}: {key} must be {expected}, got {value!r}")


def seeds_from(value, where: str) -> List[int]:
    if not _seeds(value):
        raise UsageError(f"{where}: seeds must be {SCHEMA['seeds'][1]}, got {value!r}")
    return list(range(1, value + 1)) if isinstance(value, int) else value


def system_from(entry, where: str) -> System:
    """A registry name, or a table {name, base | arch, args}."""
    if isinstance(entry, dict):
        check_table(entry, SYSTEM_SCHEMA, f"{where}: system {entry.get('name', '(no name)')!r}")
    try:
        if isinstance(entry, str):
            return lookup(entry)
        if isinstance(entry, dict) and "name" in entry and ("base" in entry) != ("arch" in entry):
            args = [str(a) for a in entry.get("args", [])]
            if "base" in entry:
                base = lookup(entry["base"])
                return System(entry["name"], base.arch, base.options + args, task_options=base.task_options,
                              sources=base.sources)
            return System(entry["name"], entry["arch"], args)
    except KeyError as error:
        raise UsageError(f"{where}: {error.args[0]}") from None
    raise UsageError(f"{where}: a system is a registry name or a table with name and either base or arch, "
                     f"got {entry!r}")


@dataclass
class Experiment:
    systems: List[System]
    seeds: List[int]
    work_dir: str
    corpus: Dict
    settings: Dict
    baseline: str


def load_config(path: str) -> Experiment:
    """The whole file checked (keys, types, systems, corpus) before anything runs."""
    import tomllib

    if not os.path.isfile(path):
        raise UsageError(f"config file not found: {path}")
    try:
        with open(path, "rb") as handle:
            config = tomllib.load(handle)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: not valid TOML: {error}") from None
    check_table(config, SCHEMA, path)
    if "max_tokens" in config and "batch_size" in config:
        raise UsageError(f"{path}: give max_tokens or batch_size, not both")
    if not config.get("systems"):
        raise UsageError(f"{path}: 'systems' must list at least one system")
    systems = [system_from(entry, path) for entry in config["systems"]]
    names = [system.name for system in systems]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"{path}: system(s) {repeated} listed more than once")
    baseline = config.get("baseline", names[0])
    if baseline not in names:
        try:
            baseline = lookup(baseline).name
        except KeyError:
            pass
    if baseline not in names:
        raise UsageError(f"{path}: baseline {baseline!r} is not one of the systems {names}")
    systems.sort(key=lambda system: system.name != baseline)  # the baseline first
    corpus = config.get("corpus", {})
    check_table(corpus, CORPUS_SCHEMA, f"{path}: [corpus]")
    if not (corpus.get("dir") or corpus.get("sources")):
        raise UsageError(f"{path}: [corpus] needs dir (an existing build_corpus output) or sources to build")
    return Experiment(systems, seeds_from(config.get("seeds", 1), path),
                      config.get("work_dir", f"work-{os.path.splitext(os.path.basename(path))[0]}"),
                      corpus, config, baseline)


def settings_from(experiment: Experiment, data_bin: str, target: str, max_update: Optional[int]) -> Settings:
    config = experiment.settings
    if "batch_size" in config:
        batching = Batching("--batch-size", int(config["batch_size"]), "sentences")
    else:
        batching = Batching("--max-tokens", int(config.get("max_tokens", TOKEN_BATCHES.size)), "tokens")
    return Settings(
        data_bin=data_bin, target=target, max_update=int(max_update or config.get("max_update", 400)),
        beam=int(config.get("beam", 4)), batching=batching,
        model_args=[str(a) for a in config.get("model_args", MODEL)],
        train_args=[str(a) for a in config.get("train_args", [])],
        generate_args=[str(a) for a in config.get("generate_args", [])],
        average_last=int(config.get("average_last", 0)),
        save_interval_updates=int(config.get("save_interval_updates", 0)),
    )


def prepare_corpus(corpus: Dict, work_dir: str) -> Tuple[str, str]:
    """The corpus folder (built unless it exists) and its target language."""
    from mlmha_fairseq.corpus.builder import MANIFEST

    target = corpus.get("target", "en")
    directory = corpus.get("dir") or os.path.join(work_dir, "corpus-" + "-".join(corpus["sources"]))
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        if not corpus.get("sources"):
            raise UsageError(f"[corpus] dir {directory} has no {MANIFEST}: build it with "
                             "python -m mlmha_fairseq.cli.build_corpus, or give sources to build it here")
        build_corpus(corpus["sources"], target, directory, corpus.get("train_verses"),
                     int(corpus.get("bpe_merges", 4000)), work_dir)
    return directory, target


def parse_args(argv=None):
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("config", help="TOML file: systems, seeds, corpus, budget (see the module's docstring)")
    parser.add_argument("--seeds", type=cli_support.positive_int, help="run seeds 1..N (overrides the file's seeds)")
    parser.add_argument("--work-dir", help="overrides the file's work_dir")
    parser.add_argument("--max-update", type=cli_support.positive_int, help="overrides the file's max_update")
    parser.add_argument("--report-only", action="store_true",
                        help="write the table of the runs finished so far; train nothing")
    parser.add_argument("--ar-trials", type=int, default=10000, help="approximate randomization trials (default: %(default)s)")
    parser.add_argument("--bootstrap-samples", type=int, default=1000,
                        help="bootstrap resamples for s_sel and the paired bootstrap (default: %(default)s)")
    return parser.parse_args(argv)


def writable_folder(path: str, what: str) -> str:
    """``path``, refused up front (before any training) unless it is or can be a folder this
    process may write into."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} {path} exists and is not a folder")
    if not os.access(path if os.path.isdir(path) else parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path} is not writable")
    return path


def run_grid(args, experiment: Experiment, work_dir: str) -> int:
    from mlmha_fairseq.evaluation.replicates import ReplicateOptions, build_report, write_report

    corpus, target = prepare_corpus(experiment.corpus, work_dir)
    settings = settings_from(experiment, os.path.join(corpus, "data-bin"), target, args.max_update)
    references = read_lines(os.path.join(corpus, "text", f"test.raw.{target}"))
    grid = Grid(experiment.systems, experiment.seeds, settings, work_dir)
    logger.info("%d systems x %d seeds = %d runs, %s, in %s", len(experiment.systems), len(experiment.seeds),
                len(grid.runs), settings.budget, work_dir)
    failures = [] if args.report_only else grid.execute(references)
    systems = grid.hypotheses()
    tabled = bool(systems) and systems[0][0] == experiment.baseline
    if tabled:
        report = build_report(systems, [references],
                              ReplicateOptions(args.bootstrap_samples, args.ar_trials))
        table = write_report(report, os.path.join(work_dir, "results"), settings.budget,
                             os.path.basename(args.config))
        print("\n" + table)
        logger.info("results: %s.{md,tex,json,png}", os.path.join(work_dir, "results"))
    else:
        logger.error("no finished run of the baseline %s: no table", experiment.baseline)
    report_failures(failures)
    logger.info("finished in %s", minutes(time.time() - grid.start))
    return 0 if tabled and not failures else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    # force: importing fairseq (its wav2vec2_classification module) already called
    # logging.basicConfig(level=DEBUG), which would keep its format and let matplotlib's DEBUG through
    logging.basicConfig(format="[experiment %(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO,
                        force=True)
    try:
        experiment = load_config(args.config)
        if args.seeds is not None:
            experiment.seeds = seeds_from(args.seeds, "--seeds")
        work_dir = writable_folder(args.work_dir or experiment.work_dir, "work directory")
        if args.report_only:  # reads finished runs only (their files are written atomically)
            return run_grid(args, experiment, work_dir)
        with exclusive_folder(work_dir, "work directory"):
            return run_grid(args, experiment, work_dir)
    except UsageError as error:
        print(f"experiment: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
