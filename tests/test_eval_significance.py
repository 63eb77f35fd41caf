import json

import numpy as np
import pytest
import sacrebleu
from compare_mt import scorers
from statsmodels.stats.multitest import multipletests

from fixtures.synthetic_systems import corrupt, references
from mlmha_fairseq.cli import significance as significance_cli
from mlmha_fairseq.evaluation.scoring import PROTOCOLS
from mlmha_fairseq.evaluation.significance import (
    METHODS,
    SignificanceOptions,
    compare_systems,
    significance_mark,
    thesis_bootstrap,
)
from mlmha_fairseq.evaluation.text_io import InputError

PROTOCOL = PROTOCOLS["multi-bleu"]
FAST = SignificanceOptions(n_samples=300, sample_size=100, ar_trials=300, seed=7)


@pytest.fixture(scope="module")
def systems():
    refs = references(count=150)
    baseline = corrupt(refs, 0.35, seed=1)
    return {
        "refs": refs,
        "baseline": baseline,
        "identical": list(baseline),
        "dominated": corrupt(refs, 0.7, seed=2),
        "better": corrupt(refs, 0.05, seed=3),
        # same quality, other sentences: baseline's sentence i or a fresh corruption at random
        "equal": [b if i % 2 else c for i, (b, c) in enumerate(zip(baseline, corrupt(refs, 0.35, seed=4)))],
    }


def run_all(systems, names):
    results, samples = compare_systems(systems["baseline"], [(n, systems[n]) for n in names],
                                       [systems["refs"]], PROTOCOL, METHODS, FAST)
    return {(r.method, r.system): r for r in results}, samples


def test_identical_system_is_not_significant(systems):
    results, _ = run_all(systems, ["identical"])
    for method in METHODS:
        result = results[(method, "identical")]
        assert result.delta == 0
        assert result.p_value >= 0.05, method
        assert result.mark == ""


def test_dominated_and_dominating_systems_are_significant(systems):
    results, _ = run_all(systems, ["dominated", "better"])
    for method in METHODS:
        assert results[(method, "dominated")].p_value < 0.01, method
        assert results[(method, "dominated")].mark == "‡"
        assert results[(method, "better")].p_value < 0.01, method


def test_equal_quality_system_is_not_significant(systems):
    results, _ = run_all(systems, ["equal"])
    for method in METHODS:
        assert results[(method, "equal")].p_value >= 0.05, method


def test_scores_equal_the_reference_implementations(systems):
    results, _ = run_all(systems, ["better"])

    def multi_bleu(hyps):
        return sacrebleu.corpus_bleu(hyps, [systems["refs"]], tokenize="none",
                                     smooth_method="none", force=True).score

    def compare_mt_bleu(hyps):
        # compare-mt's own BLEU: per-sentence n-gram denominators of at least 1
        return scorers.BleuScorer().score_corpus([r.split() for r in systems["refs"]],
                                                 [h.split() for h in hyps])[0]

    for method in METHODS:
        reference = compare_mt_bleu if method == "compare-mt" else multi_bleu
        assert results[(method, "better")].score == pytest.approx(reference(systems["better"]))
        assert results[(method, "better")].baseline_score == pytest.approx(reference(systems["baseline"]))


def test_thesis_bootstrap_matches_hand_resampling(systems):
    n_samples, sample_size, seed = 25, 40, 3
    result, samples = thesis_bootstrap(systems["baseline"], systems["equal"], [systems["refs"]],
                                       PROTOCOL, "equal", n_samples, sample_size, seed)
    indices = np.random.default_rng(seed).integers(0, len(systems["refs"]), size=(n_samples, sample_size))

    def bleu(hyps, idx):
        return sacrebleu.corpus_bleu([hyps[i] for i in idx], [[systems["refs"][i] for i in idx]],
                                     tokenize="none", smooth_method="none", force=True).score

    base = np.array([bleu(systems["baseline"], idx) for idx in indices])
    other = np.array([bleu(systems["equal"], idx) for idx in indices])
    np.testing.assert_allclose(samples.baseline, base)
    np.testing.assert_allclose(samples.system, other)
    better_wins = (other > base).sum() if result.score >= result.baseline_score else (base > other).sum()
    assert result.p_value == pytest.approx(1 - better_wins / n_samples)


def test_significance_marks():
    assert significance_mark(0.009) == "‡"
    assert significance_mark(0.01) == "†"
    assert significance_mark(0.049) == "†"
    assert significance_mark(0.05) == ""


def test_misaligned_systems_raise(systems):
    with pytest.raises(InputError, match="different numbers of lines"):
        compare_systems(systems["baseline"], [("short", systems["better"][:-1])],
                        [systems["refs"]], PROTOCOL, ["thesis"], FAST)


def test_significance_cli_writes_table_csv_json_png(tmp_path, capsys, systems):
    paths = []
    for name in ("baseline", "better", "identical"):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(systems[name]) + "\n", encoding="utf-8")
        paths.append(str(path))
    ref = tmp_path / "ref.txt"
    ref.write_text("\n".join(systems["refs"]) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "out" / "sig")
    significance_cli.main(paths + ["--names", "base", "good", "same", "--ref", str(ref),
                                   "--protocol", "multi-bleu", "--methods", "thesis", "sacrebleu-bs",
                                   "--n-samples", "200", "--sample-size", "100",
                                   "--output-prefix", prefix])
    table = capsys.readouterr().out
    good_row = next(line for line in table.splitlines() if line.startswith("| good"))
    same_row = next(line for line in table.splitlines() if line.startswith("| same"))
    assert "‡" in good_row and "‡" not in same_row and "†" not in same_row
    payload = json.loads((tmp_path / "out" / "sig.json").read_text(encoding="utf-8"))
    assert {(r["system"], r["method"]) for r in payload["results"]} == {
        ("good", "thesis"), ("same", "thesis"), ("good", "sacrebleu-bs"), ("same", "sacrebleu-bs")}
    # two systems: each method's p-values Holm-adjusted over them, the mark method's in the table
    assert table.splitlines()[0] == "| System | BLEU | Δ | p (thesis) | p (sacrebleu-bs) | p (Holm, thesis) |"
    for method in ("thesis", "sacrebleu-bs"):
        rows = [r for r in payload["results"] if r["method"] == method]
        expected = multipletests([r["p_value"] for r in rows], method="holm")[1]
        assert [r["p_holm"] for r in rows] == pytest.approx(list(expected))
        assert [r["mark"] for r in rows] == [significance_mark(p) for p in expected]
    holm_good = next(r["p_holm"] for r in payload["results"] if (r["system"], r["method"]) == ("good", "thesis"))
    assert good_row.rstrip(" |").endswith(f"{holm_good:.4f}")
    assert (tmp_path / "out" / "sig.csv").exists()
    assert (tmp_path / "out" / "sig.png").stat().st_size > 0


def test_significance_cli_needs_two_systems(tmp_path, capsys, systems):
    path = tmp_path / "only.txt"
    path.write_text("\n".join(systems["baseline"]) + "\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        significance_cli.main([str(path), "--ref", str(path)])
    assert exit_info.value.code == 2
    assert "at least one system" in capsys.readouterr().err
