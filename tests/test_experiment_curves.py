"""Learning curves and the convergence stop of the experiment runner: the report's arithmetic on
logs written by hand, and one toy grid trained through fairseq-train's own --patience."""
import json
import os
import re

import pytest
import torch

from fairseq_helpers import DECODING
from mlmha_fairseq.cli import experiment
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments import curves, grid, systems
from mlmha_fairseq.experiments.config import load_config


def write_log(run: grid.Run, validations):
    """A fairseq-train JSON log with one ``valid`` record per ``(update, bleu, loss)``."""
    os.makedirs(run.path("logs"), exist_ok=True)
    lines = [f'2026-01-01 00:00:00 | INFO | valid | {{"epoch": 1, "valid_loss": "{loss}", "valid_bleu": "{bleu}", '
             f'"valid_num_updates": "{update}"}}' for update, bleu, loss in validations]
    with open(run.path("logs", "train.log"), "w") as log:
        log.write("\n".join(lines) + "\n")


def test_the_report_finds_each_seeds_best_and_stop_and_compares_at_the_last_common_update(tmp_path):
    baseline, other = systems.lookup("transformer"), systems.lookup("mlmha M-00")
    runs = grid.Grid([baseline, other], [1, 2], grid.Settings("bin", "en", 1000), str(tmp_path))
    logs = {
        ("Transformer (fairseq)", 1): [(200, 1.0, 7.0), (400, 2.0, 6.0), (600, 1.5, 5.9)],
        ("Transformer (fairseq)", 2): [(200, 1.2, 7.1), (400, 2.6, 6.1), (600, 3.0, 5.8), (800, 2.9, 5.7)],
        ("MLMHA M-00", 1): [(200, 3.0, 6.5), (400, 5.0, 5.5)],  # still training: stopped nowhere yet
        ("MLMHA M-00", 2): [(200, 2.0, 6.6), (400, 4.0, 5.4), (600, 4.0, 5.4)],  # ties: the earlier is best
    }
    for run in runs.runs:
        write_log(run, logs[(run.system.name, run.seed)])
    report = curves.curve_report(runs)
    assert report["matched_update"] == 400  # the last validation every run reached
    assert report["matched_bleu"] == {"Transformer (fairseq)": [2.0, 2.6], "MLMHA M-00": [5.0, 4.0]}
    assert report["seeds"]["Transformer (fairseq)"][2] == {
        "stopped_at": 800, "stopped_by": curves.NOT_STOPPED, "finished": False, "best_bleu": 3.0, "best_update": 600,
        "lowest_loss": 5.7, "lowest_loss_update": 800, "validations": 4}
    assert report["seeds"]["MLMHA M-00"][2]["best_update"] == 400
    assert report["seeds"]["MLMHA M-00"][2]["lowest_loss_update"] == 400
    assert report["curves"]["MLMHA M-00"][1]["loss"] == [(200, 6.5), (400, 5.5)]

    text = curves.write_curve_report(runs, str(tmp_path / "results-curves"))
    assert f"| Transformer (fairseq) | 2 | 800 | {curves.NOT_STOPPED} | no | 3.00 | 600 | 5.700 | 800 | 4 |" in text
    assert "Validation BLEU at update 400" in text and "| MLMHA M-00 | 4.50 ± 0.71 | 2 |" in text
    assert (tmp_path / "results-curves.png").stat().st_size > 0
    assert json.loads((tmp_path / "results-curves.json").read_text())["matched_update"] == 400
    one_seed = grid.Grid([baseline], [1], grid.Settings("bin", "en", 1000), str(tmp_path / "one"))
    write_log(one_seed.runs[0], logs[("Transformer (fairseq)", 1)])
    one = curves.write_curve_report(one_seed, str(tmp_path / "one-curves"))
    assert "| Transformer (fairseq) | 1.50 | 1 |" in one  # no sd of one seed


STOP_LINES = {
    "patience": "| INFO | fairseq_cli.train | early stop since valid performance hasn't improved for last 5 runs",
    "time limit (--stop-time-hours)": "| INFO | fairseq_cli.train | Stopping training due to cumulative_training_time: "
                                      "0.34 > stop_time_hours: 0.33 hour(s)",
    "failed: StopIteration (while handling FloatingPointError: Minimum loss scale reached (0.0001).)": (
        "Traceback (most recent call last):\n  File x\nFloatingPointError: Minimum loss scale reached (0.0001).\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File y\nStopIteration"),
}


