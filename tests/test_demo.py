"""The main job end to end, on a tiny hand-made Bible database instead of the real one."""
import json

import pytest

from mlmha_fairseq.cli import build_corpus, demo
from fixtures.tiny_bible import BPE_MERGES, TEST_BOOKS, VALID_BOOKS, make_bible_db


def tiny_corpus(tmp_path, *sources):
    """A corpus of the tiny Bible (en is its version k, as the real corpus's en side)."""
    corpus = tmp_path / "corpus-{}".format("-".join(sources))
    database = tmp_path / "bible.db"
    if not database.exists():
        make_bible_db(database)
    assert build_corpus.main([
        "--bible-db", str(database), "--sources", *sources, "--target", "k",
        "--out-dir", str(corpus), "--test-books", *TEST_BOOKS, "--valid-books", *VALID_BOOKS,
        "--bpe-merges", str(BPE_MERGES), "--quiet",
    ]) == 0
    return str(corpus)


def test_demo_trains_decodes_scores_and_tests_significance(tmp_path, capsys):
    demo.main(["--work-dir", str(tmp_path / "work"), "--corpus-dir", tiny_corpus(tmp_path, "fr"),
               "--max-update", "2", "--beam", "1", "--max-len", "20"])
    stage = json.loads((tmp_path / "work" / "results.json").read_text())["stages"]["fr->en"]
    systems = [system.name for system in demo.SYSTEMS if not system.full_only]
    assert list(stage["bleu"]) == systems
    assert {row["system"] for row in stage["significance"]} == set(systems[1:])
    assert stage["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    printed = capsys.readouterr().out
    assert "| system | BLEU |" in printed and "Example translations" in printed
    decodes = [line for line in (tmp_path / "work" / "commands.log").read_text().splitlines() if "generate" in line]
    assert decodes and all(" --max-len-a 0 --max-len-b 20 " in line for line in decodes)


def test_multi_source_table_with_every_source_deranged_in_turn(tmp_path):
    """The baseline and one strategy (the strategies' round trips: tests/test_multi_source.py)."""
    demo.main(["--multi-source-only", "--work-dir", str(tmp_path / "work"), "--multi-source-langs", "es,fr",
               "--multi-source-corpus-dir", tiny_corpus(tmp_path, "es", "fr"),
               "--max-update", "2", "--beam", "1", "--max-len", "20", "--systems", "fr only,es+fr flat"])
    stages = json.loads((tmp_path / "work" / "results.json").read_text())["stages"]
    assert list(stages) == ["es+fr->en"]
    multi = stages["es+fr->en"]
    strategies = ["es+fr flat"]
    assert list(multi["bleu"]) == ["fr only"] + strategies
    assert list(multi["adversarial_bleu"]["fr"]) == ["fr only"] + strategies
    assert list(multi["adversarial_bleu"]["es"]) == strategies  # the baseline does not read es
    table = (tmp_path / "work" / "results.md").read_text()
    assert "BLEU, es deranged | BLEU, fr deranged |" in table
    assert "2 updates of 96 sentences each" in table  # the same sentences per update for every system
    assert table.count("—") == 1


def test_multi_source_table_needs_the_baseline_source(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--multi-source-only", "--multi-source-langs", "es,de"])
    assert exit_info.value.code == 2
    assert "--multi-source-langs must include fr" in capsys.readouterr().err


def test_unknown_system_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--systems", "No Such System"])
    assert exit_info.value.code == 2
    assert "unknown system(s) ['No Such System']" in capsys.readouterr().err


def test_systems_pick_from_either_table():
    args = demo.parse_args(["--full", "--systems", "MMA,fr only,es+fr+de flat"])
    assert [s.name for s in demo.chosen_systems(args, demo.SYSTEMS)] == [demo.BASELINE, "MMA"]
    multi = demo.multi_source_systems(demo.MULTI_SOURCE_LANGS)
    assert [s.name for s in demo.chosen_systems(args, multi)] == ["fr only", "es+fr+de flat"]
    args = demo.parse_args(["--full", "--systems", "MMA"])  # names none of the second table: all of it
    assert demo.chosen_systems(args, multi) == multi
