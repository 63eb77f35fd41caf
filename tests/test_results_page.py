"""RESULTS.md cannot drift from the runner's output files.

Every Markdown table of RESULTS.md sits under a line ``Source: [FILE](FILE)`` (a runner output
file: ``results.md``, ``results-curves.md``) or ``Derived: ...`` (computed from such files by a
command given there). Each table under a ``Source:`` line must equal, line for line and byte for
byte, one of the tables of FILE; a table under neither is refused, so a table cannot be added by
hand without saying where it comes from. Elsewhere in the docs, a table with the header of a
runner output's table must be rows of that output, and a table that merges several outputs sits
under a line ``Sources: [FILE](LINK), ...`` (FILE the repository path, LINK relative to the
page): every cell of a row must be a cell of the same system's row (the first cell) in one of
those files. Any other table of systems (its first header cell "system", as the runner writes it;
the papers' tables say "System" or "Model") sits under a ``Derived:`` line that gives the command
printing it. A table of validation BLEU read from curve reports sits under a ``Derived:``
paragraph that links its results-curves.json (columns: updates, and "test BLEU" from a linked
results.json) or says "at update N" (rows: each linking its own results-curves.json); every cell
must be the report's value.
"""
import functools
import itertools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "RESULTS.md"
SOURCE = re.compile(r"^Source: \[([^\]]+)\]\(([^)]+)\)\s*$")
SOURCES = re.compile(r"^Sources: (\[([^\]]+)\]\(([^)]+)\)(, |\s*$))+")
LINK = re.compile(r"\[([^\]]+)\]\(([^)]+)\)")


def tables(lines):
    """The Markdown tables of ``lines`` (maximal runs of lines starting with '|'), each as
    (index of its first line, its lines)."""
    found, current, start = [], [], 0
    for index, line in enumerate(lines + [""]):
        if line.startswith("|"):
            if not current:
                start = index
            current.append(line)
        elif current:
            found.append((start, current))
            current = []
    return found


def provenance(lines, start):
    """What the table starting at ``start`` is under: ('source', path), ('sources', [(link
    text, target), ...]), ('derived', the Derived paragraph) or None, from the nearest ``Source:``/
    ``Sources:``/``Derived:`` line above it that no heading separates."""
    for index in range(start - 1, -1, -1):
        line = lines[index]
        if line.startswith("#"):
            return None
        match = SOURCE.match(line)
        if match:
            assert match.group(1) == match.group(2), f"Source link text and target differ: {line!r}"
            return "source", match.group(2)
        if SOURCES.match(line):
            return "sources", LINK.findall(line)
        if line.startswith("Derived:"):
            paragraph = itertools.takewhile(lambda text: text and not text.startswith("|"), lines[index:])
            return "derived", " ".join(paragraph)
    return None


def page_tables():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    return [(start, table, provenance(lines, start)) for start, table in tables(lines)]


def test_every_table_of_the_results_page_says_where_it_comes_from():
    found = page_tables()
    assert len(found) >= 15, "RESULTS.md has lost its tables"
    unsourced = [start + 1 for start, _, origin in found if origin is None]
    assert not unsourced, f"tables of RESULTS.md under no Source:/Derived: line, at lines {unsourced}"


def test_every_sourced_table_equals_a_table_of_its_runner_output_file():
    drifted = []
    for start, table, origin in page_tables():
        if origin is None or origin[0] != "source":
            continue
        source = ROOT / origin[1]
        assert source.is_file(), f"RESULTS.md line {start + 1}: source {origin[1]} does not exist"
        candidates = [lines for _, lines in tables(source.read_text(encoding="utf-8").splitlines())]
        if table not in candidates:
            drifted.append(f"line {start + 1}: not a table of {origin[1]}")
    assert not drifted, "RESULTS.md differs from the runner's output:\n" + "\n".join(drifted)


def test_every_runner_table_of_the_documented_grids_is_on_the_page():
    sourced = {origin[1] for _, _, origin in page_tables() if origin and origin[0] == "source"}
    expected = {
        "docs/experiment/results.md",
        "docs/experiment/mechanisms/results.md",
        "docs/experiment/mechanisms/dlcl/results.md",
        "docs/experiment/convergence/results.md",
        "docs/experiment/convergence/others/seeds1-3/results.md",
        "docs/experiment/convergence-de-en/results.md",
        "docs/experiment/convergence-dc-document-lr/results.md",
        "docs/experiment/convergence-mlrf-document-lr/results.md",
        "docs/experiment/convergence-mlrf-document-lr-loss/seed2/results.md",
        "docs/experiment/convergence-mlrf-document-lr-fixed/seed2/results.md",
        "docs/experiment/gpu-base/results.md",
    }
    assert expected <= sourced, f"missing from RESULTS.md: {sorted(expected - sourced)}"


