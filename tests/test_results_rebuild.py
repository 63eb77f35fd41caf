"""RESULTS.md's tables rebuild from the run records in the repository, byte for byte.

Each grid whose runs are recorded under docs/experiment is rebuilt with the experiment runner's
``--report-only`` (it restores the records and trains nothing; the corpus is built, once per
corpus setting) in a temporary folder, and the runner's ``results.md`` and ``results-curves.md``
equal the committed files that RESULTS.md copies its tables from (tests/test_results_page.py
checks that copy). Minutes per grid: ``make results-check`` (and ``make exhaustive``), not CI.
The tables whose runs predate run records (RESULTS.md says which) are not in this list.
"""
import shlex
import shutil
from pathlib import Path

import pytest

from fairseq_helpers import reversal_corpus
from mlmha_fairseq.cli import experiment
from mlmha_fairseq.experiments.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "experiment"
OUTPUTS = ("results.md", "results-curves.md")

# the folder of each grid's committed outputs, by the config that `make results` rebuilds
COMMITTED = {
    "demo.toml": ".",
    "mechanisms.toml": "mechanisms",
    "mechanisms-dlcl.toml": "mechanisms/dlcl",
    "mechanisms-matched.toml": "mechanisms/matched",
    "convergence-mlrf-dc.toml": "convergence",
    "convergence-others.toml": "convergence/others/seeds1-3",
    "convergence-matched.toml": "convergence/matched",
    "convergence-de-en.toml": "convergence-de-en",
    "mlrf-fusion-weights.toml": "convergence/fusion-weights",
    "convergence-dc-document-lr.toml": "convergence-dc-document-lr",
    "convergence-mlrf-document-lr.toml": "convergence-mlrf-document-lr",
    "convergence-mlrf-document-lr-loss.toml": "convergence-mlrf-document-lr-loss/seed2",
    "convergence-mlrf-document-lr-fixed.toml": "convergence-mlrf-document-lr-fixed/seed2",
    "gpu-d128-dc.toml": "gpu-base/enc-dc/d128",
    "gpu-base-dc-10k.toml": "gpu-base/enc-dc/10k",
    "dc-shape-toy.toml": "dc-shape-toy",
    "de-en-400.toml": "de-en-400",
    "multi-source.toml": "multi-source",
}


def make_results_commands():
    """{config file name: the runner's arguments after it} of each command of `make results`,
    with the Makefile's ``--work-dir`` left out (each test gives its own)."""
    commands = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        if "--report-only" in line and "mlmha_fairseq.cli.experiment" in line and not line.startswith("#"):
            words = shlex.split(line)
            config = words[words.index("mlmha_fairseq.cli.experiment") + 1]
            arguments = words[words.index(config) + 1:]
            work_dir = arguments.index("--work-dir")
            commands[Path(config).name] = arguments[:work_dir] + arguments[work_dir + 2:]
    return commands


REBUILDS = make_results_commands()


def test_every_make_results_grid_is_checked():
    assert sorted(REBUILDS) == sorted(COMMITTED)
    assert all("--records" in arguments for arguments in REBUILDS.values())


@pytest.fixture(scope="module")
def rebuild_root(tmp_path_factory):
    """A folder to run the grids from (their relative corpus folders land there) and the corpora
    built so far: {repr(corpus settings): folder}."""
    return tmp_path_factory.mktemp("rebuild"), {}


def corpus_folder(config, work_dir: Path) -> Path:
    """Where the runner looks for the grid's corpus (experiments/corpora.py)."""
    corpus = config.corpus
    return Path(corpus["dir"]) if "dir" in corpus else work_dir / ("corpus-" + "-".join(corpus["sources"]))


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", sorted(REBUILDS))
def test_the_records_rebuild_the_committed_tables(config, rebuild_root, monkeypatch):
    root, corpora = rebuild_root
    monkeypatch.chdir(root)
    work = root / Path(config).stem
    loaded = load_config(str(EXAMPLES / config))
    key = repr(sorted((k, v) for k, v in loaded.corpus.items() if k != "dir"))
    folder = root / corpus_folder(loaded, work)
    if "raw" in loaded.corpus and not (root / loaded.corpus["raw"]).exists():  # the toy task, as `make results`
        reversal_corpus.main([str(root / loaded.corpus["raw"])])                # writes it first
    if key in corpora and not folder.exists():  # the same corpus, built for an earlier grid
        shutil.copytree(corpora[key], folder, symlinks=True)
    arguments = [str(ROOT / word) if word.startswith("docs/") else word for word in REBUILDS[config]]  # from root
    assert experiment.main([str(EXAMPLES / config), "--work-dir", str(work), *arguments]) == 0
    corpora.setdefault(key, folder)
    expected = ROOT / "docs/experiment" / COMMITTED[config]
    compared = [name for name in OUTPUTS if (expected / name).exists()]
    assert compared, f"no runner output committed in {expected}"
    for name in compared:
        assert (work / name).read_text(encoding="utf-8") == (expected / name).read_text(encoding="utf-8"), (
            f"{config}: {work / name} differs from {expected / name}")
