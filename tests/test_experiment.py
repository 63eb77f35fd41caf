"""The experiment runner end to end on the tiny Bible: a 2-system x 2-seed grid completes and
its failing run is reported, a rerun skips every finished run, a stopped run resumes."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from fairseq_helpers import DECODING
from mlmha_fairseq.cli import demo as demo_cli, experiment
from mlmha_fairseq.experiments import corpora, grid, systems
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.experiments.config import load_config
from mlmha_fairseq.output_files import exclusive_folder

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "experiment")

GRID = """
work_dir = "{work}"
seeds = 2
systems = ["transformer", "MLMHA M-00", {{ name = "broken", arch = "transformer", args = ["--no-such-option"] }}]
max_update = 2
beam = 1
""" + DECODING + """
[corpus]
dir = "{corpus}"
"""


def test_the_runs_user_dir_is_the_package_folder():
    import mlmha_fairseq

    assert grid.USER_DIR == os.path.dirname(os.path.abspath(mlmha_fairseq.__file__))


def commands(work):
    return (work / "commands.log").read_text().splitlines()


def test_grid_completes_reports_its_failure_and_skips_finished_runs(tmp_path, capsys, corpus):
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(GRID.format(work=work, corpus=corpus))
    test_sentences = len(open(os.path.join(corpus, "text", "test.raw.en")).read().splitlines())
    arguments = [str(config), "--ar-trials", "50", "--bootstrap-samples", "20"]

    assert experiment.main(arguments) == 1  # the broken system fails, the others complete
    log = capsys.readouterr().err  # the runner's own log handler, as a user sees it
    assert "broken (seed 1) FAILED" in log and "2 run(s) failed" in log
    results = json.loads((work / "results.json").read_text())
    assert [(row["name"], row["seeds"]) for row in results["systems"]] == [
        ("Transformer (fairseq)", [1, 2]), ("MLMHA M-00", [1, 2])]
    assert results["systems"][1]["ar_seeds"] == [1, 2]
    for suffix in ("md", "tex", "png"):
        assert (work / f"results.{suffix}").stat().st_size > 0
    for run in ("transformer--fairseq/seed1", "mlmha-m-00/seed2"):
        scores = json.loads((work / "runs" / run / "scores.json").read_text())
        assert {"bleu", "chrf", "meteor"} <= set(scores)
        assert len((work / "runs" / run / "hypotheses.txt").read_text().splitlines()) == test_sentences
    first = commands(work)
    assert sum("fairseq_cli.train" in line for line in first) == 6  # 4 runs and 2 failed attempts
    assert sum("fairseq_cli.generate" in line for line in first) == 4

    assert experiment.main(arguments) == 1
    assert capsys.readouterr().err.count("finished earlier, skipped") == 4
    again = commands(work)[len(first):]
    assert len(again) == 2 and all("--no-such-option" in line for line in again)  # only the failed runs

    (work / "results.json").unlink()
    assert experiment.main(arguments + ["--report-only"]) == 0  # the table of what finished, no training
    assert len(commands(work)) == len(first) + 2
    assert [row["name"] for row in json.loads((work / "results.json").read_text())["systems"]] == [
        "Transformer (fairseq)", "MLMHA M-00"]


def test_parallel_runs_give_the_same_results_as_one_at_a_time(tmp_path, corpus):
    grids = {}
    for jobs in (1, 2):
        work, config = tmp_path / f"jobs{jobs}", tmp_path / f"jobs{jobs}.toml"
        config.write_text(f'work_dir = "{work}"\nsystems = ["transformer", "MLMHA M-00"]\nmax_update = 3\n'
                          f'beam = 1\n{DECODING}\n[corpus]\ndir = "{corpus}"\n')
        assert experiment.main([str(config), "--jobs", str(jobs), "--threads", "1", "--ar-trials", "10",
                                "--bootstrap-samples", "10"]) == 0
        trainings = [line for line in commands(work) if "fairseq_cli.train" in line]
        assert len(trainings) == 2 and all(" OMP_NUM_THREADS=1 " in line for line in trainings)
        grids[jobs] = {run: ((work / "runs" / run / "seed1" / "hypotheses.txt").read_text(),
                             json.loads((work / "runs" / run / "seed1" / "scores.json").read_text())["bleu"])
                       for run in ("transformer--fairseq", "mlmha-m-00")}
    assert grids[1] == grids[2]


def test_a_bf16_grid_trains_through_the_packages_trainer_in_bf16(tmp_path, corpus):
    """fairseq-train's command line turns ``--bf16`` into ``--tpu`` (which fails without
    torch_xla): with ``--bf16`` the runner trains through ``mlmha_fairseq.cli.train``."""
    work, config = tmp_path / "work", tmp_path / "bf16.toml"
    config.write_text(f'work_dir = "{work}"\nsystems = ["transformer"]\nmax_update = 2\nbeam = 1\n{DECODING}\n'
                      f'train_args = ["--bf16"]\n[corpus]\ndir = "{corpus}"\n')
    assert experiment.main([str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]) == 0
    trainings = [line for line in commands(work) if " -m mlmha_fairseq.cli.train " in line]
    assert len(trainings) == 1 and not any("fairseq_cli.train" in line for line in commands(work))
    log = (work / "runs" / "transformer--fairseq" / "seed1" / "logs" / "train.log").read_text()
    assert "'bf16': True" in log and "'tpu': False" in log


def _processes_mentioning(text: str):
    """PIDs of live processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if text.encode() in handle.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_killed_runner_takes_its_training_with_it_and_a_rerun_resumes_within_the_budget(tmp_path, corpus):
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{work}"\nsystems = ["transformer"]\nmax_update = 16\nbeam = 1\n{DECODING}\n'
                      f'save_interval_updates = 1\n[corpus]\ndir = "{corpus}"\n')
    run_dir = work / "runs" / "transformer--fairseq" / "seed1"
    process = subprocess.Popen([sys.executable, "-m", "mlmha_fairseq.cli.experiment", str(config)],
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while "Saved checkpoint" not in _text(run_dir / "logs" / "train.log"):
        assert process.poll() is None and time.time() < deadline, "training never saved a checkpoint"
        time.sleep(0.5)
    assert _processes_mentioning(str(run_dir / "checkpoints"))  # its fairseq-train
    os.kill(process.pid, signal.SIGKILL)  # the runner alone, mid-training
    process.wait()
    deadline = time.time() + 30
    while _processes_mentioning(str(run_dir / "checkpoints")):
        assert time.time() < deadline, "fairseq-train outlived the runner that started it"
        time.sleep(0.2)
    assert not (run_dir / "scores.json").exists()

    arguments = [str(config), "--ar-trials", "10", "--bootstrap-samples", "10"]
    assert experiment.main(arguments) == 0
    loaded = re.search(r"Loaded checkpoint .* @ (\d+) updates\)", _text(run_dir / "logs" / "train.log"))
    assert loaded, "the second attempt did not resume"
    # the second attempt counts from the checkpoint fairseq restored, not from the first's log
    assert grid.attempt_progress(str(run_dir / "logs" / "train.log")) == (int(loaded.group(1)), 16)
    assert int(loaded.group(1)) > 0
    assert grid.last_update(str(run_dir / "logs" / "train.log")) == 16
    assert (run_dir / "scores.json").exists()

    # stopped after training, before it was recorded: the checkpoint holds the budget already
    trainings = sum("fairseq_cli.train" in line for line in commands(work))
    (run_dir / "train.done").unlink()
    (run_dir / "scores.json").unlink()
    assert experiment.main(arguments) == 0
    assert sum("fairseq_cli.train" in line for line in commands(work)) == trainings
    assert grid.last_update(str(run_dir / "logs" / "train.log")) == 16


def test_a_work_directory_in_use_is_refused_naming_its_holder(tmp_path, corpus, capsys):
    work, config = tmp_path / "work", tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{work}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    with exclusive_folder(str(work), "work directory"):
        assert experiment.main([str(config)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"experiment: error: work directory {work} is in use by pid {os.getpid()} on "
                    f"{socket.gethostname()} since " + line.split(" since ")[-1].split(";")[0]
                    + "; wait for it to finish or stop it")
    assert not (work / "commands.log").exists()


def test_a_run_folder_in_use_fails_that_run_alone(tmp_path, corpus):
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path / "run"))
    runs = grid.Grid([run.system], [1], grid.Settings("no-data-bin", "en", 1), str(tmp_path))
    runs.runs = [run]
    with exclusive_folder(run.directory, "run folder"):
        failures = runs.execute([])
    assert [(failed, message.split(" is in use by ")[0]) for failed, message in failures] == [
        (run, f"run folder {run.directory}")]


