"""The experiment runner's TOML file: every key and value checked before anything runs."""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments.corpora import POSTPROCESS, Corpus
from mlmha_fairseq.experiments.slurm import SlurmLauncher
from mlmha_fairseq.experiments.grid import (METRICS, MODEL, TOKEN_BATCHES, Batching, Convergence, DataParallel, Settings,
                                            slug)
from mlmha_fairseq.experiments.matching import MATCHED_BY
from mlmha_fairseq.experiments.systems import MULTI_SOURCE_STRATEGIES, System, lookup, multi_source_system


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


def _plain(value) -> bool:
    """No control character: a launcher value becomes part of a line of the job script, and a
    newline in it would be a line of its own (a command)."""
    return isinstance(value, (str, int)) and not any(ord(c) < 32 or ord(c) == 127 for c in str(value))


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
    "lr": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a positive number"),
    "warmup_updates": (_positive, "a positive integer"),
    "corpus": (lambda v: isinstance(v, dict), "a table ([corpus])"),
    "convergence": (lambda v: isinstance(v, dict), "a table ([convergence])"),
    "launcher": (lambda v: isinstance(v, dict), "a table ([launcher]: Slurm)"),
    "matched": (lambda v: isinstance(v, bool) or _texts(v),
                "true (every system but the baseline) or a list of system names: each gets a budget-matched "
                "baseline"),
    "matched_by": (lambda v: v in MATCHED_BY, f"one of {', '.join(MATCHED_BY)} (how a matched baseline grows)"),
    "comparisons": (lambda v: isinstance(v, list) and bool(v) and all(_texts(pair) and len(pair) == 2 for pair in v),
                    'a list of [system, against] pairs, e.g. [["MLRF, lr 5e-4", "Transformer, lr 5e-4"]]'),
}
LAUNCHER_SCHEMA = {
    "partition": (lambda v: _text(v) and _plain(v), "a Slurm partition (no control characters)"),
    "cpus_per_run": (_positive, "a positive integer"),
    "gpus_per_run": (_count, "an integer >= 0"),
    "tasks_per_run": (_positive, "a positive integer (data-parallel ranks of one run, one Slurm task each)"),
    "nodes_per_run": (_positive, "a positive integer (nodes that one run's tasks are spread over)"),
    "time_min": (_positive, "a positive integer (minutes)"),
    "mem_gb": (_count, "an integer >= 0 (0: the partition's default)"),
    "sbatch": (lambda v: isinstance(v, dict) and all(_plain(k) and _plain(x) for k, x in v.items()),
               "a table of further sbatch options without control characters, e.g. { qos = \"high\" }"),
    "wait": (lambda v: isinstance(v, bool), "true or false"),
}
CONVERGENCE_SCHEMA = {
    "validate_every": (_positive, "a positive integer (updates between validations)"),
    "patience": (_count, "an integer >= 0 (validations without a gain before the run stops; "
                         "0: never, a fixed budget of max_update with its curve)"),
    "metric": (lambda v: v in METRICS, f"one of {', '.join(METRICS)} (what patience and checkpoint_best.pt follow)"),
}
CORPUS_SCHEMA = {
    "dir": (_text, "a folder (a build_corpus output, or where to build)"),
    "raw": (_text, "a folder of raw parallel text: {train,valid,test}.<language>"),
    "data_bin": (_text, "a fairseq-preprocess output folder"),
    "test_references": (_text, "a file of raw test references (with data_bin)"),
    "test_sources": (_text, "a file of the raw test sources, for COMET (with data_bin)"),
    "postprocess": (lambda v: v in POSTPROCESS, f"one of {sorted(POSTPROCESS)}"),
    "detokenize": (lambda v: isinstance(v, bool), "true or false (Moses-detokenize hypotheses)"),
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
    "strategy": (lambda v: v in MULTI_SOURCE_STRATEGIES, f"one of {', '.join(MULTI_SOURCE_STRATEGIES)}"),
    "sources": (_texts, "a list of the corpus's source languages"),
}


def check_table(table: Dict, schema: Dict, where: str) -> None:
    """One line naming the first unknown key or the first value of the wrong type."""
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {unknown}; known: {sorted(schema)}")
    for key, value in table.items():
        valid, expected = schema[key]
        if not valid(value):
            raise UsageError(f"{where}: {key} must be {expected}, got {value!r}")


