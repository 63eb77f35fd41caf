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

``--full`` runs the longer version: more data and updates, every system, and a second table:
the multi-source Transformer over es+fr+de -> en with each combination strategy against the
same model given French alone, each also decoded with one source at a time replaced by a
fixed-seed derangement of the test set (the adversarial evaluation).
``--multi-source-only`` runs that second table alone (with the quick settings unless ``--full``).
Usage: ``python -m mlmha_fairseq.cli.demo --help``.
"""
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, NamedTuple, Set, Tuple

import mlmha_fairseq
from mlmha_fairseq.cli import _support as cli_support
from mlmha_fairseq.evaluation.scoring import TextOptions, corpus_score, load_hypotheses, resolve_protocol
from mlmha_fairseq.evaluation.significance import SignificanceOptions, compare_systems
from mlmha_fairseq.evaluation.text_io import read_lines, write_json, write_text

logger = logging.getLogger("mlmha_fairseq.demo")
USER_DIR = os.path.dirname(os.path.abspath(mlmha_fairseq.__file__))
SOURCE, TARGET = "fr", "en"
SIGNIFICANCE_METHOD = "sacrebleu-bs"
EXAMPLES_SHOWN = 3


@dataclass
class System:
    name: str
    arch: str
    options: List[str] = field(default_factory=list)
    full_only: bool = False
    task_options: List[str] = field(default_factory=list)  # for fairseq-train and -generate
    sources: Tuple[str, ...] = ()  # of a multi-source system (its --source-langs)


MLMHA = ["--decoder-cross-attention", "multi-layer"]
SYSTEMS = [
    System("Transformer (fairseq)", "transformer"),
    System("MLMHA M-00", "slot_transformer", MLMHA + ["--mlmha-variant", "M-00"]),
    System("Iter-C-Agg", "slot_transformer", ["--layer-aggregation", "iter-c-agg"], full_only=True),
    System("MLMHA M-01", "slot_transformer", MLMHA + ["--mlmha-variant", "M-01"], full_only=True),
    System("MLMHA M-10", "slot_transformer", MLMHA + ["--mlmha-variant", "M-10"], full_only=True),
    System("MLMHA M-11", "slot_transformer", MLMHA + ["--mlmha-variant", "M-11"], full_only=True),
    System("S-Agg", "slot_transformer", ["--layer-aggregation", "s-agg"], full_only=True),
    System("Transparent Attention", "slot_transformer", ["--layer-aggregation", "transparent"], full_only=True),
    System("MMA", "slot_transformer", ["--encoder-self-attention", "mixed"], full_only=True),
    System("MLRF Both-FNN-SA", "slot_transformer",
           ["--mlrf-encoder-fusion", "fnn", "--mlrf-decoder-fusion", "sa"], full_only=True),
    System("Enc-DC", "slot_transformer", ["--dc-encoder-layers", "all"], full_only=True),
    System("MS-2 + AIF", "ms_transformer", ["--aux-decoder-layers", "2", "--aux-fusion", "--criterion",
                                             "multi_decoder_label_smoothed_cross_entropy"], full_only=True),
]
BASELINE = SYSTEMS[0].name
MULTI_SOURCE_LANGS = ("es", "fr", "de")
STRATEGIES = ("serial", "parallel", "flat", "hierarchical")


def multi_source_systems(langs) -> List[System]:
    """The --full demo's second table: the multi-source Transformer with each combination
    strategy over ``langs``, against the same model given the demo's source alone."""
    def system(name, sources, strategy):
        task = ["--task", "multi_source_translation", "--source-langs", ",".join(sources),
                "--target-lang", TARGET]
        return System(name, "multi_source_transformer", ["--combination-strategy", strategy],
                      task_options=task, sources=tuple(sources))

    return [system(f"{SOURCE} only", [SOURCE], "serial")] + [
        system(f"{'+'.join(langs)} {strategy}", langs, strategy) for strategy in STRATEGIES
    ]

MODEL = [
    "--encoder-layers", "3", "--decoder-layers", "3",
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings", "--dropout", "0.1",
]

# (train verses, BPE merges, updates) of the quick and the full demo
QUICK = dict(train_verses=10000, bpe_merges=4000, max_update=400)
FULL = dict(train_verses=None, bpe_merges=8000, max_update=3000)
class Batching(NamedTuple):
    option: str  # the fairseq-train option that bounds a batch
    size: int
    unit: str


# The multi-source table batches sentences, as the paper (M13): a token budget would give
# the three-source systems a third of the sentences per update.
TOKEN_BATCHES = Batching("--max-tokens", 4096, "tokens")
SENTENCE_BATCHES = Batching("--batch-size", 96, "sentences")