def test_the_table_reader_finds_tables_and_their_source():
    lines = ["# t", "Source: [a/results.md](a/results.md)", "", "| x |", "|---|", "| 1 |", "",
             "## u", "| y |", "Derived: by hand", "| z |"]
    assert tables(lines) == [(3, ["| x |", "|---|", "| 1 |"]), (8, ["| y |"]), (10, ["| z |"])]
    assert provenance(lines, 3) == ("source", "a/results.md")
    assert provenance(lines, 8) is None
    assert provenance(lines, 10) == ("derived", "Derived: by hand")
    merged = ["Sources: [a/r.md](../a/r.md), [b/r.md](b/r.md)", "", "| x |"]
    assert provenance(merged, 2) == ("sources", [("a/r.md", "../a/r.md"), ("b/r.md", "b/r.md")])


def is_rows_of_one_output(table, outputs):
    """Whether ``table`` has the header (first two lines) of a table of one of ``outputs`` (each
    the lines of an output file) and, besides it, only lines of that same output."""
    return any(table[:2] == lines[start:start + 2] and set(table[2:]) <= set(lines)
               for lines in outputs for start, _ in tables(lines))


@functools.lru_cache(maxsize=None)
def runner_outputs():
    """{path: lines} of every committed runner output file (``results.md``, ``results-curves.md``)."""
    return {path: path.read_text(encoding="utf-8").splitlines()
            for path in (ROOT / "docs").rglob("results*.md")}


@functools.lru_cache(maxsize=None)
def docs_tables():
    """(page, line number, table lines, provenance) of every table of the Markdown pages other
    than the runner's output files (RESULTS.md included), each page read once."""
    from test_docs_links import markdown_files

    found = []
    for page in markdown_files():
        if page in runner_outputs():
            continue
        lines = page.read_text(encoding="utf-8").splitlines()
        found += [(page, start + 1, table, provenance(lines, start)) for start, table in tables(lines)]
    return found


def copied_runner_tables():
    """(page, line number, table lines) of every table outside RESULTS.md and the runner's output
    files whose header is the header of a table of a committed runner output file."""
    headers = {tuple(table[:2]) for lines in runner_outputs().values() for _, table in tables(lines)}
    return [(str(page.relative_to(ROOT)), line, table) for page, line, table, _ in docs_tables()
            if page != PAGE and tuple(table[:2]) in headers]


def test_every_copy_of_a_runner_table_in_the_docs_is_rows_of_one_output():
    """The example pages and docs quote the runner's tables; a copied table keeps the runner's
    header and may drop rows, but each row must be byte for byte a row of one output file (the
    one that has its header), so it cannot drift when a grid is rebuilt."""
    found = copied_runner_tables()
    assert len(found) >= 9, "the docs have lost their copies of the runner's tables"
    drifted = [f"{page}:{line}" for page, line, table in found
               if not is_rows_of_one_output(table, runner_outputs().values())]
    assert not drifted, ("tables with a runner header but rows of no single output file "
                         f"(copy them again from the output): {drifted}")


def cells(row):
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def merged_table_faults(table, sources):
    """The cells of ``table`` (below its header) that are no cell of their system's row in any
    of ``sources`` (each the lines of an output file), as 'system: cell'."""
    known = {}
    for lines in sources:
        for _, output in tables(lines):
            for row in output[2:]:
                system, *rest = cells(row)
                known.setdefault(system, set()).update(rest)
    return [f"{system}: {cell!r}" for system, *rest in map(cells, table[2:])
            for cell in rest if cell and cell not in known.get(system, ())]


def merged_tables():
    """(page, line number, table, [source files]) of every table under a ``Sources:`` line."""
    found = []
    for page, line, table, origin in docs_tables():
        if origin and origin[0] == "sources":
            sources = [(page.parent / target).resolve() for _, target in origin[1]]
            named = [text for text, _ in origin[1]]
            assert named == [str(path.relative_to(ROOT)) for path in sources], (
                f"{page.relative_to(ROOT)}:{line}: a Sources link's text is not the "
                f"repository path of its target: {named}")
            found.append((page, line, table, sources))
    return found