def check_run_folders(names: List[str], where: str) -> None:
    """Each system trains in ``runs/<slug of its name>``: two names of one slug (``"A B"`` and
    ``"a-b"``) would share a folder, the second never trained and given the first one's scores,
    and a name of punctuation only has no folder of its own."""
    folders: Dict[str, str] = {}
    for name in names:
        folder = slug(name)
        if not folder:
            raise UsageError(f"{where}: system name {name!r} has no letter or digit, which its run folder is named "
                             "after: give it one")
        if folder in folders:
            raise UsageError(f"{where}: systems {folders[folder]!r} and {name!r} would share the run folder "
                             f"runs/{folder}: rename one")
        folders[folder] = name


def seeds_from(value, where: str) -> List[int]:
    if not _seeds(value):
        raise UsageError(f"{where}: seeds must be {SCHEMA['seeds'][1]}, got {value!r}")
    return list(range(1, value + 1)) if isinstance(value, int) else value


def system_from(entry, where: str, target: str = "en") -> System:
    """A registry name, or a table {name, base | arch, args}, or a multi-source system
    {name, strategy, sources, args} over the corpus's N-way data (``target``: its target)."""
    if isinstance(entry, dict):
        check_table(entry, SYSTEM_SCHEMA, f"{where}: system {entry.get('name', '(no name)')!r}")
    try:
        if isinstance(entry, str):
            return lookup(entry)
        kinds = [key for key in ("base", "arch", "strategy") if key in entry] if isinstance(entry, dict) else []
        if isinstance(entry, dict) and "name" in entry and kinds == ["strategy"] and "sources" in entry:
            system = multi_source_system(entry["name"], entry["sources"], entry["strategy"], target)
            system.options += [str(a) for a in entry.get("args", [])]
            return system
        if isinstance(entry, dict) and "name" in entry and len(kinds) == 1 and "sources" not in entry:
            args = [str(a) for a in entry.get("args", [])]
            if "base" in entry:
                base = lookup(entry["base"])
                return System(entry["name"], base.arch, base.options + args, task_options=base.task_options,
                              sources=base.sources)
            return System(entry["name"], entry["arch"], args)
    except KeyError as error:
        raise UsageError(f"{where}: {error.args[0]}") from None
    raise UsageError(f"{where}: a system is a registry name, a table with name and either base or arch, "
                     f"or a table with name, strategy and sources (multi-source), got {entry!r}")


@dataclass
class Experiment:
    systems: List[System]
    seeds: List[int]
    work_dir: str
    corpus: Dict
    settings: Dict
    baseline: str
    launcher: Optional[SlurmLauncher] = None  # None: on this machine
    matched: List[str] = field(default_factory=list)  # systems that get a budget-matched baseline
    matched_by: str = "ffn"  # how (experiments/matching.py)
    comparisons: List[Tuple[str, str]] = field(default_factory=list)  # (system, against) tested beside the baseline's


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
    target = config.get("corpus", {}).get("target", "en") if isinstance(config.get("corpus"), dict) else "en"
    systems = [system_from(entry, path, target) for entry in config["systems"]]
    names = [system.name for system in systems]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"{path}: system(s) {repeated} listed more than once")
    check_run_folders(names, path)
    baseline = grid_name(config.get("baseline", names[0]), names)
    if baseline not in names:
        raise UsageError(f"{path}: baseline {baseline!r} is not one of the systems {names}")
    systems.sort(key=lambda system: system.name != baseline)  # the baseline first
    matched = matched_from(config, names, baseline, path)
    comparisons = comparisons_from(config, names, baseline, path)
    convergence = config.get("convergence")
    if convergence is not None:
        check_table(convergence, CONVERGENCE_SCHEMA, f"{path}: [convergence]")
        missing = sorted({"validate_every", "patience"} - set(convergence))
        if missing:
            raise UsageError(f"{path}: [convergence] needs {' and '.join(missing)}")
    launcher = config.get("launcher")
    if launcher is not None:
        check_table(launcher, LAUNCHER_SCHEMA, f"{path}: [launcher]")
        launcher = SlurmLauncher(**{key: value for key, value in launcher.items()})
        launcher.check(f"{path}: [launcher]")
    corpus = config.get("corpus", {})
    check_table(corpus, CORPUS_SCHEMA, f"{path}: [corpus]")
    if not (corpus.get("dir") or corpus.get("sources") or corpus.get("data_bin")):
        raise UsageError(f"{path}: [corpus] needs dir (an existing build_corpus output), sources to build, "
                         "raw (raw parallel text) or data_bin (a fairseq data-bin)")
    if "raw" in corpus and "data_bin" in corpus:
        raise UsageError(f"{path}: [corpus] give raw or data_bin, not both")
    return Experiment(systems, seeds_from(config.get("seeds", 1), path),
                      config.get("work_dir", f"work-{os.path.splitext(os.path.basename(path))[0]}"),
                      corpus, config, baseline, launcher, matched, config.get("matched_by", "ffn"), comparisons)


