"""The main job (``make demo``): real French->English data, every system with the same
budget, sacreBLEU with its signature, paired bootstrap significance, a results table.

Steps, each printed with the command it runs:

1. build the verse-aligned Bible corpus (Segond 1910 -> World English Bible, both public
   domain; test books never seen in training) with ``mlmha_fairseq.cli.build_corpus``;
2. train fairseq's transformer and this package's systems with ``fairseq-train --user-dir
   mlmha_fairseq``, the same model size, data, seed and number of updates;
3. decode the test books with ``fairseq-generate``, detokenize, score with sacreBLEU (13a,
   cased) against the raw references, and test every system against the baseline with
   sacreBLEU's paired bootstrap resampling (1,000 resamples);
4. print and save (``results.md``, ``results.json``) the table and a few translations.

``--seeds N`` trains every system with N seeds from ``--seed`` on (optimizer replicates) and reports them as
MultEval does (Clark et al. 2011): mean ± sd over seeds, s_sel, approximate randomization over
the replicates, sacreBLEU's paired bootstrap per seed, chrF and METEOR, and the metrics 2026 papers
report: chrF++, TER and, with ``--comet-model DIR``, COMET (of the French source); each table also as
``results-<stage>.{md,tex,json,png}``. The runs are those of ``mlmha_fairseq.cli.experiment``
(one folder per system and seed under ``runs/``): rerunning skips finished runs and resumes
stopped ones from their last checkpoint.

``--full`` runs the longer version: more data and updates, every system, and a second table:
the multi-source Transformer over es+fr+de -> en with each combination strategy against the
same model given French alone, each also decoded with one source at a time replaced by a
fixed-seed derangement of the test set (the adversarial evaluation).
``--multi-source-only`` runs that second table alone (with the quick settings unless ``--full``).
Usage: ``python -m mlmha_fairseq.cli.demo --help``.
"""
import logging
import os
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Set

from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.experiments.grid import (
    TOKEN_BATCHES, Batching, Grid, Run, Settings, checkpoint_to_decode, decode, detokenized, minutes, report_failures,
    slug,
)
from mlmha_fairseq.experiments.systems import DEMO_SYSTEMS as SYSTEMS
from mlmha_fairseq.experiments.systems import System, multi_source_system
from mlmha_fairseq.evaluation.comet import checkpoint_path, load_comet
from mlmha_fairseq.evaluation.replicates import REPORT_EXTENSIONS, ReplicateOptions, build_report, write_report
from mlmha_fairseq.evaluation.scoring import corpus_score, resolve_protocol
from mlmha_fairseq.evaluation.text_io import read_lines, write_json, write_text
from mlmha_fairseq.modules.input_combination import SERIAL, STRATEGIES
from mlmha_fairseq.errors import UsageError, lab_imports
from mlmha_fairseq.output_files import check_output_file, check_output_folder

with lab_imports(__name__):  # the corpus builder's sacremoses and subword-nmt
    from mlmha_fairseq.experiments.corpora import build_corpus

logger = logging.getLogger("mlmha_fairseq.demo")
SOURCE, TARGET = "fr", "en"
EXAMPLES_SHOWN = 3

BASELINE = SYSTEMS[0].name
MULTI_SOURCE_LANGS = ("es", "fr", "de")
RESULTS_MD, RESULTS_JSON = "results.md", "results.json"


def multi_source_systems(langs) -> List[System]:
    """The --full demo's second table: the multi-source Transformer with each combination
    strategy over ``langs``, against the same model given the demo's source alone."""
    return [multi_source_system(f"{SOURCE} only", [SOURCE], SERIAL, TARGET)] + [
        multi_source_system(f"{'+'.join(langs)} {strategy}", langs, strategy, TARGET) for strategy in STRATEGIES
    ]


# (train verses, BPE merges, updates) of the quick and the full demo
QUICK = dict(train_verses=10000, bpe_merges=4000, max_update=400)
FULL = dict(train_verses=None, bpe_merges=8000, max_update=3000)

