"""Mutation score per source file from the results mutmut keeps in ``mutants/``.

Usage (after ``make mutation``): ``python scripts/mutation_scores.py [--mutants DIR]``; prints a
Markdown table: mutants, killed, survived, no tests, not checked, and the score
killed / (killed + survived + no tests) per file, then the totals.

Written by hand because mutmut 3.8 reports totals (``export-cicd-stats``) and survivors
(``results``) but not counts per file. It reads mutmut's per-file ``.meta`` JSON, whose
``exit_code_by_key`` holds the test run's exit status per mutant, which mutmut's own
``status_by_exit_code`` names: a mutant that a test failed on, timed out or crashed counts as
killed; "survived" and "no tests" (pytest's 5, or mutmut's 33 for a mutant that no test of the
selection executes) count against the score; anything else as not checked.
"""
import argparse
import glob
import json
import os
from collections import Counter

from mutmut.stats import status_by_exit_code

COLUMNS = ("mutants", "killed", "survived", "no tests", "not checked")
DETECTED = ("killed", "timeout", "segfault", "caught by type check")


def outcome(exit_code) -> str:
    status = status_by_exit_code[exit_code]
    if status in DETECTED:
        return "killed"
    return status if status in ("survived", "no tests") else "not checked"


def scores(mutants_dir: str) -> dict:
    """Per source file (path relative to the repository): a Counter over COLUMNS."""
    per_file = {}
    pattern = os.path.join(mutants_dir, "**", "*.py.meta")
    for meta in sorted(glob.glob(pattern, recursive=True)):
        with open(meta) as handle:
            codes = json.load(handle)["exit_code_by_key"]
        if not codes:
            continue
        counts = Counter(outcome(code) for code in codes.values())
        counts["mutants"] = len(codes)
        per_file[os.path.relpath(meta[: -len(".meta")], mutants_dir)] = counts
    return per_file


def score(counts: Counter) -> str:
    tested = counts["killed"] + counts["survived"] + counts["no tests"]
    return f"{100 * counts['killed'] / tested:.1f} %" if tested else "n/a"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python scripts/mutation_scores.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", default="mutants", help="mutmut's results folder (default: %(default)s)")
    args = parser.parse_args(argv)
    per_file = scores(args.mutants)
    if not per_file:
        parser.exit(1, f"no mutmut results under {args.mutants}/: run `make mutation` first\n")
    print("| file | " + " | ".join(COLUMNS) + " | score |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    total = Counter()
    for path, counts in per_file.items():
        total.update(counts)
        print(f"| `{path}` | " + " | ".join(str(counts[c]) for c in COLUMNS) + f" | {score(counts)} |")
    print("| total | " + " | ".join(str(total[c]) for c in COLUMNS) + f" | {score(total)} |")


if __name__ == "__main__":
    main()