def run(command: List[str], log_name: str, work_dir: str) -> None:
    """Run a command, its output into ``logs/<log_name>.log``; fail with the log's tail."""
    log_path = os.path.join(work_dir, "logs", f"{log_name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    logger.info("$ %s", " ".join(command))
    start = time.time()
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        with open(log_path) as log:
            tail = log.read()[-3000:]
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{tail}\n(full log: {log_path})")
    logger.info("  done in %.0f s (log: %s)", time.time() - start, log_path)


def fairseq(tool: str, *args) -> List[str]:
    return [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]


def build_corpus(sources, corpus_dir: str, settings: dict, work_dir: str) -> None:
    options = ["--sources", *sources, "--target", TARGET, "--out-dir", corpus_dir,
               "--max-tokens-per-verse", "50", "--bpe-merges", str(settings["bpe_merges"])]
    if settings["train_verses"]:
        options += ["--max-train-verses", str(settings["train_verses"])]
    run([sys.executable, "-m", "mlmha_fairseq.cli.build_corpus", *options],
        f"corpus-{'-'.join(sources)}", work_dir)


def train(system: System, data_bin: str, save_dir: str, max_update: int, seed: int, work_dir: str,
          batching: Batching):
    run(fairseq(
        "train", data_bin, "--user-dir", USER_DIR, *system.task_options, "--arch", system.arch, *MODEL,
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "2e-3",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", max(1, max_update // 5),
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        batching.option, batching.size, "--max-update", max_update, "--save-dir", save_dir,
        "--no-epoch-checkpoints", "--no-last-checkpoints",
        "--seed", seed, "--cpu", "--num-workers", "0", "--log-interval", "25", "--no-progress-bar",
        *system.options,  # last: a system may replace the criterion
    ), f"train-{os.path.basename(save_dir)}", work_dir)


def translate(system: System, data_bin: str, checkpoint: str, output: str, beam: int, work_dir: str,
              *extra) -> None:
    # --required-batch-size-multiple 1: fairseq's default of 8 drops the last test sentences
    command = fairseq(
        "generate", data_bin, "--user-dir", USER_DIR, *system.task_options, *extra,
        "--path", checkpoint, "--beam", beam,
        "--remove-bpe", "--batch-size", "64", "--required-batch-size-multiple", "1",
        "--max-len-a", "1.2", "--max-len-b", "10", "--cpu", "--results-path", output,
    )
    run(command, f"generate-{os.path.basename(output)}", work_dir)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def results_table(scores, significance, baseline: str, budget: str, signature: str,
                  extra_columns=None) -> str:
    """Markdown: BLEU with significance marks, gain and p-value against ``baseline``;
    ``extra_columns`` = {title: {system: value}} adds columns ("—" where a system has no value)."""
    p_values = {r.system: r for r in significance}
    extra_columns = extra_columns or {}
    lines = ["| system | BLEU | Δ | p (paired bootstrap) |" + "".join(f" {title} |" for title in extra_columns),
             "|---|---|---|---|" + "---|" * len(extra_columns)]
    for name, score in scores.items():
        if name == baseline:
            row = f"| {name} | {score:.2f} | | |"
        else:
            result = p_values[name]
            row = f"| {name} | {score:.2f}{result.mark} | {score - scores[baseline]:+.2f} | {result.p_value:.3f} |"
        extra = [f"{values[name]:.2f}" if name in values else "—" for values in extra_columns.values()]
        lines.append(row + "".join(f" {value} |" for value in extra))
    lines.append("")
    lines.append(f"{budget} each; sacreBLEU {signature}; † p<0.05, ‡ p<0.01 against "
                 f"{baseline} (sacreBLEU paired bootstrap, 1,000 resamples)")
    return "\n".join(lines)


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
    parser.add_argument("--max-update", type=int,
                        help=f"training updates per system (default: {QUICK['max_update']}, "
                             f"with --full {FULL['max_update']})")
    parser.add_argument("--systems",
                        help="comma-separated system names of either table to run; a table runs its "
                             "baseline and the systems named, or all of them when none is named. "
                             "Names: " + "; ".join(s.name for s in SYSTEMS) + "; with the default "
                             "--multi-source-langs: " + "; ".join(
                                 s.name for s in multi_source_systems(MULTI_SOURCE_LANGS)))
    parser.add_argument("--beam", type=int, default=4,
                        help="beam size of fairseq-generate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1,
                        help="fairseq-train's --seed for every system (default: %(default)s)")
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
    """One corpus, its systems trained with the same budget, one results table."""

    def __init__(self, name: str, corpus: str, args, settings: dict, batching: Batching):
        self.name, self.corpus, self.args, self.settings = name, corpus, args, settings
        self.batching = batching
        self.data_bin = os.path.join(corpus, "data-bin")
        self.references = read_lines(os.path.join(corpus, "text", f"test.raw.{TARGET}"))
        self.sources = read_lines(os.path.join(corpus, "text", f"test.raw.{SOURCE}"))
        self.protocol = resolve_protocol("sacrebleu")
        self.text_options = TextOptions(input_format="generate", detokenize_lang=TARGET)
        self.signature = ""

    def score(self, output: str) -> Tuple[List[str], float]:
        hypotheses = load_hypotheses(os.path.join(output, "generate-test.txt"), self.protocol, self.text_options)
        score = corpus_score(hypotheses, [self.references], self.protocol)
        self.signature = score.signature
        logger.info("  %s", score.line)
        return hypotheses, score.score

    def train_and_decode(self, system: System, number: int, total: int) -> Tuple[str, str]:
        """Train ``system``, decode the test set; return the checkpoint and output folder."""
        name = slug(f"{self.name}-{system.name}")
        logger.info("%s: system %d/%d %s: train %d updates, decode", self.name, number, total,
                    system.name, self.settings["max_update"])
        save_dir = os.path.join(self.args.work_dir, "checkpoints", name)
        train(system, self.data_bin, save_dir, self.settings["max_update"], self.args.seed, self.args.work_dir,
              self.batching)
        checkpoint = os.path.join(save_dir, "checkpoint_best.pt")
        output = os.path.join(self.args.work_dir, "outputs", name)
        translate(system, self.data_bin, checkpoint, output, self.args.beam, self.args.work_dir)
        return checkpoint, output

    def run(self, systems: List[System], adversarial_sources=()) -> str:
        """Every system, then significance against the first; the table and examples.
        Each of ``adversarial_sources`` that a system reads is also deranged in turn."""
        hypotheses, scores = {}, {}
        adversarial = {source: {} for source in adversarial_sources}
        for number, system in enumerate(systems, 1):
            checkpoint, output = self.train_and_decode(system, number, len(systems))
            hypotheses[system.name], scores[system.name] = self.score(output)
            for source in [source for source in adversarial_sources if source in system.sources]:
                deranged = f"{output}-adversarial-{source}"
                translate(system, self.data_bin, checkpoint, deranged, self.args.beam,
                          self.args.work_dir, "--adversarial-source", source)
                adversarial[source][system.name] = self.score(deranged)[1]
        baseline = systems[0].name
        logger.info("%s: significance against %s", self.name, baseline)
        others = [(name, hyps) for name, hyps in hypotheses.items() if name != baseline]
        significance, _ = compare_systems(hypotheses[baseline], others, [self.references], self.protocol,
                                          [SIGNIFICANCE_METHOD], SignificanceOptions())
        columns = {f"BLEU, {source} deranged": values for source, values in adversarial.items()}
        budget = f"{self.settings['max_update']} updates of {self.batching.size:,} {self.batching.unit}"
        table = results_table(scores, significance, baseline, budget, self.signature, columns)
        examples = "\n\n".join(
            f"source:    {self.sources[i]}\nreference: {self.references[i]}\n"
            + "\n".join(f"{name + ':':<24} {hyps[i]}" for name, hyps in hypotheses.items())
            for i in range(EXAMPLES_SHOWN)
        )
        report = f"## {self.name}\n\n{table}\n\nExample translations (test books):\n\n```\n{examples}\n```\n"
        self.record = {"systems": [s.__dict__ for s in systems], "bleu": scores, "signature": self.signature,
                       "significance": [r.as_row() for r in significance], "adversarial_bleu": adversarial}
        print("\n" + report)
        return report


def prepared_corpus(sources, given_dir, args, settings) -> str:
    corpus = given_dir or os.path.join(args.work_dir, "corpus-" + "-".join(sources))
    logger.info("corpus %s->%s%s", "+".join(sources), TARGET, f" (using {corpus})" if given_dir else "")
    if not given_dir:
        build_corpus(sources, corpus, settings, args.work_dir)
    return corpus


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(format="[demo %(asctime)s] %(message)s", datefmt="%H:%M:%S", level=logging.INFO, force=True)
    settings = dict(FULL if args.full else QUICK)
    if args.max_update:
        settings["max_update"] = args.max_update
    start = time.time()

    stages, reports = [], []
    if not args.multi_source_only:
        stages.append(Stage(f"{SOURCE}->{TARGET}", prepared_corpus([SOURCE], args.corpus_dir, args, settings),
                            args, settings, TOKEN_BATCHES))
        reports.append(stages[-1].run(chosen_systems(args, SYSTEMS)))
    if args.full or args.multi_source_only:
        langs = args.multi_source_langs
        corpus = prepared_corpus(langs, args.multi_source_corpus_dir, args, settings)
        stages.append(Stage(f"{'+'.join(langs)}->{TARGET}", corpus, args, settings, SENTENCE_BATCHES))
        reports.append(stages[-1].run(chosen_systems(args, multi_source_systems(langs)), adversarial_sources=langs))

    write_text(os.path.join(args.work_dir, "results.md"), "\n".join(reports))
    write_json(os.path.join(args.work_dir, "results.json"),
               {"settings": settings, "stages": {stage.name: stage.record for stage in stages}})
    logger.info("finished in %.1f minutes; results in %s", (time.time() - start) / 60,
                os.path.join(args.work_dir, "results.md"))


if __name__ == "__main__":
    main()
