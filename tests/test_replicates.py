"""MultEval-style statistics over optimizer replicates (Clark et al. 2011) against hand
computations and direct implementations, and the tables they are written to."""
import json
import math

import numpy as np
import pytest
import sacrebleu

from mlmha_fairseq.evaluation import replicates
from mlmha_fairseq.evaluation.meteor import load_wordnet
from mlmha_fairseq.evaluation.scoring import resolve_protocol

REFERENCES = [f"the {w} of the house went to the city of the king number {i}"
              for i, w in enumerate("lord people father son king land city house word day light water".split())]


def degrade(lines, seed, drop):
    """Each sentence with about ``drop`` of its words removed (fixed by ``seed``)."""
    rng = np.random.default_rng(seed)
    return [" ".join(word for word in line.split() if rng.random() > drop) or "the" for line in lines]


BASELINE = {1: degrade(REFERENCES, 1, 0.45), 2: degrade(REFERENCES, 2, 0.45)}
SYSTEM = {1: degrade(REFERENCES, 3, 0.15), 2: degrade(REFERENCES, 4, 0.25)}


def test_mean_sd_and_s_sel_equal_a_hand_computation():
    mean, sd = replicates.mean_sd([1.0, 2.0, 4.0])
    assert mean == pytest.approx(7 / 3)
    assert sd == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert replicates.mean_sd([3.0]) == (3.0, None)  # one seed: no spread
    assert replicates.s_sel([0.5, 1.0, 1.5]) == pytest.approx(1.0)


def test_bootstrap_sd_equals_a_direct_bootstrap_with_sacrebleu_scores():
    hyps, samples, seed = SYSTEM[1], 40, 7
    # sacreBLEU's resampler draws all indices at once from numpy's default_rng(seed)
    indices = np.random.default_rng(seed).choice(len(hyps), size=(samples, len(hyps)), replace=True)
    scores = [sacrebleu.corpus_bleu([hyps[i] for i in row], [[REFERENCES[i] for i in row]]).score
              for row in indices]
    expected = np.std(scores, ddof=1)
    assert replicates.bootstrap_sd(hyps, [REFERENCES], resolve_protocol("sacrebleu"), samples, seed) == \
        pytest.approx(expected, abs=1e-3)


def test_report_rows_equal_hand_computed_mean_sd_and_s_sel():
    options = replicates.ReplicateOptions(bootstrap_samples=30, ar_trials=50, seed=3)
    report = replicates.build_report([("base", BASELINE), ("new", SYSTEM)], [REFERENCES], options,
                                     wordnet=load_wordnet())
    base, new = report.rows
    bleu = [sacrebleu.corpus_bleu(SYSTEM[s], [REFERENCES]).score for s in (1, 2)]
    chrf = [sacrebleu.corpus_chrf(SYSTEM[s], [REFERENCES]).score for s in (1, 2)]
    assert new.scores["BLEU"] == pytest.approx(bleu)
    assert new.scores["chrF"] == pytest.approx(chrf)
    assert new.summary("BLEU") == pytest.approx(((bleu[0] + bleu[1]) / 2, abs(bleu[0] - bleu[1]) / math.sqrt(2)))
    deviations = [replicates.bootstrap_sd(SYSTEM[s], [REFERENCES], resolve_protocol("sacrebleu"), 30, 3)
                  for s in (1, 2)]
    assert new.s_sel == pytest.approx(sum(deviations) / 2)
    assert base.ar_p_value is None and new.ar_seeds == [1, 2]
    assert set(new.bootstrap_p_values) == {1, 2}
    assert new.summary("BLEU")[0] > base.summary("BLEU")[0]


