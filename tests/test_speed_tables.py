"""The speed tables of the docs cannot drift from the benchmark's output.

``python -m mlmha_fairseq.cli.benchmark --output-dir DIR`` writes ``DIR/benchmark.md``; the docs
copy its header and some of its rows. Every Markdown table of the repository whose header is a
benchmark header (its first cells "configuration | params") must have the header of one
committed ``benchmark.md`` and only rows of that same file, byte for byte.
"""
from pathlib import Path

import pytest

from test_results_page import docs_tables, is_rows_of_one_output

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = {path: path.read_text(encoding="utf-8").splitlines()
           for path in sorted((ROOT / "docs" / "benchmark").rglob("benchmark.md"))}


def speed_tables():
    """(page, line number, table lines) of every benchmark-shaped table outside the outputs."""
    return [(str(page.relative_to(ROOT)), line, table) for page, line, table, _ in docs_tables()
            if page not in OUTPUTS and table[0].startswith("| configuration | params |")]


SPEED_TABLES = speed_tables()


def test_the_pages_have_speed_tables():
    assert len(OUTPUTS) >= 2, "the committed benchmark outputs are gone"
    assert len(SPEED_TABLES) >= 7, "the docs have lost their speed tables"


@pytest.mark.parametrize("page, line, table", SPEED_TABLES,
                         ids=lambda value: value if isinstance(value, (str, int)) else "")
def test_every_speed_table_is_rows_of_one_benchmark_output(page, line, table):
    assert any(lines[:2] == table[:2] for lines in OUTPUTS.values()), (
        f"{page}:{line}: its header is no committed benchmark.md's")
    assert is_rows_of_one_output(table, OUTPUTS.values()), (
        f"{page}:{line}: rows of no single benchmark output (copy them again from docs/benchmark): "
        f"{sorted(row for row in table[2:] if not any(row in lines for lines in OUTPUTS.values()))}")