# The multi-source table batches sentences, as the paper (M13): a token budget would give
# the three-source systems a third of the sentences per update.
SENTENCE_BATCHES = Batching("--batch-size", 96, "sentences")


def parse_args(argv=None):
    parser = cli_support.make_parser(__spec__.name, __doc__)
    parser.add_argument("--work-dir", default="work-demo",
                        help="data, checkpoints, outputs, logs and results (default: %(default)s)")
    parser.add_argument("--corpus-dir",
                        help=f"use this corpus made by mlmha_fairseq.cli.build_corpus ({SOURCE}->{TARGET} "
                             "sides) instead of building one in the work directory")
    parser.add_argument("--full", action="store_true",
                        help="longer version: all training verses, more updates, every system")
    parser.add_argument("--multi-source-only", action="store_true",
                        help="run only the multi-source table (the quick settings unless --full)")
    parser.add_argument("--multi-source-corpus-dir",
                        help="with --full or --multi-source-only: use this N-way corpus "
                             "(sources --multi-source-langs) instead of building one")
    parser.add_argument("--multi-source-langs", default=",".join(MULTI_SOURCE_LANGS),
                        help="with --full or --multi-source-only: the sources of the multi-source "
                             f"table, {SOURCE} among them (default: %(default)s)")
    parser.add_argument("--max-update", type=cli_support.positive_int,
                        help=f"training updates per system (default: {QUICK['max_update']}, "
                             f"with --full {FULL['max_update']})")
    parser.add_argument("--systems",
                        help="comma-separated system names of either table to run; a table runs its "
                             "baseline and the systems named, or all of them when none is named. "
                             "Names: " + "; ".join(s.name for s in SYSTEMS) + "; with the default "
                             "--multi-source-langs: " + "; ".join(
                                 s.name for s in multi_source_systems(MULTI_SOURCE_LANGS)))
    parser.add_argument("--beam", type=cli_support.positive_int, default=4,
                        help="beam size of fairseq-generate (default: %(default)s)")
    parser.add_argument("--max-len", type=cli_support.positive_int,
                        help="end every hypothesis after at most this many tokens (fairseq-generate's "
                             "--max-len-a 0 --max-len-b N; default: 1.2 x its source's length + 10)")
    parser.add_argument("--seed", type=int, default=1,
                        help="fairseq-train's --seed (with --seeds: the first) (default: %(default)s)")
    parser.add_argument("--seeds", type=cli_support.positive_int, default=1,
                        help="train every system with this many seeds (optimizer replicates), "
                             "--seed, --seed+1, ...; the tables report mean ± sd over them (default: %(default)s)")
    cli_support.add_comet_model(parser, f" with the {SOURCE} test source")
    args = parser.parse_args(argv)
    args.multi_source_langs = args.multi_source_langs.split(",")
    if SOURCE not in args.multi_source_langs:
        parser.error(f"--multi-source-langs must include {SOURCE}, the single-source baseline's source")
    known = [system.name for system in SYSTEMS + multi_source_systems(args.multi_source_langs)]
    unknown = named_systems(args) - set(known)
    if unknown:
        parser.error(f"unknown system(s) {sorted(unknown)}; known: {known}")
    return args


def named_systems(args) -> Set[str]:
    return {name.strip() for name in (args.systems or "").split(",") if name.strip()}


def chosen_systems(args, systems: List[System]) -> List[System]:
    """The systems of one table to run: its baseline (the first) and those --systems names,
    or, when it names none of them, the table's systems of this run (--full: all)."""
    names = named_systems(args)
    if names & {system.name for system in systems}:
        return [system for number, system in enumerate(systems) if number == 0 or system.name in names]
    return [system for system in systems if args.full or not system.full_only]


