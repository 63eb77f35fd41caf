"""The source-dependence analysis: its NLL is fairseq's own validation loss, a model that has
learned the toy task gains from its true source, and the output-diversity counts."""
import json
import random
import re

import pytest

from fairseq_helpers import USER_DIR, run_fairseq, train_args
from mlmha_fairseq.cli import source_dependence as cli
from mlmha_fairseq.evaluation.model_loading import load_model
from mlmha_fairseq.evaluation.source_dependence import derangement, hypothesis_diversity, source_dependence


@pytest.mark.parametrize("size", [2, 3, 7, 64])
def test_a_derangement_moves_every_index(size):
    for seed in range(20):
        order = derangement(size, random.Random(seed))
        assert sorted(order) == list(range(size)) and all(order[i] != i for i in range(size))
    assert derangement(size, random.Random(3)) == derangement(size, random.Random(3))


@pytest.fixture(scope="module")
def learned(data_bin, tmp_path_factory):
    """A tiny model after 150 updates of the reversal task (it needs its source for it)."""
    save_dir = tmp_path_factory.mktemp("learned")
    run_fairseq("train", *train_args(data_bin, save_dir, "transformer", "--lr", "0.005", max_update=150))
    return save_dir / "checkpoint_last.pt"


def test_the_nll_of_the_true_sources_is_fairseqs_validation_loss(learned, data_bin):
    model, task = load_model(str(learned), str(data_bin))
    task.load_dataset("valid")
    result = source_dependence(model, task, "valid")
    assert result.left_out == 0 and result.sentences == 16
    validate = run_fairseq("validate", data_bin, "--user-dir", USER_DIR, "--path", learned, "--cpu",
                           "--task", "translation", "--criterion", "cross_entropy", "--valid-subset", "valid", "--max-tokens", "4096")
    reported = float(re.search(r"valid on 'valid' subset \| loss ([\d.]+)", validate.stdout + validate.stderr)
                     .group(1))  # cross_entropy logs bits per token, 3 decimals
    assert result.true_bits / result.tokens == pytest.approx(reported, abs=1e-3)


def test_a_model_that_learned_the_task_needs_its_own_source(learned, data_bin, tmp_path, capsys):
    hypotheses = tmp_path / "hyps.txt"
    hypotheses.write_text("w1 w2 w3 w4 w5\nw1 w2 w3 w4 w6\nw7 w8\nw7 w8\n")
    prefix = tmp_path / "out"
    cli.main([str(learned), "--names", "reversal", "--data-bin", str(data_bin), "--hypotheses", str(hypotheses),
              "--output-prefix", str(prefix)])
    row = json.loads(prefix.with_suffix(".json").read_text())["models"][0]
    assert row["gain_bits_per_token"] > 0.5, row  # the reversal task cannot be done without the source
    assert row["nll_deranged_bits_per_token"] == pytest.approx(
        row["nll_true_bits_per_token"] + row["gain_bits_per_token"])
    assert (row["distinct"], row["largest_same_first_4_words"], row["that_prefix"]) == (3, 2, "w1 w2 w3 w4")
    assert "| reversal |" in capsys.readouterr().out


def test_hypothesis_diversity_counts():
    result = hypothesis_diversity(["a b c d e", "a b c d f", "a b c d e", "x"], prefix_words=4)
    assert result == {"hypotheses": 4, "distinct": 3, "largest_same_first_4_words": 3, "that_prefix": "a b c d",
                      "share": 0.75}