def test_delta_compares_the_seeds_both_have():
    """A system with one seed of the baseline's two (a partial grid) is compared with that
    seed of the baseline, as its AR test is; without a shared seed there is no Δ."""
    options = replicates.ReplicateOptions(bootstrap_samples=10, ar_trials=10)
    report = replicates.build_report([("base", BASELINE), ("both", SYSTEM), ("one", {2: SYSTEM[2]}),
                                      ("none", {3: SYSTEM[1]})], [REFERENCES], options, wordnet=load_wordnet())
    base, both, one, none = report.rows
    bleu = {name: [sacrebleu.corpus_bleu(runs[s], [REFERENCES]).score for s in sorted(runs)]
            for name, runs in (("base", BASELINE), ("both", SYSTEM))}
    assert both.delta(base) == pytest.approx(np.mean(bleu["both"]) - np.mean(bleu["base"]))
    assert one.ar_seeds == [2] and one.delta(base) == pytest.approx(bleu["both"][1] - bleu["base"][1])
    assert none.delta(base) is None and none.ar_p_value is None
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in
            replicates.markdown_table(report, "2 updates").splitlines()[2:6]}
    assert rows["one"][2] == f"{bleu['both'][1] - bleu['base'][1]:+.2f}" and rows["none"][2] == ""


def direct_ar(baseline, system, references, trials, seed):
    """Approximate randomization over concatenated replicates written out directly: every
    (baseline, system) sentence pair swapped with probability 1/2, |BLEU difference| of the
    concatenations compared with the observed one, p = (count + 1) / (trials + 1)."""
    base = [line for replicate in baseline for line in replicate]
    sys_ = [line for replicate in system for line in replicate]
    refs = list(references) * len(baseline)
    observed = abs(sacrebleu.corpus_bleu(base, [refs]).score - sacrebleu.corpus_bleu(sys_, [refs]).score)
    swaps = np.random.default_rng(seed).integers(2, size=(trials, len(base)), dtype=bool)
    count = 0
    for swap in swaps:
        a = [s if flip else b for b, s, flip in zip(base, sys_, swap)]
        b = [b if flip else s for b, s, flip in zip(base, sys_, swap)]
        count += abs(sacrebleu.corpus_bleu(a, [refs]).score - sacrebleu.corpus_bleu(b, [refs]).score) > observed
    return (count + 1) / (trials + 1)


def test_ar_over_replicates_matches_a_direct_implementation_within_monte_carlo_error():
    trials, seed = 200, 11
    # a small difference, so that p is neither 1/(trials+1) nor 1
    system = {1: degrade(REFERENCES, 5, 0.40), 2: degrade(REFERENCES, 6, 0.40)}
    ours = replicates.replicate_ar_p_value([BASELINE[1], BASELINE[2]], [system[1], system[2]], [REFERENCES],
                                           resolve_protocol("sacrebleu"), trials, seed)
    direct = direct_ar([BASELINE[1], BASELINE[2]], [system[1], system[2]], REFERENCES, trials, seed)
    error = math.sqrt(direct * (1 - direct) / trials)
    assert 0.01 < direct < 0.99
    assert abs(ours - direct) <= 3 * error + 1 / trials
    with pytest.raises(ValueError, match="same number of replicates"):
        replicates.replicate_ar_p_value([BASELINE[1]], [system[1], system[2]], [REFERENCES],
                                        resolve_protocol("sacrebleu"), trials, seed)