class Stage:
    """One corpus, its systems trained with the same budget and seeds, one results table."""

    def __init__(self, name: str, corpus: str, args, settings: dict, batching: Batching):
        self.name, self.args = name, args
        max_len = [] if args.max_len is None else ["--max-len-a", "0", "--max-len-b", str(args.max_len)]
        self.settings = Settings(os.path.join(corpus, "data-bin"), TARGET, settings["max_update"], args.beam,
                                 batching, generate_args=max_len)
        self.references = read_lines(os.path.join(corpus, "text", f"test.raw.{TARGET}"))
        self.sources = read_lines(os.path.join(corpus, "text", f"test.raw.{SOURCE}"))
        self.seeds = list(range(args.seed, args.seed + args.seeds))
        self.failures = []

    def adversarial_bleu(self, run: Run, source: str) -> float:
        """BLEU of ``run`` decoded with ``source`` replaced by a derangement of the test set
        (once; kept in the run's folder)."""
        path = run.path(f"adversarial-{source}.txt")
        if not os.path.isfile(path):
            output = decode(run, self.settings, checkpoint_to_decode(run, self.settings),
                            run.path(f"generate-adversarial-{source}"), self.args.work_dir,
                            "--adversarial-source", source)
            score = corpus_score(detokenized(output, TARGET), [self.references], resolve_protocol("sacrebleu"))
            write_text(path, f"{score.score}\n")
        return float(read_lines(path)[0])

    def run(self, systems: List[System], adversarial_sources=()) -> str:
        """Every system and seed, then the replicate table against the first system and
        examples. Each of ``adversarial_sources`` that a system reads is also deranged in turn."""
        grid = Grid(systems, self.seeds, self.settings, self.args.work_dir, folder_prefix=slug(self.name))
        adversarial: Dict[str, Dict[str, Dict[int, float]]] = {source: {} for source in adversarial_sources}

        def after_run(run: Run):
            for source in [source for source in adversarial_sources if source in run.system.sources]:
                adversarial[source].setdefault(run.system.name, {})[run.seed] = \
                    self.adversarial_bleu(run, source)

        logger.info("%s: %d systems x %d seeds, %s", self.name, len(systems), len(self.seeds), self.settings.budget)
        self.failures = grid.execute(self.references, after_run)
        report_failures(self.failures)
        finished = grid.hypotheses()
        if not finished or finished[0][0] != systems[0].name:
            sys.exit(f"{self.name}: the baseline {systems[0].name} did not finish; see the logs above")
        logger.info("%s: statistics against %s", self.name, systems[0].name)
        columns = {f"BLEU, {source} deranged": values for source, values in adversarial.items()}
        report = build_report(finished, [self.references], ReplicateOptions(), extra=columns,
                              comet=load_comet(self.args.comet_model), sources=self.sources)
        table = write_report(report, results_prefix(self.args.work_dir, self.name), self.settings.budget, self.name)
        first = {name: runs[min(runs)] for name, runs in finished}
        examples = "\n\n".join(
            f"source:    {self.sources[i]}\nreference: {self.references[i]}\n"
            + "\n".join(f"{name + ':':<24} {hyps[i]}" for name, hyps in first.items())
            for i in range(EXAMPLES_SHOWN)
        )
        report_text = (f"## {self.name}\n\n{table}\n\nExample translations (test books, seed "
                       f"{self.seeds[0]}):\n\n```\n{examples}\n```\n")
        record = report.as_dict()
        significance = [{"system": row.name, "method": "sacrebleu-bs", "seed": seed, "p_value": p}
                        for row in report.rows for seed, p in row.bootstrap_p_values.items()]
        significance += [{"system": row.name, "method": "ar-replicates", "seeds": row.ar_seeds,
                          "p_value": row.ar_p_value} for row in report.rows if row.ar_p_value is not None]
        self.record = {"systems": [s.__dict__ for s in systems], "seeds": self.seeds,
                       "bleu": {row["name"]: row["mean"]["BLEU"] for row in record["systems"]},
                       "signature": report.signatures["BLEU"], "significance": significance,
                       "adversarial_bleu": {source: {name: sum(v.values()) / len(v) for name, v in values.items()}
                                            for source, values in adversarial.items()},
                       "replicates": record}
        print("\n" + report_text)
        return report_text


def results_prefix(work_dir: str, table: str) -> str:
    return os.path.join(work_dir, f"results-{slug(table)}")


def corpus_path(sources: Sequence[str], given_dir: Optional[str], args) -> str:
    return given_dir or os.path.join(args.work_dir, "corpus-" + "-".join(sources))


