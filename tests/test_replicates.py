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