def test_a_failure_raised_while_handling_another_names_both(tmp_path):
    """fairseq-train's answer to "Minimum loss scale reached" is a rerun of the step under its
    NanDetector, which can fail in turn: the one-line reason names the first error too."""
    script = ("try:\n    raise FloatingPointError('Minimum loss scale reached (0.0001).')\n"
              "except FloatingPointError:\n    next(iter([]))\n")
    with pytest.raises(grid.RunFailed) as failed:
        grid.run_command([sys.executable, "-c", script], str(tmp_path / "logs" / "train.log"), str(tmp_path))
    assert str(failed.value).splitlines()[0] == (
        f"{sys.executable} failed (1): StopIteration (while handling FloatingPointError: Minimum loss scale reached (0.0001).)")


BAD_CONFIGS = {
    'max_update = "twenty"': "max_update must be a positive integer, got 'twenty'",
    "max_update = 0": "max_update must be a positive integer, got 0",
    "work_dir = 5": "work_dir must be a folder name, got 5",
    'systems = "transformer"': "systems must be a list of systems, got 'transformer'",
    'model_args = "--dropout 0.1"': "model_args must be a list of command-line words, got '--dropout 0.1'",
    "seeds = [true]": "seeds must be a positive count or a list of distinct positive integers, got [True]",
    "seeds = [1, 1]": "seeds must be a positive count or a list of distinct positive integers, got [1, 1]",
    "max_tokens = 100\nbatch_size = 10": "give max_tokens or batch_size, not both",
    'systems = ["transformer", "transformer"]': "system(s) ['Transformer (fairseq)'] listed more than once",
    'systems = [{ name = "x", arch = "transformer", argz = [] }]': "system 'x': unknown key(s) ['argz']",
    'systems = [{ name = "x", arch = "transformer", base = "transformer" }]': "either base or arch",
    "[corpus]\ndirr = 'x'": "[corpus]: unknown key(s) ['dirr']",
    # two names, one run folder: the second would never train and get the first one's scores
    'systems = [{ name = "A B", base = "transformer" }, { name = "a-b", base = "transformer" }]':
        "systems 'A B' and 'a-b' would share the run folder runs/a-b",
    'systems = [{ name = "+++", base = "transformer" }]': "system name '+++' has no letter or digit",
    # a newline in a launcher value would be a line of the job script
    'launcher = { sbatch = { comment = "x\\nrm -rf ~" } }': "sbatch must be a table of further sbatch options "
                                                             "without control characters",
    'launcher = { partition = "debug\\u0007" }': "partition must be a Slurm partition (no control characters)",
    # data-parallel runs: every node the same number of ranks, one GPU per rank
    "launcher = { tasks_per_run = 3, nodes_per_run = 2 }": "tasks_per_run (3) must be a multiple of nodes_per_run (2)",
    "launcher = { tasks_per_run = 2, gpus_per_run = 1 }": "gpus_per_run must be 0 (CPUs) or 2 (one GPU per rank)",
    "launcher = { tasks_per_run = 0 }": "tasks_per_run must be a positive integer",
    # budget-matched baselines (experiments/matching.py)
    'matched = ["MLMHA M-00"]': "matched names 'MLMHA M-00', which is not one of the systems",
    'matched = ["transformer"]': "matched names the baseline 'Transformer (fairseq)'",
    "matched = 3": "matched must be true (every system but the baseline) or a list of system names",
    'matched = true\nmatched_by = "wider"': "matched_by must be one of ffn, layers",
    'matched_by = "layers"': "matched_by needs matched",
    # further comparisons the grid names
    'comparisons = [["mma"]]': "comparisons must be a list of [system, against] pairs",
    'systems = ["transformer", "mma"]\ncomparisons = [["mma", "dlcl"]]':
        "comparisons names 'DLCL', which is not one of the systems",
    'systems = ["transformer", "mma"]\ncomparisons = [["mma", "MMA"]]': "comparisons compares 'MMA' with itself",
    'systems = ["transformer", "mma"]\ncomparisons = [["mma", "transformer"]]':
        "is already tested: every system is compared with the baseline 'Transformer (fairseq)'",
    'systems = ["transformer", "mma", "dlcl"]\ncomparisons = [["mma", "dlcl"], ["DLCL", "MMA"]]':
        "comparisons gives the pair ['DLCL', 'MMA'] twice",
}