class Table(NamedTuple):
    """A results table of this run: its name, its sources, the option that may give its
    corpus, and whether it is the multi-source table."""

    name: str
    sources: List[str]
    corpus_option: str
    multi_source: bool

    def given_corpus(self, args) -> Optional[str]:
        return getattr(args, self.corpus_option.lstrip("-").replace("-", "_"))


def planned_tables(args) -> List[Table]:
    tables = []
    if not args.multi_source_only:
        tables.append(Table(f"{SOURCE}->{TARGET}", [SOURCE], "--corpus-dir", False))
    if args.full or args.multi_source_only:
        langs = args.multi_source_langs
        tables.append(Table(f"{'+'.join(langs)}->{TARGET}", langs, "--multi-source-corpus-dir", True))
    return tables


def check_paths(args, tables: List[Table]) -> None:
    """Every output path, and every corpus given, before any work: the second table's corpus
    and the results files are otherwise first touched after hours of training."""
    work_dir = args.work_dir
    check_output_folder(work_dir, "--work-dir")
    for folder in ("logs", "runs"):
        check_output_folder(os.path.join(work_dir, folder), "output folder")
    files = [RESULTS_MD, RESULTS_JSON, "commands.log"]
    for table in tables:
        corpus = table.given_corpus(args)
        if corpus is None:
            check_output_folder(corpus_path(table.sources, None, args), "corpus folder")
        else:
            needed = [os.path.join("data-bin", "dict.txt")] + [
                os.path.join("text", f"test.raw.{side}") for side in (SOURCE, TARGET)]
            missing = [path for path in needed if not os.path.isfile(os.path.join(corpus, path))]
            if missing:
                raise UsageError(f"{table.corpus_option} {corpus} has no {missing[0]}: give a folder that "
                                 "mlmha_fairseq.cli.build_corpus wrote, or leave the option out to build one")
        files += [results_prefix(work_dir, table.name) + extension for extension in REPORT_EXTENSIONS]
    for path in files:
        check_output_file(os.path.join(work_dir, path), "output file")


def prepared_corpus(sources, given_dir, args, settings) -> str:
    corpus = corpus_path(sources, given_dir, args)
    logger.info("corpus %s->%s%s", "+".join(sources), TARGET, f" (using {corpus})" if given_dir else "")
    if not given_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        # the demo's own folder, rebuilt for its settings as before (it names no corpus of the user's)
        build_corpus(sources, TARGET, corpus, settings["train_verses"], settings["bpe_merges"], args.work_dir,
                     rebuild=True)
    return corpus


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="[demo %(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO, force=True)
    settings = dict(FULL if args.full else QUICK)
    if args.max_update is not None:
        settings["max_update"] = args.max_update
    tables = planned_tables(args)
    check_paths(args, tables)
    if args.comet_model:  # the folder, before hours of training; the model is loaded for the tables
        checkpoint_path(args.comet_model)
    start = time.time()

    stages, reports = [], []
    for table in tables:
        corpus = prepared_corpus(table.sources, table.given_corpus(args), args, settings)
        if table.multi_source:
            stages.append(Stage(table.name, corpus, args, settings, SENTENCE_BATCHES))
            reports.append(stages[-1].run(chosen_systems(args, multi_source_systems(table.sources)),
                                          adversarial_sources=table.sources))
        else:
            stages.append(Stage(table.name, corpus, args, settings, TOKEN_BATCHES))
            reports.append(stages[-1].run(chosen_systems(args, SYSTEMS)))

    write_text(os.path.join(args.work_dir, RESULTS_MD), "\n".join(reports))
    write_json(os.path.join(args.work_dir, RESULTS_JSON),
               {"settings": dict(settings, seeds=args.seeds, max_len=args.max_len),
                "stages": {stage.name: stage.record for stage in stages}})
    logger.info("finished in %s; results in %s", minutes(time.time() - start),
                os.path.join(args.work_dir, RESULTS_MD))
    if any(stage.failures for stage in stages):
        sys.exit(1)


if __name__ == "__main__":
    cli_support.command(main)
