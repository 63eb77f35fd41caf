"""The main job end to end, on a tiny hand-made Bible database instead of the real one."""
import json

import pytest

from mlmha_fairseq.cli import build_corpus, demo
from fixtures.tiny_bible import BPE_MERGES, TEST_BOOKS, VALID_BOOKS, make_bible_db


def test_demo_trains_decodes_scores_and_tests_significance(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    assert build_corpus.main([
        "--bible-db", make_bible_db(tmp_path / "bible.db"), "--sources", "fr", "--target", "k",
        "--out-dir", str(corpus), "--test-books", *TEST_BOOKS, "--valid-books", *VALID_BOOKS,
        "--bpe-merges", str(BPE_MERGES), "--quiet",
    ]) == 0
    demo.main(["--work-dir", str(tmp_path / "work"), "--corpus-dir", str(corpus),
               "--max-update", "2", "--beam", "1"])
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    systems = [system.name for system in demo.SYSTEMS if not system.full_only]
    assert list(results["bleu"]) == systems
    assert {row["system"] for row in results["significance"]} == set(systems[1:])
    assert results["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    printed = capsys.readouterr().out
    assert "| system | BLEU |" in printed and "Example translations" in printed


def test_unknown_system_is_refused():
    with pytest.raises(SystemExit, match="unknown system"):
        demo.chosen_systems(demo.parse_args(["--systems", "No Such System"]))
