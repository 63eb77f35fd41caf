"""The benchmark module runs end to end and measures what it says (tiny settings)."""
import json

from mlmha_fairseq.cli import benchmark

TINY = ["--sentences", "2", "--length", "6", "--gen-sentences", "1", "--steps", "1",
        "--vocab-size", "100", "--beam", "2"]


def test_benchmark_writes_ratios_against_fairseq_transformer(tmp_path):
    benchmark.main(["--configs", "slot_transformer,mlmha M-01", *TINY, "--output-dir", str(tmp_path)])
    results = {row["name"]: row for row in json.load(open(tmp_path / "benchmark.json"))["results"]}
    assert list(results) == ["transformer", "slot_transformer", "mlmha M-01"]
    assert results["slot_transformer"]["flop_ratio"] == 1.0  # it is fairseq's transformer
    assert results["slot_transformer"]["params"] == results["transformer"]["params"]
    assert results["mlmha M-01"]["flop_ratio"] > 1.0
    assert results["mlmha M-01"]["params"] > results["transformer"]["params"]
    for name in ("benchmark.csv", "benchmark.md", "benchmark.png"):
        assert (tmp_path / name).stat().st_size > 0