def grid_name(name: str, names: List[str]) -> str:
    """``name`` as the grid calls it: itself if a system of ``names`` has it, else the name of the
    registered system it is a key of (left as it is if it is neither)."""
    if name in names:
        return name
    try:
        return lookup(name).name
    except KeyError:
        return name


def system_named(name: str, names: List[str], key: str, path: str) -> str:
    """``name``, given in the config's ``key``, as the grid calls it; one line if no system has it."""
    name = grid_name(name, names)
    if name not in names:
        raise UsageError(f"{path}: {key} names {name!r}, which is not one of the systems {names}")
    return name


def matched_from(config: Dict, names: List[str], baseline: str, path: str) -> List[str]:
    """The systems of ``matched`` (registry keys resolved to their names): every system but
    the baseline for ``true``; one line naming a system that is not in the grid, or the baseline."""
    value = config.get("matched", False)
    if "matched_by" in config and not value:
        raise UsageError(f"{path}: matched_by needs matched (true, or the systems to match)")
    if value is True:
        return [name for name in names if name != baseline]
    if value is False:
        return []
    chosen = []
    for name in value:
        name = system_named(name, names, "matched", path)
        if name == baseline:
            raise UsageError(f"{path}: matched names the baseline {baseline!r}, which is what the others are "
                             "matched with")
        chosen.append(name)
    return chosen


def comparisons_from(config: Dict, names: List[str], baseline: str, path: str) -> List[Tuple[str, str]]:
    """The (system, against) pairs of ``comparisons``, registry keys resolved to their names: each
    one a further test of the table's family (Holm adjusts over it too). One line naming a pair
    with a system that is not in the grid, a system against itself, a pair the table already
    tests (a system against the baseline) or one given twice."""
    pairs: List[Tuple[str, str]] = []
    for given in config.get("comparisons", []):
        system, against = (system_named(name, names, "comparisons", path) for name in given)
        if system == against:
            raise UsageError(f"{path}: comparisons compares {system!r} with itself")
        if baseline in (system, against):
            raise UsageError(f"{path}: comparisons pair {given} is already tested: every system is compared with "
                             f"the baseline {baseline!r}")
        if (system, against) in pairs or (against, system) in pairs:
            raise UsageError(f"{path}: comparisons gives the pair {given} twice")
        pairs.append((system, against))
    return pairs


def settings_from(experiment: Experiment, corpus: Corpus, max_update: Optional[int]) -> Settings:
    config, launcher = experiment.settings, experiment.launcher
    if "batch_size" in config:
        batching = Batching("--batch-size", int(config["batch_size"]), "sentences")
    else:
        batching = Batching("--max-tokens", int(config.get("max_tokens", TOKEN_BATCHES.size)), "tokens")
    return Settings(
        data_bin=corpus.data_bin, target=corpus.target, corpus_args=list(corpus.fairseq_args),
        postprocess=list(corpus.postprocess), detokenize=corpus.detokenize,
        max_update=int(max_update or config.get("max_update", 400)),
        beam=int(config.get("beam", 4)), batching=batching,
        model_args=[str(a) for a in config.get("model_args", MODEL)],
        train_args=[str(a) for a in config.get("train_args", [])],
        generate_args=[str(a) for a in config.get("generate_args", [])],
        average_last=int(config.get("average_last", 0)),
        save_interval_updates=int(config.get("save_interval_updates", 0)),
        lr=float(config.get("lr", 2e-3)),
        warmup_updates=int(config.get("warmup_updates", 0)),
        convergence=Convergence(**config["convergence"]) if "convergence" in config else None,
        data_parallel=DataParallel(launcher.tasks_per_run) if launcher and launcher.tasks_per_run > 1 else None,
    )
