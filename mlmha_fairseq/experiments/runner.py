"""The experiment runner: a grid of systems x training seeds from a TOML file (:mod:`.config`)
on a corpus (:mod:`.corpora`), its runs (:mod:`.grid`), then one MultEval-style table (mean ±
sd over seeds, s_sel, approximate randomization over the replicates, sacreBLEU's paired
bootstrap per seed; chrF, METEOR, chrF++, TER, and COMET with ``--comet-model``) as Markdown,
LaTeX, JSON and PNG. ``python -m mlmha_fairseq.cli.experiment`` is its command line."""
import json
import logging
import os
import sys
import time
from typing import Dict, List

from mlmha_fairseq.corpus.builder import MANIFEST, TEXT_DIR
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.evaluation.comet import checkpoint_path, load_comet
from mlmha_fairseq.evaluation.replicates import REPORT_EXTENSIONS
from mlmha_fairseq.evaluation.text_io import check_same_length, read_lines
from mlmha_fairseq.experiments.config import Experiment, check_run_folders, load_config, seeds_from, settings_from
from mlmha_fairseq.experiments.corpora import Corpus, check_corpus, prepare_corpus
from mlmha_fairseq.experiments import records, slurm
from mlmha_fairseq.experiments.curves import CURVE_REPORT_EXTENSIONS, write_curve_report
from mlmha_fairseq.experiments.grid import Grid, check_run_settings, minutes, report_failures
from mlmha_fairseq.experiments.matching import matched_systems
from mlmha_fairseq.output_files import check_output_folder, exclusive_folder

logger = logging.getLogger("mlmha_fairseq.experiment")


