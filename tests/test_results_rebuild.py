"""RESULTS.md's tables rebuild from the run records in the repository, byte for byte.

Each grid whose runs are recorded under docs/experiment is rebuilt with the experiment runner's
``--report-only`` (it restores the records and trains nothing; the corpus is built, once per
corpus setting) in a temporary folder, and the runner's ``results.md`` and ``results-curves.md``
equal the committed files that RESULTS.md copies its tables from (tests/test_results_page.py
checks that copy). Minutes per grid: ``make results-check`` (and ``make exhaustive``), not CI.
The tables whose runs predate run records (RESULTS.md says which) are not in this list.
"""
import shutil
from pathlib import Path

import pytest

from mlmha_fairseq.cli import experiment
from mlmha_fairseq.experiments.config import load_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "experiment"
OUTPUTS = ("results.md", "results-curves.md")

# (config, --seeds or None, records folder, folder of the committed outputs): Makefile's `results`
REBUILDS = [
    ("mechanisms-dlcl.toml", None, "mechanisms/runs", "mechanisms/dlcl"),
    ("convergence-mlrf-dc.toml", "3-3", "convergence/runs", "convergence/seed3"),
    ("convergence-others.toml", "1-3", "convergence/runs", "convergence/others/seeds1-3"),
    ("convergence-dc-document-lr.toml", "2-3", "convergence-dc-document-lr/runs", "convergence-dc-document-lr"),
    ("convergence-mlrf-document-lr.toml", "2-3", "convergence-mlrf-document-lr/runs",
     "convergence-mlrf-document-lr/seeds2-3"),
    ("convergence-mlrf-document-lr-loss.toml", "2-2", "convergence-mlrf-document-lr-loss/runs",
     "convergence-mlrf-document-lr-loss/seed2"),
    ("convergence-mlrf-document-lr-fixed.toml", "2-2", "convergence-mlrf-document-lr-fixed/runs",
     "convergence-mlrf-document-lr-fixed/seed2"),
    ("gpu-d128-dc.toml", None, "gpu-base/enc-dc/d128/runs", "gpu-base/enc-dc/d128"),
    ("gpu-base-dc-10k.toml", None, "gpu-base/enc-dc/10k/runs", "gpu-base/enc-dc/10k"),
]


def test_every_make_results_grid_is_checked():
    makefile = (ROOT / "Makefile").read_text()
    rebuilt = [line.split("examples/experiment/")[1].split()[0] for line in makefile.splitlines()
               if "--report-only" in line and "examples/experiment/" in line]
    assert sorted(rebuilt) == sorted(config for config, *_ in REBUILDS)


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
@pytest.mark.parametrize("config, seeds, records, committed", REBUILDS, ids=[row[0] for row in REBUILDS])
def test_the_records_rebuild_the_committed_tables(config, seeds, records, committed, rebuild_root, monkeypatch):
    root, corpora = rebuild_root
    monkeypatch.chdir(root)
    work = root / Path(config).stem
    loaded = load_config(str(EXAMPLES / config))
    key = repr(sorted((k, v) for k, v in loaded.corpus.items() if k != "dir"))
    folder = root / corpus_folder(loaded, work)
    if key in corpora and not folder.exists():  # the same corpus, built for an earlier grid
        shutil.copytree(corpora[key], folder, symlinks=True)
    arguments = [str(EXAMPLES / config), "--work-dir", str(work), "--records", str(ROOT / "docs/experiment" / records),
                 "--report-only"] + (["--seeds", seeds] if seeds else [])
    assert experiment.main(arguments) == 0
    corpora.setdefault(key, folder)
    expected = ROOT / "docs/experiment" / committed
    compared = [name for name in OUTPUTS if (expected / name).exists()]
    assert compared, f"no runner output committed in {expected}"
    for name in compared:
        assert (work / name).read_text(encoding="utf-8") == (expected / name).read_text(encoding="utf-8"), (
            f"{config}: {work / name} differs from {expected / name}")