@pytest.mark.parametrize("reason", sorted(STOP_LINES))
def test_the_report_says_why_each_run_stopped_its_last_attempt_counting(tmp_path, reason):
    runs = grid.Grid([systems.lookup("transformer")], [1], grid.Settings("bin", "en", 1000), str(tmp_path))
    run = runs.runs[0]
    write_log(run, [(200, 1.0, 7.0)])
    with open(run.path("logs", "train.log"), "a") as log:  # a resumed run: the earlier attempt's stop first
        log.write("Stopping training due to num_updates: 200 >= max_update: 200\n" + STOP_LINES[reason] + "\n")
    assert curves.curve_report(runs)["seeds"]["Transformer (fairseq)"][1]["stopped_by"] == reason


def test_an_attempt_trained_to_a_lower_cap_is_not_the_runs_stop(tmp_path):
    """An attempt trained to a lower cap (``--max-update`` given once) and resumed with the
    config's: that stop is not the run's, which is still training or stopped later."""
    runs = grid.Grid([systems.lookup("transformer")], [1], grid.Settings("bin", "en", 1000), str(tmp_path))
    run = runs.runs[0]
    write_log(run, [(200, 1.0, 7.0)])
    log = run.path("logs", "train.log")
    with open(log, "a") as out:
        out.write("Stopping training due to num_updates: 400 >= max_update: 400\n")
    assert curves.stop_reason(log, 1000) == curves.NOT_STOPPED
    assert curves.stop_reason(log, 400) == "max_update"
    with open(log, "a") as out:
        out.write("Stopping training due to num_updates: 1000 >= max_update: 1000\n")
    assert curves.stop_reason(log, 1000) == "max_update"


def test_a_finished_run_whose_log_shows_the_patience_spent_was_stopped_by_the_runner(tmp_path):
    """Logs of runner versions that marked such a run finished without writing CONVERGED."""
    settings = grid.Settings("bin", "en", 1000, convergence=grid.Convergence(200, 2))
    run = grid.Grid([systems.lookup("transformer")], [1], settings, str(tmp_path)).runs[0]
    write_log(run, [(200, 1.0, 7.0), (400, 3.0, 6.0), (600, 2.0, 5.9)])
    assert curves.run_stop(run, settings) == curves.NOT_STOPPED  # one validation without gain
    for name in ("scores.json", "hypotheses.txt"):
        with open(run.path(name), "w") as out:
            out.write("{}")
    assert curves.run_stop(run, settings) == curves.NOT_STOPPED  # finished, patience not spent
    write_log(run, [(200, 1.0, 7.0), (400, 3.0, 6.0), (600, 2.0, 5.9), (800, 2.5, 5.8)])
    assert curves.run_stop(run, settings) == "patience (over the attempts, counted by the runner)"
    no_convergence = grid.Settings("bin", "en", 1000)
    assert curves.run_stop(run, no_convergence) == curves.NOT_STOPPED
    fixed_budget = grid.Settings("bin", "en", 1000, convergence=grid.Convergence(200, 0))
    assert curves.run_stop(run, fixed_budget) == curves.NOT_STOPPED


def test_a_run_without_validations_yet_has_no_curve(tmp_path):
    runs = grid.Grid([systems.lookup("transformer")], [1], grid.Settings("bin", "en", 10), str(tmp_path))
    assert curves.curve_report(runs)["curves"] == {}
    assert curves.write_curve_report(runs, str(tmp_path / "results-curves")) == ""
    assert not (tmp_path / "results-curves.png").exists()


CONVERGENCE = """
work_dir = "{work}"
systems = ["transformer"]
max_update = 80
max_tokens = 400
beam = 1
""" + DECODING + """
[convergence]
validate_every = 4
patience = 2
[corpus]
dir = "{corpus}"
"""


