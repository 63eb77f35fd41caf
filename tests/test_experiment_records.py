"""The experiment runner's run records (``--records DIR``) and its ``--seeds`` ranges: a grid
split over two "machines" (work directories that share nothing but the records folder) reports
every run on a third one that trained nothing; a record of another corpus is refused."""
import json
import os
import shutil

import pytest

from fairseq_helpers import DECODING
from mlmha_fairseq.cli import experiment

GRID = """
work_dir = "{work}"
seeds = 2
systems = ["transformer", "MLMHA M-00"]
max_update = 4
beam = 1
""" + DECODING + """
[convergence]
validate_every = 2
patience = 5
[corpus]
dir = "{corpus}"
"""
FAST = ["--ar-trials", "20", "--bootstrap-samples", "10", "--jobs", "1", "--threads", "1"]
RUNS = ("transformer--fairseq", "mlmha-m-00")


def trainings(work):
    return sum("fairseq_cli.train" in line for line in (work / "commands.log").read_text().splitlines())


@pytest.fixture(scope="module")
def grid_config(tmp_path_factory, corpus):
    config = tmp_path_factory.mktemp("grid") / "grid.toml"
    config.write_text(GRID.format(work="unused", corpus=corpus))
    return config


@pytest.fixture(scope="module")
def seed1_once(tmp_path_factory, grid_config):
    """Seed 1 of the grid trained once, with its records: (work, records)."""
    root = tmp_path_factory.mktemp("seed1")
    records, work = root / "records", root / "work"
    records.mkdir()
    assert experiment.main([str(grid_config), "--work-dir", str(work), "--seeds", "1-1", "--records", str(records),
                            *FAST]) == 0
    return work, records


@pytest.fixture
def seed1_trained(tmp_path, seed1_once):
    """A copy of :func:`seed1_once`'s work directory and records for this test to change."""
    copies = tmp_path / "work", tmp_path / "records"
    for trained, copy in zip(seed1_once, copies):
        shutil.copytree(trained, copy, symlinks=True)
    return copies


def test_a_grid_split_over_two_machines_reports_every_recorded_run_on_a_third(tmp_path, grid_config, seed1_trained,
                                                                              capsys):
    machine_a, records = seed1_trained  # machine a trained seed 1 into the records
    machines = {"a": machine_a, "b": tmp_path / "b", "c": tmp_path / "c"}
    assert experiment.main([str(grid_config), "--work-dir", str(machines["b"]), "--seeds", "2-2",
                            "--records", str(records), *FAST]) == 0
    for machine in ("a", "b"):
        assert trainings(machines[machine]) == 2  # its own seed of both systems, nothing restored
    for run in RUNS:
        for seed, machine in ((1, machines["a"]), (2, machines["b"])):
            trained, recorded = machine / "runs" / run / f"seed{seed}", records / run / f"seed{seed}"
            for name in ("hypotheses.txt", "scores.json"):
                assert (recorded / name).read_bytes() == (trained / name).read_bytes()
            # the log names no path of the machine: fairseq's own names the venv and --user-dir
            here, log = os.path.join(os.getcwd(), "").encode(), (trained / "logs/train.log").read_bytes()
            assert here in log and here not in (recorded / "logs/train.log").read_bytes()
            assert (recorded / "logs/train.log").read_bytes() == log.replace(here, b"")
        assert not (records / run / "seed2").joinpath("checkpoints").exists()  # records hold no checkpoints

    capsys.readouterr()
    assert experiment.main([str(grid_config), "--work-dir", str(machines["c"]), "--records", str(records),
                            "--report-only", *FAST]) == 0
    assert "4 run(s) restored from the records" in capsys.readouterr().err
    assert not (machines["c"] / "commands.log").exists()  # nothing trained or decoded
    results = json.loads((machines["c"] / "results.json").read_text())
    assert [(row["name"], row["seeds"]) for row in results["systems"]] == [
        ("Transformer (fairseq)", [1, 2]), ("MLMHA M-00", [1, 2])]
    assert results["systems"][1]["ar_seeds"] == [1, 2]  # the replicates' test over both machines' runs
    for row, run in zip(results["systems"], RUNS):
        trained = [json.loads((machines[m] / "runs" / run / f"seed{s}" / "scores.json").read_text())["bleu"]
                   for m, s in (("a", 1), ("b", 2))]
        assert row["scores"]["BLEU"] == pytest.approx(trained)
    curves = json.loads((machines["c"] / "results-curves.json").read_text())  # from the restored logs
    assert sorted(curves["seeds"]["MLMHA M-00"]) == ["1", "2"]
    assert all(seed["stopped_at"] == 4 for seed in curves["seeds"]["MLMHA M-00"].values())

    # the whole grid run on machine c trains nothing: every run is finished there now
    assert experiment.main([str(grid_config), "--work-dir", str(machines["c"]), "--records", str(records), *FAST]) == 0
    assert capsys.readouterr().err.count("finished earlier, skipped") == 4
    assert not (machines["c"] / "commands.log").exists()


