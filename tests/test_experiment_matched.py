"""Budget-matched baselines (experiments/matching.py): fairseq's Transformer widened or deepened
to a mechanism's parameter count, counted with the corpus's dictionaries; the runner's training
costs read from fairseq-train's log; one tiny grid end to end."""
import json
import re

import pytest
from fairseq.data import Dictionary
from statsmodels.stats.multitest import multipletests

from fairseq_helpers import DECODING, TINY_MODEL_ARGS, build_model

from mlmha_fairseq.cli import experiment
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments import matching
from mlmha_fairseq.experiments.grid import ATTEMPT, Settings, training_costs
from mlmha_fairseq.experiments.systems import lookup

MODEL_ARGS = [*TINY_MODEL_ARGS, "--share-all-embeddings"]  # the tests' small shape, one embedding shared
BASELINE = lookup("transformer")


def dictionaries(folder, words):
    """A joined dictionary of ``words`` symbols as fairseq-preprocess writes it, for src and tgt."""
    text = "".join(f"w{i} {1000 - i}\n" for i in range(words))
    for side in ("src", "tgt"):
        (folder / f"dict.{side}.txt").write_text(text)
    return Settings(data_bin=str(folder), target="tgt", max_update=2, model_args=list(MODEL_ARGS),
                    corpus_args=["--source-lang", "src", "--target-lang", "tgt"])


def cpu_count(system, folder):
    """The parameters of ``system``'s model built on the CPU by the tests' own helper (another
    path than the runner's meta-device count)."""
    dictionary = Dictionary.load(str(folder / "dict.src.txt"))
    model = build_model(system.arch, "--share-all-embeddings", *system.options, dictionary=dictionary)
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize("by", ["ffn", "layers"])
@pytest.mark.parametrize("name", ["MLMHA M-00", "MLRF Both-FNN-SA", "MS-2 + AIF", "Enc-DC"])
def test_the_matched_transformer_has_the_mechanisms_parameters_within_one_percent(tmp_path, name, by):
    settings = dictionaries(tmp_path, 60)
    mechanism = lookup(name)
    matched, count, target = matching.matched_system(mechanism, BASELINE, settings, by)
    assert target == cpu_count(mechanism, tmp_path) and count == cpu_count(matched, tmp_path)
    assert abs(count - target) <= 0.01 * target
    assert count != cpu_count(BASELINE, tmp_path)  # every one of these mechanisms adds parameters
    # the baseline's own settings, then what makes it larger: the last value of an option wins
    assert matched.arch == BASELINE.arch and matched.task_options == BASELINE.task_options
    added = dict(zip(matched.options[::2], matched.options[1::2]))
    width = added["--encoder-ffn-embed-dim"]
    assert added["--decoder-ffn-embed-dim"] == width
    if by == "ffn":
        assert sorted(added) == ["--decoder-ffn-embed-dim", "--encoder-ffn-embed-dim"] and int(width) > 32
    else:
        assert int(added["--encoder-layers"]) >= 3 and int(added["--decoder-layers"]) >= 2
        assert int(added["--encoder-layers"]) + int(added["--decoder-layers"]) > 5