def test_a_run_stops_once_validation_bleu_has_not_improved_for_patience_evaluations(tmp_path, corpus):
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(CONVERGENCE.format(work=work, corpus=corpus))
    assert experiment.main([str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    seed = json.loads((work / "results-curves.json").read_text())["seeds"]["Transformer (fairseq)"]["1"]
    # fairseq's --patience: the run ends at the P-th validation after its best, before the cap
    assert seed["stopped_at"] == seed["best_update"] + 2 * 4 < 80 and seed["stopped_by"] == "patience"
    assert seed["validations"] == seed["stopped_at"] // 4
    assert (work / "results-curves.png").stat().st_size > 0
    run_dir = work / "runs" / "transformer--fairseq" / "seed1"
    scores = json.loads((run_dir / "scores.json").read_text())
    assert scores["checkpoint"].endswith("checkpoint_best.pt")  # the checkpoint of best validation BLEU

    # stopped after training, before it was recorded: its log shows it converged, so a rerun
    # (whose fairseq-train would count --patience afresh) does not train it again
    trainings = (work / "commands.log").read_text().count("fairseq_cli.train")
    (run_dir / "train.done").unlink()
    (run_dir / "scores.json").unlink()
    assert experiment.main([str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    assert (work / "commands.log").read_text().count("fairseq_cli.train") == trainings
    assert grid.last_update(str(run_dir / "logs" / "train.log")) == seed["stopped_at"]
    again = json.loads((work / "results-curves.json").read_text())["seeds"]["Transformer (fairseq)"]["1"]
    assert again["stopped_by"] == "patience (over the attempts, counted by the runner)"


# a first attempt's value that no later validation beats, per metric
UNBEATABLE = {"bleu": (r'"valid_bleu": "[0-9.]+"', '"valid_bleu": "100.0"'),
              "loss": (r'"valid_loss": "[0-9.]+"', '"valid_loss": "0.0"')}


def stopped_attempt_with_an_unbeatable_first_validation(config, work, cap: int, metric: str):
    """Train the grid's one run to update ``cap`` (the runner's --max-update), mark it
    unfinished as a stopped attempt leaves it, and make its first validation's ``metric``
    unbeatable; returns its log."""
    run_dir = work / "runs" / "transformer--fairseq" / "seed1"
    assert experiment.main([str(config), "--max-update", str(cap), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    (run_dir / "train.done").unlink()
    (run_dir / "scores.json").unlink()
    log = run_dir / "logs" / "train.log"
    log.write_text(re.sub(*UNBEATABLE[metric], log.read_text(), count=1))
    return log


# CI trains the default metric's case; the count itself is unit-tested for both metrics
# (test_validations_since_best_*); `make exhaustive` trains the loss case too
@pytest.mark.parametrize("metric", ["bleu", pytest.param("loss", marks=pytest.mark.exhaustive)])
def test_a_resumed_run_stops_by_the_count_over_all_its_attempts(tmp_path, corpus, metric, monkeypatch):
    """fairseq-train counts --patience afresh after a resume; the runner stops the resumed run
    where an uninterrupted one would have stopped: ``patience`` validations after the best of
    all its attempts in the convergence metric, once the last one's checkpoint is saved."""
    # the runner must see update 75's checkpoint before update 100's is saved: 25 updates of
    # this toy model take about a second, the runner's default check interval, and a loaded
    # CI machine once lost that race; a real run's validations are minutes apart
    monkeypatch.setattr(grid, "STOP_CHECK_SECONDS", 0.05)
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(CONVERGENCE.replace("max_update = 80", "max_update = 400\nwarmup_updates = 10")
                      .replace("validate_every = 4", f'validate_every = 25\nmetric = "{metric}"')
                      .format(work=work, corpus=corpus))
    # the first attempt: one validation, at update 25, its metric made unbeatable: the next
    # attempt must stop two validations later, at update 75, where fairseq's own count (from
    # update 50, its first validation) cannot stop it yet
    log = stopped_attempt_with_an_unbeatable_first_validation(config, work, 25, metric)
    run_dir = log.parent.parent
    assert log.read_text().count('"valid_bleu"') == 1

    assert experiment.main([str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    seed = json.loads((work / "results-curves.json").read_text())["seeds"]["Transformer (fairseq)"]["1"]
    # stopped at its last validation (the runner stops it within STOP_CHECK_SECONDS of that checkpoint)
    assert (seed["stopped_at"], seed["validations"]) == (75, 3)
    # the report has the best of both, whichever metric stopped the run
    assert seed["best_update" if metric == "bleu" else "lowest_loss_update"] == 25
    assert seed["stopped_by"] == "patience (over the attempts, counted by the runner)"
    assert list((run_dir / "checkpoints").glob("checkpoint_*_75.pt"))  # saved before the stop
    assert (work / "commands.log").read_text().count("fairseq_cli.train") == 2
    assert f"no gain in validation {grid.METRIC_NAMES[metric]} in its last 2 validations" in log.read_text()
    # fairseq chose checkpoint_best.pt by the same metric
    checkpoint = torch.load(run_dir / "checkpoints" / "checkpoint_best.pt", weights_only=False)["cfg"]["checkpoint"]
    assert (checkpoint["best_checkpoint_metric"], checkpoint["maximize_best_checkpoint_metric"]) == (metric, metric == "bleu")


def test_patience_0_trains_to_the_cap_with_its_curve_resumed_or_not(tmp_path, corpus):
    """A fixed budget: no --patience, and a resumed run whose best validation is far behind it
    (here made unbeatable) is neither skipped nor stopped by the runner's count."""
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(CONVERGENCE.replace("max_update = 80", "max_update = 24").replace("patience = 2", "patience = 0")
                      .format(work=work, corpus=corpus))
    log = stopped_attempt_with_an_unbeatable_first_validation(config, work, 8, "bleu")

    assert experiment.main([str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    seed = json.loads((work / "results-curves.json").read_text())["seeds"]["Transformer (fairseq)"]["1"]
    assert (seed["stopped_at"], seed["stopped_by"], seed["validations"], seed["best_update"]) == (24, "max_update", 6, 4)
    commands = (work / "commands.log").read_text()
    assert commands.count("fairseq_cli.train") == 2 and "--patience" not in commands
    assert grid.CONVERGED not in log.read_text()
    assert "24 updates of 400 tokens each, validated every 4 updates" in (work / "results.md").read_text()


def test_validations_since_best_counts_after_the_first_of_equal_bests(tmp_path):
    run = grid.Grid([systems.lookup("transformer")], [1], grid.Settings("bin", "en", 1000), str(tmp_path)).runs[0]
    log = run.path("logs", "train.log")
    assert grid.validations_since_best(log) == 0  # no log yet
    write_log(run, [(200, 1.0, 7.0), (400, 3.0, 6.0), (600, 3.0, 5.9), (800, 2.0, 5.8)])
    assert grid.validations_since_best(log) == 2
    assert grid.validations_since_best(log, until=600) == 1  # a resume from update 600 does 800 again
    write_log(run, [(200, 1.0, 7.0), (400, 3.0, 6.0)])
    assert grid.validations_since_best(log) == 0


def test_the_runners_stop_is_read_from_the_logs_of_earlier_versions_and_of_either_metric(tmp_path):
    log = tmp_path / "train.log"
    for line in ("[experiment] converged: no gain in validation BLEU in its last 5 validations",  # earlier versions
                 "[experiment] converged: no gain in validation loss in its last 5 validations"):
        log.write_text("Stopping training due to num_updates: 400 >= max_update: 400\n" + line + "\n")
        assert curves.stop_reason(str(log), 8000) == "patience (over the attempts, counted by the runner)"


def test_validations_since_best_in_loss_count_after_its_lowest(tmp_path):
    """A BLEU peak early in training spends the patience counted in BLEU while the loss still
    falls; counted in loss, only the validations after the lowest loss count."""
    run = grid.Grid([systems.lookup("transformer")], [1], grid.Settings("bin", "en", 1000), str(tmp_path)).runs[0]
    write_log(run, [(200, 9.0, 7.0), (400, 3.0, 6.0), (600, 4.0, 5.5), (800, 5.0, 5.6), (1000, 6.0, 5.5)])
    log = run.path("logs", "train.log")
    assert grid.validations_since_best(log) == 4
    assert grid.validations_since_best(log, metric="loss") == 2  # after the first of the equal lowest
    assert grid.validations_since_best(log, until=600, metric="loss") == 0


@pytest.mark.parametrize("table, message", [
    ("[convergence]\npatience = 2", r"\[convergence\] needs validate_every"),
    ("[convergence]\nvalidate_every = 0\npatience = 2", "validate_every must be a positive integer"),
    ("[convergence]\nvalidate_every = 2\npatience = -1", r"patience must be an integer >= 0 \(validations"),
    ("[convergence]\nvalidate_every = 2\npatience = 2\nmetric = \"accuracy\"", "metric must be one of bleu, loss"),
])
def test_a_bad_convergence_table_is_refused(tmp_path, table, message):
    config = tmp_path / "grid.toml"
    config.write_text(f'systems = ["transformer"]\n{table}\n[corpus]\ndir = "x"\n')
    with pytest.raises(UsageError, match=message):
        load_config(str(config))