def test_every_cell_of_a_merged_table_is_a_cell_of_its_system_in_its_sources():
    found = merged_tables()
    assert len(found) >= 8, "the docs have lost their merged tables"
    faults = []
    for page, line, table, sources in found:
        missing = [str(path) for path in sources if not path.is_file()]
        assert not missing, f"{page.relative_to(ROOT)}:{line}: Sources do not exist: {missing}"
        faults += [f"{page.relative_to(ROOT)}:{line}: {fault}" for fault in merged_table_faults(
            table, [path.read_text(encoding="utf-8").splitlines() for path in sources])]
    assert not faults, ("cells of merged tables not in their sources (copy them again):\n"
                        + "\n".join(faults))


def test_the_merged_table_check_finds_a_changed_cell():
    output = ["| system | BLEU | Δ |", "|---|---|---|", "| A | 1.00 | |", "| B | 2.00‡ | +1.00 |"]
    good = ["| system | converged | Δ |", "|---|---|---|", "| A | 1.00 | |", "| B | 2.00‡ | +1.00 |"]
    assert merged_table_faults(good, [output]) == []
    assert merged_table_faults(good[:3] + ["| B | 2.00 | +1.00 |"], [output]) == ["B: '2.00'"]
    assert merged_table_faults(good[:2] + ["| A | 2.00‡ | |"], [output]) == ["A: '2.00‡'"]


def test_every_table_of_systems_in_the_docs_says_where_it_comes_from():
    copied = {(page, line) for page, line, _ in copied_runner_tables()}
    pages = {page for page, _, _, _ in docs_tables()} - {PAGE}
    unsourced = [f"{page.relative_to(ROOT)}:{line}" for page, line, table, origin in docs_tables()
                 if page != PAGE and cells(table[0])[0] == "system" and origin is None
                 and (str(page.relative_to(ROOT)), line) not in copied]
    assert len(pages) >= 30, "the Markdown pages are gone"
    assert not unsourced, ("tables of systems under no Sources:/Derived: line and copying no "
                           f"runner output: {unsourced}")


AT_UPDATE = re.compile(r"at update ([\d,]+)")
NOTE_COLUMNS = {"GPU"}


def update_number(text):
    return float(text.replace(",", ""))


def seed_values(report, system, key, update):
    """``key`` ('bleu' or 'loss') of each seed of ``system`` at ``update``, in seed order."""
    runs = report["curves"][system]
    return [dict(runs[seed][key])[update] for seed in sorted(runs, key=int)]


def update_columns_faults(table, report, test_bleu):
    """Faults of a table of validation BLEU by update (header ``| update | 1,000 | ... |``, one
    row per system, each cell the seeds' BLEU as 'seed 1 / seed 2 / ...') against ``report``
    (a results-curves.json); a column 'test BLEU' is checked against ``test_bleu`` ({system:
    [BLEU per seed]}, from results.json)."""
    header = cells(table[0])
    assert header[0] == "update", f"a curve table by update starts with 'update': {table[0]!r}"
    faults = []
    for system, *row in map(cells, table[2:]):
        for column, cell in zip(header[1:], row):
            try:
                values = (test_bleu[system] if column == "test BLEU"
                          else seed_values(report, system, "bleu", update_number(column)))
                expected = " / ".join(f"{value:.2f}" for value in values)
            except (KeyError, ValueError):
                expected = "no such system, update or column in the reports"
            if cell != expected:
                faults.append(f"{system}, {column}: {cell!r}, the reports say {expected!r}")
    return faults