@pytest.mark.parametrize("text", sorted(BAD_CONFIGS))
def test_a_bad_config_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, text):
    """``text``: top-level keys, or a [corpus] table; the rest is a valid config."""
    top, _, corpus = text.partition("[corpus]")
    config = tmp_path / "grid.toml"
    config.write_text("\n".join([
        top if "work_dir" in top else f'work_dir = "{tmp_path / "work"}"\n{top}',
        "" if "systems" in top else 'systems = ["transformer"]',
        "[corpus]", corpus or "dir = 'corpus'"]) + "\n")
    assert experiment.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("experiment: error: ") and BAD_CONFIGS[text] in err[0], err
    assert not (tmp_path / "work").exists()


def test_comparisons_name_the_grids_systems_by_key_or_name(tmp_path):
    config = tmp_path / "grid.toml"
    config.write_text('systems = ["transformer", "mma", "dlcl"]\ncomparisons = [["dlcl", "MMA"]]\n'
                      '[corpus]\ndir = "corpus"\n')
    assert load_config(str(config)).comparisons == [("DLCL", "MMA")]


@pytest.mark.parametrize("option, value", [("--max-update", "0"), ("--seeds", "0"), ("--ar-trials", "-5"),
                                           ("--bootstrap-samples", "0")])
def test_a_count_of_zero_on_the_command_line_is_refused(tmp_path, capsys, option, value):
    """(``--bootstrap-samples 0`` wrote a bare NaN into results.json.)"""
    with pytest.raises(SystemExit) as exit_info:
        experiment.main([str(tmp_path / "grid.toml"), option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be at least 1, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize("entry, kind, message", [
    ("runs", "file", "runs is not a folder"), ("logs", "file", "logs is not a folder"),
    ("results.md", "folder", "results.md is a folder"), ("results-curves.png", "folder", "results-curves.png is a folder"),
])
def test_a_work_directory_entry_of_the_wrong_kind_is_refused_before_training(tmp_path, corpus, capsys, entry, kind,
                                                                               message):
    work = tmp_path / "work"
    work.mkdir()
    (work / entry).mkdir() if kind == "folder" else (work / entry).write_text("")
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{work}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    assert experiment.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]
    assert sorted(os.listdir(work)) == [entry]


def test_a_work_directory_that_cannot_be_created_is_refused_in_one_line(tmp_path, corpus, capsys):
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "/proc/mlmha-work"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    assert experiment.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("experiment: error: work directory /proc/mlmha-work cannot be created")


def test_a_launcher_without_slurm_is_refused_before_anything_runs(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n'
                      '[launcher]\npartition = "debug"\n')
    assert experiment.main([str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[launcher] submits the runs to Slurm, but sbatch is not on this machine's PATH" in err[0]
    assert not (tmp_path / "work").exists()


def test_a_comet_model_that_cannot_load_is_refused_before_training(tmp_path, corpus):
    """Where unbabel-comet cannot be imported (here: a ``comet`` package that fails to import,
    first on the path), the runner stops before building or training anything."""
    blocker = tmp_path / "site" / "comet"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('unbabel-comet is not installed here')\n")
    model = tmp_path / "comet-model"
    (model / "checkpoints").mkdir(parents=True)
    (model / "hparams.yaml").write_text("pretrained_model: xlm-roberta-large\n")
    (model / "checkpoints" / "model.ckpt").write_bytes(b"")
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.experiment", str(config), "--comet-model",
                             str(model)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"),
                                                                             os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--comet-model {model}: unbabel-comet is not installed" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "work" / "runs").exists()


def test_a_work_directory_that_is_a_file_is_refused(tmp_path, corpus, capsys):
    (tmp_path / "work").write_text("")
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    assert experiment.main([str(config)]) == 2
    assert f"work directory {tmp_path / 'work'} exists and is not a folder" in capsys.readouterr().err


def _text(path):
    return path.read_text() if path.exists() else ""


def test_report_only_before_any_baseline_run_fails_in_the_runners_own_log_format(tmp_path, corpus):
    """Run as a user runs it: importing fairseq sets the root logger to DEBUG, which must not
    override the runner's format and level; and asking for a table that cannot be written is an
    error, not exit status 0."""
    config = tmp_path / "grid.toml"
    config.write_text(f'work_dir = "{tmp_path / "work"}"\nsystems = ["transformer"]\n[corpus]\ndir = "{corpus}"\n')
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.experiment", str(config), "--report-only"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "no finished run of the baseline Transformer (fairseq): no table" in result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("[experiment ") for line in lines), result.stderr
    assert not (tmp_path / "work" / "results.json").exists()


def test_a_truncated_last_checkpoint_is_replaced_by_the_newest_update_checkpoint(tmp_path):
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path))
    os.makedirs(run.checkpoints)
    for name, content in (("checkpoint_last.pt", b"truncat"), ("checkpoint_1_5.pt", b"five"),
                          ("checkpoint_1_10.pt", b"ten")):
        (tmp_path / "checkpoints" / name).write_bytes(content)
    grid.usable_last_checkpoint(run)
    assert (tmp_path / "checkpoints" / "checkpoint_last.pt").read_bytes() == b"ten"


def test_a_corpus_built_with_the_same_settings_is_kept(tmp_path, monkeypatch):
    """A rerun must not rebuild the corpus its finished runs were trained on (and two grids
    sharing a work directory must not rewrite it under each other)."""
    built = []
    monkeypatch.setattr(corpora, "run_command", lambda command, *rest: built.append(command))
    corpus = tmp_path / "corpus"
    settings = (["es", "fr"], "en", str(corpus), 1000, 400, str(tmp_path))
    corpora.build_corpus(*settings)
    assert len(built) == 1  # no manifest: built
    corpus.mkdir()
    manifest = {"sources": ["es", "fr"], "target": "en", "bpe": {"merges_requested": 400},
                "train_selection": {"max_train_verses": 1000, "max_tokens_per_verse": 50}}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    corpora.build_corpus(*settings)
    assert len(built) == 1  # the same settings: kept
    for changed, difference in (((["es", "de"], *settings[1:]), "sources ['es', 'fr'] instead of ['es', 'de']"),
                                ((*settings[:3], 2000, *settings[4:]), "max_train_verses 1000 instead of 2000"),
                                ((*settings[:4], 800, settings[5]), "bpe.merges_requested 400 instead of 800")):
        with pytest.raises(UsageError, match=re.escape(f"corpus folder {corpus} holds a corpus built from other "
                                                       f"input or settings (")) as refused:
            corpora.build_corpus(*changed)  # it would replace the data the folder's runs were trained on
        assert difference in str(refused.value)
        corpora.build_corpus(*changed, rebuild=True)
    assert len(built) == 4  # other sources, training verses or merges: built again when asked to


GRID_SYSTEMS = ("systems", "matched")  # the keys that choose a grid's systems


@pytest.mark.parametrize("config", sorted(os.listdir(EXAMPLES)))
def test_shipped_configs_name_known_systems_and_reuse_the_demos_runs(config):
    """Each shipped grid loads and its systems are the package's, on the demo's corpus; a
    fixed-budget grid shares the demo grid's work directory and budget, so the baseline's seeds
    are trained once for all, unless it keeps every update checkpoint for an analysis over
    training (mlrf-fusion-weights.toml: its own budget and folder, the convergence grid's corpus
    folder); grids that share a work directory (convergence.toml, its two parts and
    convergence-matched.toml) share every setting but the systems (those listed and the matched
    baselines), so their runs are the same runs; a grid on another language pair has
    the demo's settings (its budget too, unless it keeps every update checkpoint:
    fp16-headroom.toml; or the converged grid's settings: convergence-de-en.toml) in a folder
    of its own; a multi-source grid is the demo's multi-source table (its systems, corpus and
    sentence batches) in a folder of its own."""
    demo = load_config(os.path.join(EXAMPLES, "demo.toml"))
    loaded = load_config(os.path.join(EXAMPLES, config))

    def sharing_its_folder():
        return [other for other in os.listdir(EXAMPLES) if other != config
                and load_config(os.path.join(EXAMPLES, other)).work_dir == loaded.work_dir]

    if loaded.systems[0].sources:  # multi-source.toml
        sources = tuple(loaded.corpus["sources"])
        assert loaded.systems == demo_cli.multi_source_systems(sources) and loaded.seeds == [1, 2, 3]
        assert loaded.settings["batch_size"] == demo_cli.SENTENCE_BATCHES.size
        assert {key: loaded.corpus[key] for key in ("train_verses", "bpe_merges")} == {
            key: value for key, value in demo_cli.QUICK.items() if key != "max_update"}
        assert loaded.settings["max_update"] == demo_cli.QUICK["max_update"]
        assert loaded.settings["beam"] == demo.settings["beam"]
        assert sharing_its_folder() == []
        return
    assert loaded.systems[0].name == "Transformer (fairseq)"
    if "model_args" in loaded.settings:  # another model shape (gpu-base.toml): its own corpus and folder
        assert loaded.settings["model_args"] != demo.settings.get("model_args")
        assert sharing_its_folder() == []
        return
    assert loaded.seeds == [1, 2, 3]
    keeps_every_checkpoint = "--keep-interval-updates" in loaded.settings.get("train_args", [])
    if loaded.corpus.get("sources") != demo.corpus["sources"]:  # another pair (de-en-400.toml): its own folder
        assert {key: value for key, value in loaded.corpus.items() if key not in ("sources", "dir")} == {
            key: value for key, value in demo.corpus.items() if key != "sources"}
        if "convergence" in loaded.settings:  # convergence-de-en.toml: the French grid's settings
            french = load_config(os.path.join(EXAMPLES, "convergence-matched.toml"))
            assert {k: v for k, v in loaded.settings.items() if k not in ("work_dir", "corpus")} == {
                k: v for k, v in french.settings.items() if k not in ("work_dir", "corpus")}
        else:
            for key in ("max_tokens", "beam") + (() if keeps_every_checkpoint else ("max_update",)):
                assert loaded.settings[key] == demo.settings[key], key
        assert sharing_its_folder() == []
        return
    assert {key: value for key, value in loaded.corpus.items() if key != "dir"} == demo.corpus
    for key in ("max_tokens", "beam"):
        assert loaded.settings[key] == demo.settings[key], key
    if "convergence" not in loaded.settings and not keeps_every_checkpoint:
        assert loaded.work_dir == demo.work_dir and loaded.settings["max_update"] == demo.settings["max_update"]
    for other in sorted(os.listdir(EXAMPLES)):
        sharing = load_config(os.path.join(EXAMPLES, other))
        if sharing.work_dir == loaded.work_dir and "convergence" in loaded.settings:
            assert {k: v for k, v in loaded.settings.items() if k not in GRID_SYSTEMS} == {
                k: v for k, v in sharing.settings.items() if k not in GRID_SYSTEMS}, other


@pytest.mark.parametrize("convergence, bound", [(None, ""), (grid.Convergence(200, 5), "at most "),
                                                (grid.Convergence(200, 0), "")])
def test_progress_of_a_resumed_run_counts_from_its_checkpoint_not_the_earlier_attempts_log(
        tmp_path, caplog, convergence, bound):
    """A run stopped at update 2,850 resumes from its checkpoint at 2,800: its progress line
    (and its Slurm job's status, the same count) says 2,800 from the attempt's start, before
    fairseq has loaded anything, then that attempt's updates, timed from 2,800. The time left
    is a bound only where runs may stop early."""
    settings = grid.Settings("bin", "en", 8000, convergence=convergence)
    runs = grid.Grid([systems.lookup("transformer")], [1], settings, str(tmp_path))
    run = runs.runs[0]
    log = run.path("logs", "train.log")
    grid.mark_attempt(log, 0)
    with open(log, "a") as handle:
        handle.write('{"epoch": 26, "num_updates": "2850"}\n')
    assert grid.attempt_progress(log) == (0, 2850)

    def progress(line: str) -> str:
        with open(log, "a") as handle:
            handle.write(line + "\n")
        caplog.clear()
        with caplog.at_level("INFO", logger=grid.logger.name):
            runs._progress(1, run, time.time() - 60)
        return caplog.records[-1].getMessage()

    grid.mark_attempt(log, 2800)
    line = progress("")
    assert "2800/8000 updates" in line and line.endswith("remaining unknown (training)")
    line = progress('{"epoch": 26, "num_updates": "2850"}')
    assert "2850/8000 updates" in line
    # 50 updates in 60 s (and the few ms since): the 5,150 left take 103 minutes
    assert re.search(rf"remaining {bound}~(\d+)m\d\ds \(training\)$", line).group(1) == "103"


def test_the_other_ranks_of_a_data_parallel_run_follow_only_this_attempt(tmp_path):
    """A data-parallel run's tasks > 0 run what the first task publishes for this start of the
    job (experiments/slurm.py): never an earlier start's command, and nothing once it says so."""
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path))
    settings = grid.Settings("data-bin", "en", 3, data_parallel=grid.DataParallel(2, 12345, "7.1"))
    earlier = grid.Settings("data-bin", "en", 3, data_parallel=grid.DataParallel(2, 12345, "7.0"))
    grid.publish_training(run, earlier, {"command": ["false"], "resumed_to_converge": False})
    assert grid.published_training(run, settings) == (False, None)
    grid.publish_training(run, settings, None)
    assert grid.published_training(run, settings) == (True, None)
    grid.follow_training(run, settings, 1, str(tmp_path), wait_seconds=0)  # returns: nothing to train
    assert not (tmp_path / "logs").exists()