def test_the_count_is_the_corpus_vocabularys_and_the_name_says_the_width(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    mechanism = lookup("MLMHA M-00")
    counts = {folder.name: matching.count_parameters(mechanism, dictionaries(folder, words))
              for folder, words in ((small, 60), (large, 600))}
    assert counts["large"] - counts["small"] == 540 * 16  # one shared 16-wide embedding row per word
    matched, _count, _target = matching.matched_system(mechanism, BASELINE, dictionaries(small, 60))
    name = matching.matched_name(mechanism, BASELINE, matched)
    width = int(matched.options[-1])
    assert name == f"Transformer, matched to MLMHA M-00: FFN {width:,}"
    deeper, _count, _target = matching.matched_system(mechanism, BASELINE, dictionaries(small, 60), "layers")
    assert re.fullmatch(r"Transformer, matched to MLMHA M-00: \d+\+\d+ layers, FFN [\d,]+",
                        matching.matched_name(mechanism, BASELINE, deeper))
    systems, pairs, counts = matching.matched_systems([BASELINE, lookup("MMA"), mechanism], BASELINE.name,
                                                      [mechanism.name], dictionaries(small, 60))
    assert [system.name for system in systems] == [BASELINE.name, "MMA", name, mechanism.name]
    assert pairs == {mechanism.name: name} and set(counts) == {BASELINE.name, name, mechanism.name}
    # MMA has the Transformer's parameters: the Transformer is its matched baseline, no copy is trained
    systems, pairs, counts = matching.matched_systems([BASELINE, lookup("MMA"), mechanism], BASELINE.name,
                                                      ["MMA", mechanism.name], dictionaries(small, 60))
    assert [system.name for system in systems] == [BASELINE.name, "MMA", name, mechanism.name]
    assert pairs == {mechanism.name: name} and counts["MMA"] == counts[BASELINE.name]


def test_a_mechanism_the_model_cannot_hold_is_refused_in_one_line(tmp_path):
    settings = dictionaries(tmp_path, 60)
    with pytest.raises(UsageError) as error:  # auxiliary decoders on layer 3 of a 3-layer encoder
        matching.matched_system(lookup("MS-123 + AIF"), BASELINE, settings)
    assert "\n" not in str(error.value)
    with pytest.raises(UsageError, match="matched_by must be one of ffn, layers"):
        matching.matched_system(lookup("MLMHA M-00"), BASELINE, settings, "wider")


def test_training_costs_are_read_from_both_log_formats_over_the_attempts(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        f"{ATTEMPT}0\n"
        "2026-11-28 05:29:03 | INFO | fairseq_cli.train | num. shared model params: 1,516,544 (num. trained: 1,516,544)\n"
        '2026-11-28 05:29:21 | INFO | train_inner | {"epoch": 1, "wps": "100", "num_updates": "25", "train_wall": "13", '
        '"wall": "18"}\n'
        '2026-11-28 05:29:31 | INFO | train_inner | {"epoch": 1, "wps": "300", "num_updates": "50", "wall": "40"}\n'
        f"{ATTEMPT}50\n"  # killed after this line: its last wall counts
        "2026-11-28 06:00:00 | INFO | train | epoch 001 | loss 5.1 | train_wps 999 | wall 7\n"
        f"{ATTEMPT}50\n"
        "2026-11-28 06:10:00 | INFO | train_inner | epoch 002:  25 / 258 loss=4.9, wps=200, ups=1, wall=30\n"
        "2026-11-28 06:10:05 | INFO | fairseq_cli.train | done training in 31.5 seconds\n")
    assert training_costs(str(log)) == {"params": 1516544.0, "train time (s)": pytest.approx(40 + 7 + 31.5),
                                        "tokens/s": pytest.approx(200.0)}
    short = tmp_path / "short.log"  # shorter than --log-interval: the epoch's average
    short.write_text('| INFO | train | {"epoch": 1, "train_wps": "500", "train_wall": "3", "wall": "4"}\n')
    assert training_costs(str(short)) == {"params": None, "train time (s)": 4.0, "tokens/s": 500.0}
    assert training_costs(str(tmp_path / "none.log")) == {"params": None, "train time (s)": None, "tokens/s": None}


def test_training_time_counts_resumed_attempts_that_log_no_wall_clock(tmp_path):
    """fairseq logs ``wall`` 0 after resuming from a checkpoint; such an attempt stopped before
    ``done training in`` counts the span of its timestamps. Logs from before the runner marked
    attempts are split at each fairseq-train start (its config line)."""
    start = "| INFO | fairseq_cli.train | {'_name': None, 'common': {}}\n"
    inner = '| INFO | train_inner | {"wps": "100", "num_updates": "%d", "wall": "%d"}\n'
    unmarked = tmp_path / "unmarked.log"
    unmarked.write_text(
        "2026-11-28 04:00:00 " + start + "2026-11-28 04:01:00 " + inner % (25, 50)  # fresh, killed: wall
        + "2026-11-28 05:00:00 " + start + "2026-11-28 05:00:30 " + inner % (50, 0)  # resumed, killed:
        + "2026-11-28 05:02:00 " + inner % (75, 0)                                   # 120 s of timestamps
        + "2026-11-28 06:00:00 " + start + "2026-11-28 06:00:40 " + inner % (100, 0)
        + "2026-11-28 06:01:00 | INFO | fairseq_cli.train | done training in 30.5 seconds\n")
    assert training_costs(str(unmarked))["train time (s)"] == pytest.approx(50 + 120 + 30.5)
    marked = tmp_path / "marked.log"
    marked.write_text(f"{ATTEMPT}0\n" + "2026-11-28 04:00:00 " + start + "2026-11-28 04:01:00 " + inner % (25, 60)
                      + f"{ATTEMPT}25\n" + "2026-11-28 05:00:00 " + start + "2026-11-28 05:03:20 " + inner % (50, 0))
    assert training_costs(str(marked))["train time (s)"] == pytest.approx(60 + 200)


GRID = """
work_dir = "{work}"
seeds = 1
systems = ["transformer", "MLMHA M-00"]
matched = ["mlmha M-00"]
max_update = 2
beam = 1
""" + DECODING + """
[corpus]
dir = "{corpus}"
"""


def test_a_grid_trains_the_matched_baseline_and_compares_the_mechanism_with_both(tmp_path, corpus, capsys):
    """Counted on the meta device = what fairseq-train logs; a row and a run folder of its own;
    both comparisons of the mechanism in the JSON and the table."""
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(GRID.format(work=work, corpus=corpus))
    assert experiment.main([str(config), "--ar-trials", "20", "--bootstrap-samples", "10"]) == 0
    results = json.loads((work / "results.json").read_text())
    names = [row["name"] for row in results["systems"]]
    assert names[0] == "Transformer (fairseq)" and names[2] == "MLMHA M-00"
    assert re.fullmatch(r"Transformer, matched to MLMHA M-00: FFN [\d,]+", names[1])
    params = {row["name"]: row["costs"]["params"][0] for row in results["systems"]}
    # the runner's meta-device counts, logged before training, are what fairseq-train counted
    counted = re.search(r"MLMHA M-00: ([\d,]+) parameters; (.+): ([\d,]+) \(", capsys.readouterr().err)
    assert counted.group(2) == names[1]
    assert int(counted.group(1).replace(",", "")) == params["MLMHA M-00"]
    assert int(counted.group(3).replace(",", "")) == params[names[1]]
    assert abs(params[names[1]] - params["MLMHA M-00"]) <= 0.01 * params["MLMHA M-00"]
    assert params["Transformer (fairseq)"] < params[names[1]]
    assert all(row["costs"]["train time (s)"][0] > 0 and row["costs"]["tokens/s"][0] > 0
               for row in results["systems"])
    assert [(c["system"], c["against"]) for c in results["comparisons"]] == [
        (names[1], names[0]), ("MLMHA M-00", names[0]), ("MLMHA M-00", names[1])]
    folder = next((work / "runs").glob("transformer--matched-to-mlmha-m-00--ffn-*"))
    settings = json.loads((folder / "seed1" / "run.json").read_text())
    width = names[1].rsplit(" ", 1)[1].replace(",", "")
    assert settings["arch"] == "transformer"
    assert settings["system options"] == ["--encoder-ffn-embed-dim", width, "--decoder-ffn-embed-dim", width]
    table = (work / "results.md").read_text()
    assert f"| {names[1]} |" in table and f"| MLMHA M-00 | {names[1]} |" in table
    assert "| params | train time (s) | tokens/s |" in table


def test_a_pair_the_grid_names_is_compared_and_holm_adjusted_with_the_rest(tmp_path, corpus):
    """``comparisons``: MLRF at a lower rate against the Transformer at that rate is a question the
    baseline's column does not answer (docs/experiment/convergence's fusion-weights grid)."""
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(f"""
work_dir = "{work}"
seeds = 1
systems = ["transformer", {{ name = "Transformer, lr 1e-3", base = "transformer", args = ["--lr", "1e-3"] }},
           {{ name = "MMA, lr 1e-3", base = "mma", args = ["--lr", "1e-3"] }}]
comparisons = [["MMA, lr 1e-3", "Transformer, lr 1e-3"]]
max_update = 2
beam = 1
{DECODING}
[corpus]
dir = "{corpus}"
""")
    assert experiment.main([str(config), "--ar-trials", "20", "--bootstrap-samples", "10"]) == 0
    results = json.loads((work / "results.json").read_text())
    pairs = [(c["system"], c["against"]) for c in results["comparisons"]]
    assert pairs == [("Transformer, lr 1e-3", "Transformer (fairseq)"), ("MMA, lr 1e-3", "Transformer (fairseq)"),
                     ("MMA, lr 1e-3", "Transformer, lr 1e-3")]
    raw = [c["p_value"] for c in results["comparisons"]]
    assert [c["p_holm"] for c in results["comparisons"]] == pytest.approx(list(multipletests(raw, method="holm")[1]))
    table = (work / "results.md").read_text()
    assert "| MMA, lr 1e-3 | Transformer, lr 1e-3 | 1 |" in table
    assert "and each pair the grid names" in table
