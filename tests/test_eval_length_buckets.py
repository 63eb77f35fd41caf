import csv
import math

import pytest
import sacrebleu

from fixtures.synthetic_systems import corrupt, references
from mlmha_fairseq.cli import length_buckets as length_buckets_cli
from mlmha_fairseq.evaluation.length_buckets import (
    assign_buckets,
    bleu_by_length,
    make_buckets,
    source_lengths,
)
from mlmha_fairseq.evaluation.scoring import PROTOCOLS
from mlmha_fairseq.evaluation.text_io import InputError


def test_left_closed_boundaries():
    buckets = make_buckets([10, 20], "left")
    assert [b.label for b in buckets] == ["[0,10)", "[10,20)", "[20,inf)"]
    assert assign_buckets([0, 9, 10, 19, 20, 500], buckets) == [0, 0, 1, 1, 2, 2]


def test_right_closed_boundaries():
    buckets = make_buckets([10, 20], "right")
    assert [b.label for b in buckets] == ["[0,10]", "(10,20]", "(20,inf)"]
    assert assign_buckets([0, 1, 10, 11, 20, 21], buckets) == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("edges", [[], [10, 10], [20, 10], [0, 10]])
def test_bad_edges(edges):
    with pytest.raises(InputError):
        make_buckets(edges)


def test_subword_and_word_lengths():
    sources = ["un@@ believ@@ able story", "a b c", ""]
    assert source_lengths(sources, "subword") == [4, 3, 0]
    assert source_lengths(sources, "word") == [2, 3, 0]


def test_counts_sum_and_bucket_bleu_equals_sacrebleu():
    refs = references(count=200)
    sources = corrupt(refs, 0.5, seed=9)
    system = corrupt(refs, 0.3, seed=1)
    lengths = source_lengths(sources, "word")
    buckets = make_buckets([5, 10, 15, 20])
    rows = bleu_by_length(lengths, [refs], [("sys", system)], PROTOCOLS["sacrebleu"], buckets)
    assert sum(row["count"] for row in rows) == len(refs)
    for bucket, row in zip(buckets, rows):
        chosen = [i for i, n in enumerate(lengths) if bucket.contains(n)]
        assert row["count"] == len(chosen)
        if chosen:
            expected = sacrebleu.corpus_bleu([system[i] for i in chosen], [[refs[i] for i in chosen]])
            assert row["sys"] == pytest.approx(expected.score)


def test_empty_bucket_is_nan():
    rows = bleu_by_length([1, 2], [["a b", "c d"]], [("s", ["a b", "c d"])],
                          PROTOCOLS["sacrebleu"], make_buckets([10, 20]))
    assert [r["count"] for r in rows] == [2, 0, 0]
    assert math.isnan(rows[1]["s"])


def test_misaligned_source_raises():
    with pytest.raises(InputError, match="different numbers of lines"):
        bleu_by_length([1, 2, 3], [["a", "b"]], [("s", ["a", "b"])], PROTOCOLS["sacrebleu"],
                       make_buckets([10]))


def test_cli_writes_csv_json_png(tmp_path, capsys):
    refs = references(count=60)
    files = {}
    for name, lines in {"src": corrupt(refs, 0.5, 2), "ref": refs, "a": corrupt(refs, 0.3, 3),
                        "b": corrupt(refs, 0.1, 4)}.items():
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = tmp_path / "len"
    length_buckets_cli.main([str(files["a"]), str(files["b"]), "--names", "A", "B",
                             "--source", str(files["src"]), "--ref", str(files["ref"]),
                             "--unit", "word", "--edges", "10", "20", "--closed", "right",
                             "--output-prefix", str(prefix)])
    with open(f"{prefix}.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["bucket"] for r in rows] == ["[0,10]", "(10,20]", "(20,inf)"]
    assert sum(int(r["count"]) for r in rows) == len(refs)
    assert (tmp_path / "len.json").exists() and (tmp_path / "len.png").stat().st_size > 0
    assert "bucket\tcount\tA\tB" in capsys.readouterr().out
