"""The speed tables of the docs cannot drift from the benchmark's output.

``python -m mlmha_fairseq.cli.benchmark --output-dir DIR`` writes ``DIR/benchmark.md``; the docs
copy its header and some of its rows. Every Markdown table of the repository whose header is a
benchmark header (its first cells "configuration | params") must have the header of one
committed ``benchmark.md`` and only rows of that same file, byte for byte.
"""
import subprocess
from pathlib import Path

import pytest

from test_results_page import tables

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = sorted((ROOT / "docs" / "benchmark").rglob("benchmark.md"))


def speed_tables():
    """(page, line number, table lines) of every benchmark-shaped table outside the outputs."""
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    found = []
    for name in listed:
        page = ROOT / name
        if page in OUTPUTS or not page.exists():
            continue
        for start, table in tables(page.read_text(encoding="utf-8").splitlines()):
            if table[0].startswith("| configuration | params |"):
                found.append((name, start + 1, table))
    return found


def test_the_pages_have_speed_tables():
    assert len(OUTPUTS) >= 2, "the committed benchmark outputs are gone"
    assert len(speed_tables()) >= 7, "the docs have lost their speed tables"


@pytest.mark.parametrize("page, line, table", speed_tables(),
                         ids=lambda value: value if isinstance(value, (str, int)) else "")
def test_every_speed_table_is_rows_of_one_benchmark_output(page, line, table):
    header, rows = table[:2], table[2:]
    sources = [path for path in OUTPUTS
               if path.read_text(encoding="utf-8").splitlines()[:2] == header]
    assert sources, f"{page}:{line}: its header is no committed benchmark.md's"
    for path in sources:
        lines = set(path.read_text(encoding="utf-8").splitlines())
        if all(row in lines for row in rows):
            return
    stale = [row for row in rows if not any(row in p.read_text(encoding="utf-8").splitlines()
                                            for p in sources)]
    pytest.fail(f"{page}:{line}: rows of no single benchmark output "
                f"(rerun the copy from {sources[0].relative_to(ROOT)}): {stale or rows}")
