"""Training/validation curves from fairseq's JSON logs (MLRF paper Figure 4)."""
import csv
import logging

import pytest
from fairseq.logging.progress_bar import JsonProgressBar

from mlmha_fairseq.cli import training_curves
from mlmha_fairseq.evaluation.text_io import InputError
from mlmha_fairseq.evaluation.training_curves import log_curves

UPDATES_PER_EPOCH, LOG_INTERVAL = 4, 2


def fairseq_log(caplog, epochs):
    """Lines as fairseq-train --log-format json writes them, made by fairseq's own progress
    bar. ``epochs``: {epoch: (train accuracy per logged interval, epoch train accuracy, valid
    accuracy)}."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for epoch, (inner, train, valid) in sorted(epochs.items()):
            done = (epoch - 1) * UPDATES_PER_EPOCH
            bar = JsonProgressBar(range(UPDATES_PER_EPOCH), epoch=epoch, log_interval=LOG_INTERVAL)
            values = iter(inner)
            for step in bar:
                if (step + 1) % LOG_INTERVAL == 0:  # fairseq logs at num_updates % interval == 0
                    bar.log({"loss": 9.0, "accuracy": next(values), "num_updates": done + step + 1},
                            tag="train_inner", step=step + 1)
            end = epoch * UPDATES_PER_EPOCH
            bar.print({"loss": 5.0, "accuracy": train, "num_updates": end}, tag="train")
            JsonProgressBar([], epoch=epoch).print({"loss": 5.5 - epoch, "accuracy": valid, "num_updates": end},
                                                   tag="valid")
    return [f"2026-11-23 07:00:00 | INFO | {r.name} | {r.getMessage()}" for r in caplog.records]


EPOCHS = {1: ((10.0, 20.0), 15.0, 25.0), 2: ((30.0, 32.0), 31.0, 33.5)}


def test_curves_against_updates_and_epochs(caplog):
    lines = ["2026-11-23 06:59:59 | INFO | fairseq_cli.train | task: translation"]
    lines += fairseq_log(caplog, EPOCHS)
    assert {line.split(" | ")[2] for line in lines} >= {"train_inner", "train", "valid"}
    assert log_curves(lines) == {"train": [(2, 10.0), (4, 20.0), (6, 30.0), (8, 32.0)],
                                 "valid": [(4, 25.0), (8, 33.5)]}
    assert log_curves(lines, x_axis="epoch") == {"train": [(1, 15.0), (2, 31.0)],
                                                 "valid": [(1, 25.0), (2, 33.5)]}
    assert log_curves(lines, "loss", "epoch")["valid"] == [(1, 4.5), (2, 3.5)]


def test_a_resumed_run_replaces_the_repeated_points(caplog):
    lines = fairseq_log(caplog, EPOCHS) + fairseq_log(caplog, {2: ((40.0, 41.0), 40.5, 39.0)})
    curves = log_curves(lines)
    assert curves["train"] == [(2, 10.0), (4, 20.0), (6, 40.0), (8, 41.0)]
    assert curves["valid"] == [(4, 25.0), (8, 39.0)]


def test_a_log_without_the_statistic_is_refused():
    with pytest.raises(InputError, match="--report-accuracy"):
        log_curves(['2026-11-23 | INFO | train | {"epoch": 1, "train_loss": "3", "train_num_updates": "4"}'])


def test_cli_writes_table_and_figure(caplog, tmp_path, capsys):
    baseline, fused = tmp_path / "baseline.log", tmp_path / "fused.log"
    baseline.write_text("\n".join(fairseq_log(caplog, EPOCHS)) + "\n", encoding="utf-8")
    fused.write_text("\n".join(fairseq_log(caplog, {1: ((11.0, 21.0), 16.0, 27.0)})) + "\n",
                     encoding="utf-8")
    prefix = str(tmp_path / "out" / "accuracy")
    training_curves.main([str(baseline), str(fused), "--names", "Transformer", "Dec-SA",
                          "--output-prefix", prefix])
    with open(prefix + ".csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == (4 + 2) + (2 + 1)
    assert {"run": "Dec-SA", "split": "valid", "updates": "4.0", "accuracy": "27.0"} in rows
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0
    assert "Transformer\ttrain at 8 updates: 32\tvalid at 8 updates: 33.5" in capsys.readouterr().out
