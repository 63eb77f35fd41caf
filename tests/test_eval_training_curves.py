"""Training/validation curves from fairseq's JSON logs (MLRF paper Figure 4)."""
import csv
import logging

import pytest
from fairseq.logging.progress_bar import JsonProgressBar

from mlmha_fairseq.cli import training_curves
from mlmha_fairseq.evaluation.text_io import InputError
from mlmha_fairseq.evaluation.training_curves import epoch_curves

TRAIN_ACCURACY = {1: 20.5, 2: 31.25, 3: 40.0}
VALID_ACCURACY = {1: 25.0, 2: 33.5, 3: 38.75}


def fairseq_log(caplog, train=TRAIN_ACCURACY, valid=VALID_ACCURACY):
    """Lines as fairseq-train --log-format json writes them, made by fairseq's own progress
    bar: per-update train_inner lines and the train/valid epoch summaries."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for epoch in sorted(train):
            bar = JsonProgressBar(range(4), epoch=epoch, log_interval=2)
            for step in bar:
                bar.log({"loss": 9.0, "accuracy": 99.0}, tag="train_inner", step=step)
            bar.print({"loss": 5.0 - epoch, "accuracy": train[epoch]}, tag="train")
            JsonProgressBar([], epoch=epoch).print({"loss": 5.5 - epoch, "accuracy": valid[epoch]},
                                                   tag="valid")
    return [f"2026-11-23 07:00:00 | INFO | {r.name} | {r.getMessage()}" for r in caplog.records]


def test_epoch_curves_read_fairseqs_epoch_summaries(caplog):
    lines = ["2026-11-23 06:59:59 | INFO | fairseq_cli.train | task: translation"]
    lines += fairseq_log(caplog)
    assert any('"train_accuracy"' in line for line in lines)
    assert any(line.split(" | ")[2] == "train_inner" for line in lines)
    curves = epoch_curves(lines)
    assert curves == {"train": sorted(TRAIN_ACCURACY.items()), "valid": sorted(VALID_ACCURACY.items())}
    assert epoch_curves(lines, "loss")["valid"] == [(1, 4.5), (2, 3.5), (3, 2.5)]


def test_a_resumed_run_replaces_the_repeated_epoch(caplog):
    lines = fairseq_log(caplog) + fairseq_log(caplog, {3: 41.0}, {3: 39.0})
    assert epoch_curves(lines)["train"] == [(1, 20.5), (2, 31.25), (3, 41.0)]


def test_a_log_without_the_statistic_is_refused(caplog):
    with pytest.raises(InputError, match="--report-accuracy"):
        epoch_curves(["2026-11-23 | INFO | train | {\"epoch\": 1, \"train_loss\": \"3\"}"])


def test_cli_writes_table_and_figure(caplog, tmp_path, capsys):
    baseline, fused = tmp_path / "baseline.log", tmp_path / "fused.log"
    baseline.write_text("\n".join(fairseq_log(caplog)) + "\n", encoding="utf-8")
    fused.write_text("\n".join(fairseq_log(caplog, {1: 22.0, 2: 35.0}, {1: 27.0, 2: 36.0})) + "\n",
                     encoding="utf-8")
    prefix = str(tmp_path / "out" / "accuracy")
    training_curves.main([str(baseline), str(fused), "--names", "Transformer", "Both-FNN-SA",
                          "--output-prefix", prefix])
    with open(prefix + ".csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * 3 + 2 * 2
    assert {"run": "Both-FNN-SA", "split": "valid", "epoch": "2", "accuracy": "36.0"} in rows
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 0
    assert "Transformer\ttrain epoch 3: 40\tvalid epoch 3: 38.75" in capsys.readouterr().out