def visible_gpus() -> List[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (none: the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in given.split(",") if name.strip()] if given else []
    return names or [str(index) for index in range(torch.cuda.device_count())]


def slot_env(slot: int, threads: int, gpus: List[str]) -> Dict[str, str]:
    """The environment of the commands of one parallel slot: its intra-op threads (each run
    gets the same count whatever the number of jobs, so that parallel and sequential runs
    compute the same) and, on a GPU machine, one GPU (slots share GPUs round-robin)."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
    return env


def check_comet(comet_model: str, corpus: Dict) -> None:
    """Before anything runs: ``--comet-model`` is a COMET model folder that loads (unbabel-comet
    installed, its encoder local; loaded once, kept for the report), and a data-bin corpus gives
    the raw test sources COMET reads, one per reference (checked first: it costs nothing)."""
    checkpoint_path(comet_model)
    if "data_bin" in corpus:
        if "test_sources" not in corpus:
            raise UsageError("--comet-model with a [corpus] data_bin needs test_sources = the raw test sentences "
                             "of the (first) source language")
        check_same_length([(corpus["test_sources"], read_lines(corpus["test_sources"])),
                           (corpus["test_references"], read_lines(corpus["test_references"]))])
    load_comet(comet_model)


def check_work_dir_entries(work_dir: str) -> None:
    """What the runner writes in its work directory, by kind: one of the wrong kind (a file
    named runs, a folder named results.md) would fail only when it is written, after training."""
    for name in ("runs", "logs"):
        if os.path.lexists(os.path.join(work_dir, name)) and not os.path.isdir(os.path.join(work_dir, name)):
            raise UsageError(f"work directory {work_dir}: {name} is not a folder; the runner keeps its {name} there: "
                             "move it away")
    for name in ("commands.log", *(f"results{suffix}" for suffix in REPORT_EXTENSIONS),
                 *(f"results-curves{suffix}" for suffix in CURVE_REPORT_EXTENSIONS)):
        if os.path.isdir(os.path.join(work_dir, name)):
            raise UsageError(f"work directory {work_dir}: {name} is a folder; the runner writes a file of that name: "
                             "move it away")


def check_slurm() -> None:
    """A ``[launcher]`` grid is submitted with Slurm's ``sbatch`` (submitit): refused up front
    where there is none, rather than after the corpus is built."""
    import shutil

    if shutil.which("sbatch") is None:
        raise UsageError("[launcher] submits the runs to Slurm, but sbatch is not on this machine's PATH: run the "
                         "grid on a Slurm login node, or remove [launcher] to train here")


def comet_sources(corpus_config: Dict, corpus: Corpus) -> List[str]:
    """The raw test sentences COMET reads: ``[corpus] test_sources`` if given (a data-bin needs
    it), else those of the first source language in the folder this package built."""
    if "test_sources" in corpus_config:
        return read_lines(corpus_config["test_sources"])
    folder = os.path.dirname(corpus.data_bin)
    with open(os.path.join(folder, MANIFEST), encoding="utf-8") as handle:
        source = json.load(handle)["sources"][0]
    return read_lines(os.path.join(folder, TEXT_DIR, f"test.raw.{source}"))


def run_grid(args, experiment: Experiment, work_dir: str) -> int:
    from mlmha_fairseq.evaluation.replicates import ReplicateOptions, build_report, write_report

    corpus = prepare_corpus(experiment.corpus, work_dir, args.rebuild_corpus)
    settings = settings_from(experiment, corpus, args.max_update)
    references = read_lines(corpus.references)
    systems, matched = experiment.systems, {}
    if experiment.matched:  # counted with the corpus's dictionaries: their size is part of the count
        systems, matched, _counts = matched_systems(experiment.systems, experiment.baseline, experiment.matched,
                                                    settings, experiment.matched_by)
        check_run_folders([system.name for system in systems], args.config)
    grid = Grid(systems, experiment.seeds, settings, work_dir)
    check_run_settings(grid.runs, settings, references)
    logger.info("%d systems x %d seeds = %d runs, %s, in %s", len(systems), len(experiment.seeds),
                len(grid.runs), settings.budget, work_dir)
    if args.records:
        restored = records.restore(grid.runs, args.records, corpus.references)
        logger.info("%d run(s) restored from the records in %s", restored, args.records)
    # submitted to Slurm without waiting: runs finish later, a runner started again collects them
    submitted_only = bool(experiment.launcher and not experiment.launcher.wait and not args.report_only)
    if args.report_only:
        failures = []
    elif experiment.launcher:
        failures = slurm.submit(grid, references, experiment.launcher)
    else:
        gpus = visible_gpus()
        settings.cpu = not gpus
        jobs = args.jobs or max(1, len(gpus))
        threads = args.threads or max(1, (os.cpu_count() or 1) // jobs)
        logger.info("%d run(s) at a time, %d thread(s) each%s", jobs, threads,
                    f", on GPU(s) {', '.join(gpus)}" if gpus else ", on the CPU")
        # each run recorded as soon as it is finished (or found finished from an earlier round), so
        # that a machine lost mid-grid keeps them
        record = (lambda run: records.save([run], args.records, corpus.references)) if args.records else None
        failures = grid.execute(references, after_run=record, jobs=jobs,
                                slot_env=lambda slot: slot_env(slot, threads, gpus))
    if args.records and (args.report_only or experiment.launcher):  # no local execution recorded them
        logger.info("%d finished run(s) recorded in %s", records.save(grid.runs, args.records, corpus.references),
                    args.records)
    finished = grid.hypotheses()
    tabled = bool(finished) and finished[0][0] == experiment.baseline
    if tabled:
        comet = load_comet(args.comet_model)
        report = build_report(finished, [references], ReplicateOptions(args.bootstrap_samples, args.ar_trials),
                              comet=comet, sources=comet_sources(experiment.corpus, corpus) if comet else None,
                              matched=matched, costs=grid.costs(), pairs=experiment.comparisons)
        table = write_report(report, os.path.join(work_dir, "results"), settings.budget,
                             os.path.basename(args.config))
        print("\n" + table)
        logger.info("results: %s.{md,tex,json,png}", os.path.join(work_dir, "results"))
    elif submitted_only:
        logger.info("no finished run of the baseline %s yet: no table", experiment.baseline)
    else:
        logger.error("no finished run of the baseline %s: no table", experiment.baseline)
    if settings.convergence:  # the curves so far, finished runs or not
        curves = write_curve_report(grid, os.path.join(work_dir, "results-curves"))
        if curves:
            print("\n" + curves)
            logger.info("learning curves: %s.{png,md,json}", os.path.join(work_dir, "results-curves"))
    report_failures(failures)
    logger.info("finished in %s", minutes(time.time() - grid.start))
    return 0 if (tabled or submitted_only) and not failures else 1


def run(args) -> int:
    """Run (or with ``args.report_only`` only tabulate) the grid of ``args.config``; the exit
    status: 0 when a table is written and no run failed, 1 otherwise, 2 for input refused."""
    # force: importing fairseq (its wav2vec2_classification module) already called
    # logging.basicConfig(level=DEBUG), which would keep its format and let matplotlib's DEBUG through
    logging.basicConfig(format="[experiment %(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO,
                        force=True)
    try:
        experiment = load_config(args.config)
        if args.seeds is not None:
            experiment.seeds = seeds_from(args.seeds, "--seeds")
        work_dir = args.work_dir or experiment.work_dir
        check_output_folder(work_dir, "work directory")
        check_work_dir_entries(work_dir)
        check_corpus(experiment.corpus)
        if experiment.launcher and not args.report_only:
            check_slurm()
        if args.records and not os.path.isdir(args.records):
            raise UsageError(f"--records {args.records} is not a folder (create it, empty, to start recording)")
        if args.comet_model:
            check_comet(args.comet_model, experiment.corpus)
        if args.report_only and not args.records:  # reads finished runs only (their files are written atomically)
            return run_grid(args, experiment, work_dir)
        with exclusive_folder(work_dir, "work directory"):
            return run_grid(args, experiment, work_dir)
    except UsageError as error:
        print(f"experiment: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