def test_tables_written_atomically_and_meteor_n_a_without_wordnet(tmp_path):
    options = replicates.ReplicateOptions(bootstrap_samples=20, ar_trials=20)
    report = replicates.build_report([("base", BASELINE), ("new", SYSTEM)], [REFERENCES], options,
                                     wordnet=load_wordnet(str(tmp_path / "no-wordnet")),
                                     extra={"BLEU, deranged": {"new": {1: 1.0, 2: 3.0}}})
    table = replicates.write_report(report, str(tmp_path / "results"), "2 updates", "toy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "results.md", "results.png", "results.tex"]
    lines = table.splitlines()
    assert lines[0].startswith("| system | BLEU | Δ | s_sel | p (AR) | p (Holm) |")
    new_row = lines[3].split(" | ")
    # one comparison: Holm leaves its p-value as it is
    assert new_row[5] == new_row[4] == f"{report.rows[1].ar_p_value:.3f}"
    assert new_row[8] == "n/a" and new_row[-1].rstrip(" |") == "2.00 ± 1.41"  # METEOR, then the extra column
    assert lines[2].endswith("| — |")  # the baseline has no extra value
    assert "METEOR: n/a: no WordNet database in" in table
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["systems"][1]["scores"]["METEOR"] == [None, None]
    assert saved["systems"][1]["sd"]["BLEU"] == pytest.approx(report.rows[1].summary("BLEU")[1])
    assert r"$\pm$" in (tmp_path / "results.tex").read_text()


def test_holm_equals_a_hand_worked_example_and_statsmodels():
    """Holm (1979): sorted 0.01, 0.03, 0.04 times 3, 2, 1 = 0.03, 0.06, 0.04, made monotone:
    0.03, 0.06, 0.06, given back in the input's order."""
    from statsmodels.stats.multitest import multipletests

    assert replicates.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert replicates.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert replicates.holm([]) == []
    raw = [0.001, 0.2, 0.04, 0.012]
    assert replicates.holm(raw) == pytest.approx(list(multipletests(raw, method="holm")[1]))


def three_way_report(**kwargs):
    """The baseline, a system and its matched baseline (another degraded copy), two seeds each."""
    matched = {1: degrade(REFERENCES, 7, 0.35), 2: degrade(REFERENCES, 8, 0.35)}
    options = replicates.ReplicateOptions(bootstrap_samples=10, ar_trials=30, seed=5)
    return replicates.build_report([("base", BASELINE), ("Transformer, matched to new: FFN 1,216", matched),
                                    ("new", SYSTEM)], [REFERENCES], options, wordnet=load_wordnet(),
                                   matched={"new": "Transformer, matched to new: FFN 1,216"}, **kwargs)


def cells_of(table, first_cell):
    return next(line.split(" | ") for line in table.splitlines() if line.startswith(f"| {first_cell} |"))


def test_every_comparison_is_holm_adjusted_and_the_marks_follow_the_adjusted_p():
    report = three_way_report()
    base, matched, new = report.rows
    comparisons = {(c.system, c.against): c for c in report.comparisons}
    assert list(comparisons) == [(matched.name, "base"), ("new", "base"), ("new", matched.name)]
    raw = [c.p_value for c in report.comparisons]
    expected = replicates.holm(raw)
    assert [c.p_holm for c in report.comparisons] == pytest.approx(expected)
    assert (matched.ar_p_holm, new.ar_p_holm) == pytest.approx(tuple(expected[:2]))
    table = replicates.markdown_table(report, "2 updates")
    row = cells_of(table, "new")
    assert (row[4], row[5]) == (f"{new.ar_p_value:.3f}", f"{new.ar_p_holm:.3f}")
    assert "adjusted by Holm-Bonferroni over the 3 comparison(s)" in table
    assert "† p<0.05, ‡ p<0.01 from the Holm-adjusted p" in table
    # the mechanism against its matched baseline, in the comparisons' table and the JSON
    versus = cells_of(table, "new | Transformer, matched to new: FFN 1,216")
    assert versus[-2] == f"{raw[2]:.3f}" and versus[-1].rstrip(" |").startswith(f"{expected[2]:.3f}")
    saved = report.as_dict()
    assert [(c["system"], c["against"]) for c in saved["comparisons"]] == list(comparisons)
    assert saved["comparisons"][2]["p_holm"] == pytest.approx(expected[2])
    # the mark follows the adjusted p: significant raw, not adjusted, has none
    new.ar_p_value, new.ar_p_holm = 0.04, 0.08
    assert cells_of(replicates.markdown_table(report, "2 updates"), "new")[1] == mean_sd_cell(new)
    new.ar_p_value, new.ar_p_holm = 0.004, 0.03
    assert cells_of(replicates.markdown_table(report, "2 updates"), "new")[1] == mean_sd_cell(new) + "†"
    assert report.as_dict()["systems"][2]["mark"] == "†"
    assert r"p (Holm)" in replicates.latex_table(report, "2 updates")


def mean_sd_cell(row):
    return replicates.mean_sd_text(row.scores["BLEU"])


def test_each_difference_comes_with_its_human_accuracy():
    """mt_thresholds (Kocmi et al. 2024) on |Δ|: the sign says which system the metric prefers."""
    import mt_thresholds

    report = three_way_report()
    base, matched, new = report.rows
    comparison = report.comparisons[1]  # new against base
    bleu = new.delta(base)
    chrf = new.mean_over([1, 2], "chrF") - base.mean_over([1, 2], "chrF")
    assert comparison.deltas["BLEU"] == pytest.approx(bleu) and comparison.deltas["chrF"] == pytest.approx(chrf)
    assert comparison.accuracy["BLEU"] == pytest.approx(mt_thresholds.accuracy(abs(bleu), "bleu"))
    assert comparison.accuracy["chrF"] == pytest.approx(mt_thresholds.accuracy(abs(chrf), "chrf"))
    assert comparison.deltas["COMET"] is None and comparison.accuracy["COMET"] is None  # no COMET model
    row = cells_of(replicates.markdown_table(report, "2 updates"), "new | base")
    assert row[2:8] == ["1, 2", f"{bleu:+.2f}", f"{comparison.accuracy['BLEU']:.0f}%", f"{chrf:+.2f}",
                        f"{comparison.accuracy['chrF']:.0f}%", "n/a"]
    assert replicates.human_accuracy(-1.0, "bleu") == pytest.approx(mt_thresholds.accuracy(1.0, "bleu"))
    assert replicates.human_accuracy(1.0, "comet22") == pytest.approx(mt_thresholds.accuracy(1.0, "comet22"))
    assert replicates.human_accuracy(1.0, None) is None and replicates.human_accuracy(None, "bleu") is None


def test_comets_model_gets_its_thresholds_name_and_a_sacrecomet_signature():
    import sys

    from mlmha_fairseq.evaluation import comet

    hub = "/cache/huggingface/hub/models--Unbabel--wmt22-comet-da/snapshots/371e9839ca4e213dde891b066cf3080f75ec7e72"
    assert comet.comet_model_name(hub) == "Unbabel/wmt22-comet-da"
    assert comet.thresholds_metric(hub) == "comet22"
    assert comet.thresholds_metric("/models/wmt20-comet-da") == "comet20"
    assert comet.thresholds_metric("/models/wmt22-cometkiwi-da") == "cometkiwi22"
    assert comet.thresholds_metric("/tmp/my-tiny-model") is None
    signature = comet.comet_signature(hub)
    python = ".".join(map(str, sys.version_info[:3]))
    assert signature.startswith(f"Python{python}|Comet") and signature.endswith("|fp32|Unbabel/wmt22-comet-da|r1")


def test_the_runners_training_costs_are_columns():
    costs = {"base": {1: {"params": 1000.0, "train time (s)": 10.0, "tokens/s": 100.0},
                      2: {"params": 1000.0, "train time (s)": 14.0, "tokens/s": 120.0}},
             "new": {1: {"params": 1234567.0, "train time (s)": None, "tokens/s": None}}}
    report = three_way_report(costs=costs)
    table = replicates.markdown_table(report, "2 updates")
    assert table.splitlines()[0].endswith("| seeds | params | train time (s) | tokens/s |")
    assert cells_of(table, "base")[-3:] == ["1,000", "12 ± 3", "110 ± 14 |"]
    assert cells_of(table, "new")[-3:] == ["1,234,567", "—", "— |"]
    assert cells_of(table, "Transformer, matched to new: FFN 1,216")[-1] == "— |"
    assert report.as_dict()["systems"][0]["costs"]["train time (s)"] == [10.0, 14.0]
    assert "num. shared model params" in table
    # the demo's tables have none of them
    assert "| params |" not in replicates.markdown_table(three_way_report(), "2 updates")