def test_a_half_trained_run_is_replaced_by_its_record(grid_config, seed1_trained):
    work, records = seed1_trained
    args = [str(grid_config), "--work-dir", str(work), "--seeds", "1-1", *FAST]
    run = work / "runs" / "transformer--fairseq" / "seed1"
    recorded_log = (records / "transformer--fairseq" / "seed1" / "logs" / "train.log").read_bytes()
    (run / "scores.json").unlink()  # as if it had been stopped before its test scores
    (run / "logs" / "train.log").write_text("a half-written attempt\n")
    assert experiment.main(args + ["--records", str(records)]) == 0
    assert (run / "logs" / "train.log").read_bytes() == recorded_log
    assert trainings(work) == 2  # the first round's two runs, nothing more


def test_a_record_of_another_corpus_is_refused_in_one_line_before_anything_is_copied(tmp_path, grid_config,
                                                                                     seed1_trained, capsys):
    _, records = seed1_trained
    about = records / "mlmha-m-00" / "seed1" / "record.json"
    about.write_text(json.dumps({"references_sha256": "0" * 64}))
    other = tmp_path / "other"
    capsys.readouterr()
    assert experiment.main([str(grid_config), "--work-dir", str(other), "--seeds", "1-1", "--records", str(records),
                            "--report-only", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("experiment: error: record ") and "other test references" in err[-1], err
    assert not (other / "runs" / "transformer--fairseq" / "seed1" / "scores.json").exists()
    about.unlink()
    assert experiment.main([str(grid_config), "--work-dir", str(other), "--records", str(records),
                            "--report-only", *FAST]) == 2
    assert "has no readable record.json" in capsys.readouterr().err


def test_a_missing_records_folder_is_refused_before_anything_is_written(tmp_path, grid_config, capsys):
    work = tmp_path / "work"
    assert experiment.main([str(grid_config), "--work-dir", str(work), "--records", str(tmp_path / "none")]) == 2
    assert f"--records {tmp_path / 'none'} is not a folder" in capsys.readouterr().err
    assert not work.exists()


@pytest.mark.parametrize("text, seeds", [("3", 3), ("2-2", [2]), ("2,3", [2, 3]), ("1-3", [1, 2, 3]),
                                         ("1,3-4", [1, 3, 4])])
def test_seeds_are_a_count_or_slurm_style_ranges(text, seeds):
    assert experiment.parse_args(["grid.toml", "--seeds", text]).seeds == seeds


@pytest.mark.parametrize("text, message", [("3-2", "range '3-2' runs backwards"), ("2,2", "seeds must be distinct"),
                                           ("1-2,2", "seeds must be distinct"), ("0-1", "must be at least 1, got 0"),
                                           ("2,x", "invalid integer: 'x'")])
def test_bad_seed_ranges_are_refused_in_one_line(text, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        experiment.parse_args(["grid.toml", "--seeds", text])
    assert exit_info.value.code == 2
    assert f"argument --seeds: {message}" in capsys.readouterr().err



def test_runs_and_records_that_do_not_match_the_grid_are_refused_naming_them(tmp_path, grid_config, seed1_trained,
                                                                             capsys):
    """A finished run rerun with other settings was skipped and labelled with the new ones; a
    truncated record was restored and failed later without its name; a symbolic link in the
    records folder was followed for writing."""
    work, records = seed1_trained
    args = [str(grid_config), "--work-dir", str(work), "--seeds", "1-1", "--records", str(records), *FAST]

    assert experiment.main(args + ["--max-update", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs/transformer--fairseq/seed1 was trained with max_update = 4, this grid has 6" in err[0]
    assert trainings(work) == 2  # nothing trained again

    recorded = records / "mlmha-m-00" / "seed1"
    lines = (recorded / "hypotheses.txt").read_text().splitlines(keepends=True)
    (recorded / "hypotheses.txt").write_text("".join(lines[:3]))
    other = tmp_path / "other"
    assert experiment.main([str(grid_config), "--work-dir", str(other), "--records", str(records), "--seeds", "1-1",
                            "--report-only", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"experiment: error: record {recorded}: hypotheses.txt has 3 lines"), err
    assert not (other / "runs").exists() or not list((other / "runs").rglob("scores.json"))
    (recorded / "hypotheses.txt").write_text("".join(lines))
    scores = (recorded / "scores.json").read_text()
    (recorded / "scores.json").write_text(scores[:20])
    assert experiment.main([str(grid_config), "--work-dir", str(other), "--records", str(records), "--seeds", "1-1",
                            "--report-only", *FAST]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"experiment: error: record {recorded}: scores.json is truncated")
    (recorded / "scores.json").write_text(scores)

    outside = tmp_path / "outside"
    outside.mkdir()
    linked = records / "transformer--fairseq"
    linked.rename(outside / "transformer--fairseq")
    linked.symlink_to(outside / "transformer--fairseq")
    assert experiment.main(args + ["--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"experiment: error: records folder {records}: {linked} is a symbolic link"), err