def row_reports_faults(table, update, read_report):
    """Faults of a table with one row per results-curves.json (linked in the row's first cell;
    ``read_report(target)`` reads it), at one ``update``: a system's column holds
    'BLEU (loss)', a column 'A − B' the difference of A's and B's BLEU (one seed each)."""
    header = cells(table[0])
    faults = []
    for first, *row in map(cells, table[2:]):
        link = LINK.search(first)
        if not link:
            faults.append(f"{first!r}: no link to its results-curves.json")
            continue
        report, bleu = read_report(link.group(2)), {}
        for name, cell in zip(header[1:], row):
            if name in report["curves"]:
                (bleu[name],), (loss,) = (seed_values(report, name, key, update) for key in ("bleu", "loss"))
                expected = f"{bleu[name]:.2f} ({loss:.3f})"
            elif " − " in name and set(name.split(" − ")) <= set(bleu):
                minuend, subtrahend = name.split(" − ")
                expected = f"{bleu[minuend] - bleu[subtrahend]:+.2f}".replace("-", "−")
            elif name in NOTE_COLUMNS:
                continue
            else:
                expected = "a column of a system of the report (or 'A − B' of two)"
            if cell != expected:
                faults.append(f"{first!r}, {name}: {cell!r}, the report says {expected!r}")
    return faults


def curve_tables():
    """(page, line number, table, Derived paragraph) of every table under a ``Derived:``
    paragraph that names results-curves.json."""
    return [(page, line, table, origin[1]) for page, line, table, origin in docs_tables()
            if origin and origin[0] == "derived" and "results-curves.json" in origin[1]]


def test_every_table_of_validation_bleu_is_the_curve_reports():
    """Tables of validation BLEU at chosen updates are read from the runner's results-curves.json
    by hand; each cell must be the report's value, formatted as the runner formats it."""
    found = curve_tables()
    assert len(found) >= 5, "the docs have lost their tables of validation BLEU"
    faults = []
    for page, line, table, derived in found:
        where = f"{page.relative_to(ROOT)}:{line}"

        def read_report(target, page=page):
            return json.loads((page.parent / target).read_text(encoding="utf-8"))

        reports = {Path(target).name: read_report(target)
                   for _, target in LINK.findall(derived) if target.endswith(".json")}
        if "results-curves.json" in reports:
            test_bleu = {system["name"]: system["scores"]["BLEU"]
                         for system in reports.get("results.json", {}).get("systems", [])}
            faults += [f"{where}: {fault}" for fault in update_columns_faults(
                table, reports["results-curves.json"], test_bleu)]
        else:
            update = AT_UPDATE.search(derived)
            assert update, f"{where}: the Derived line names neither a report nor 'at update N'"
            faults += [f"{where}: {fault}" for fault in row_reports_faults(
                table, update_number(update.group(1)), read_report)]
    assert not faults, "validation BLEU that is not its curve report's:\n" + "\n".join(faults)


def test_the_curve_table_checks_find_a_changed_cell():
    report = {"curves": {"A": {"1": {"bleu": [[200.0, 1.5]], "loss": [[200.0, 7.25]]},
                               "2": {"bleu": [[200.0, 2.0]], "loss": [[200.0, 7.0]]}},
                         "B": {"1": {"bleu": [[200.0, 3.25]], "loss": [[200.0, 6.5]]}}}}
    by_update = ["| update | 200 | test BLEU |", "|---|---|---|", "| A | 1.50 / 2.00 | 3.00 / 4.00 |"]
    assert update_columns_faults(by_update, report, {"A": [3.0, 4.0]}) == []
    for wrong in ("| A | 2.00 / 1.50 | 3.00 / 4.00 |", "| A | 1.50 / 2.00 | 3.00 / 4.01 |"):
        assert update_columns_faults(by_update[:2] + [wrong], report, {"A": [3.0, 4.0]}) != []
    assert update_columns_faults(by_update, report, {}) != []
    one_seed = {"curves": {name: {"1": runs["1"]} for name, runs in report["curves"].items()}}
    by_row = ["| change | GPU | A | B | B − A |", "|---|---|---|---|---|",
              "| [x](r.json) | H200 | 1.50 (7.250) | 3.25 (6.500) | +1.75 |"]
    assert row_reports_faults(by_row, 200.0, lambda target: one_seed) == []
    for wrong in ("1.50 (7.25)", "1.75 (7.250)"):
        changed = by_row[:2] + [by_row[2].replace("1.50 (7.250)", wrong)]
        assert row_reports_faults(changed, 200.0, lambda target: one_seed) != []
    assert row_reports_faults(by_row[:2] + [by_row[2].replace("+1.75", "−1.75")], 200.0,
                              lambda target: one_seed) != []
    assert row_reports_faults([by_row[0].replace("| B |", "| C |")] + by_row[1:], 200.0,
                              lambda target: one_seed) != []
