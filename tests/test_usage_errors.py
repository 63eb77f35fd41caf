"""Bad input of issue 26, section 3, that ended in a traceback or in silence: each now ends
with one line naming the option or file and what to do, or (a checkpoint restored with other
options) a one-line warning. The catalogue is in docs/testing.md ("Bad-input catalogue")."""
import logging
import os
import re
import subprocess
import sys

import pytest

from fairseq_helpers import USER_DIR, build_model, run_fairseq, train_args
from mlmha_fairseq import output_files
from mlmha_fairseq.cli import build_corpus, demo
from mlmha_fairseq.cli import train as plugin_train
from mlmha_fairseq.errors import UsageError
from mlmha_fairseq.models.mma import parse_head_types


def one_line(stderr: str, prog: str) -> str:
    """The error line of a command stopped by a UsageError (status 1, no traceback)."""
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: ")
    return last


# --- outputs checked before any work: the demo and build_corpus --------------------------

@pytest.fixture
def no_work(monkeypatch):
    """The demo's work (corpus, training) must not start when an output is refused."""
    def started(*args, **kwargs):
        raise AssertionError("the demo started its work before it checked its outputs")

    monkeypatch.setattr(demo, "prepared_corpus", started)


def fake_corpus(folder):
    """The files the demo reads from a --corpus-dir before training."""
    for path in ("data-bin/dict.txt", "text/test.raw.fr", "text/test.raw.en"):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text("x\n")
    return str(folder)


def test_demo_refuses_a_results_file_that_is_a_folder_before_any_training(tmp_path, no_work):
    """Found only after all training before issue 26."""
    results = tmp_path / "demo" / "results.md"
    results.mkdir(parents=True)
    with pytest.raises(UsageError, match=rf"^output file {re.escape(str(results))} is a folder: move it away"):
        demo.main(["--work-dir", str(results.parent), "--corpus-dir", fake_corpus(tmp_path / "corpus")])
    assert sorted(os.listdir(results.parent)) == ["results.md"]  # nothing written


@pytest.mark.parametrize("work_dir, message", [
    ("a-file", "--work-dir {tmp}/a-file exists and is not a folder"),
    ("a-file/work", "--work-dir {tmp}/a-file/work cannot be created: {tmp}/a-file is a file, not a folder"),
    ("work-with-runs-file", "output folder {tmp}/work-with-runs-file/runs exists and is not a folder"),
    ("work-with-table-folder", "output file {tmp}/work-with-table-folder/results-fr--en.png is a folder"),
])
def test_demo_refuses_clashing_output_paths_before_any_work(tmp_path, no_work, work_dir, message):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "work-with-runs-file").mkdir()
    (tmp_path / "work-with-runs-file" / "runs").write_text("")
    (tmp_path / "work-with-table-folder" / "results-fr--en.png").mkdir(parents=True)
    with pytest.raises(UsageError) as error:
        demo.main(["--work-dir", str(tmp_path / work_dir), "--corpus-dir", fake_corpus(tmp_path / "corpus")])
    assert str(error.value).startswith(message.format(tmp=tmp_path))


def test_demo_refuses_an_unwritable_work_directory(tmp_path, no_work, monkeypatch):
    """Simulated: the tests may run as root, which can write anywhere."""
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(output_files.os, "access",
                        lambda path, mode: access(path, mode) and os.path.realpath(path) != str(locked))
    with pytest.raises(UsageError, match=rf"^--work-dir {locked}/work cannot be created: {locked} is not writable"):
        demo.main(["--work-dir", str(locked / "work"), "--corpus-dir", fake_corpus(tmp_path / "corpus")])


def test_demo_checks_the_second_tables_corpus_before_the_first_table_trains(tmp_path, no_work):
    with pytest.raises(UsageError, match=rf"^--multi-source-corpus-dir {tmp_path}/typo has no data-bin/dict\.txt"):
        demo.main(["--full", "--work-dir", str(tmp_path / "work"), "--corpus-dir", fake_corpus(tmp_path / "corpus"),
                   "--multi-source-corpus-dir", str(tmp_path / "typo")])


def test_demo_output_clash_is_one_line_and_status_1(tmp_path):
    (tmp_path / "work").write_text("")
    result = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.demo", "--work-dir", str(tmp_path / "work")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert one_line(result.stderr, "demo.py").endswith(f"--work-dir {tmp_path}/work exists and is not a folder: "
                                                       "move it away or choose another path")


@pytest.mark.parametrize("make, out_dir, extra, message", [
    ("file", "out", [], "--out-dir {tmp}/out exists and is not a folder"),
    ("file", "out/corpus", [], "--out-dir {tmp}/out/corpus cannot be created: {tmp}/out is a file"),
    ("data-bin file", "out", [], "output folder {tmp}/out/data-bin exists and is not a folder"),
    ("bpe.codes folder", "out", [], "output file {tmp}/out/bpe.codes is a folder"),
    ("file", "corpus", ["--cache-dir", "{tmp}/out/cache"],
     "--cache-dir {tmp}/out/cache cannot be created: {tmp}/out is a file"),
])
def test_build_corpus_refuses_clashing_outputs_before_any_work(tmp_path, capsys, make, out_dir, extra, message):
    """Before issue 26 these ended in a traceback (NotADirectoryError, IsADirectoryError), some
    after the database was read and tokenized. --bible-db names no file, so that any work
    started ends at once with another message."""
    if make == "file":
        (tmp_path / "out").write_text("")
    elif make == "data-bin file":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "data-bin").write_text("")
    else:
        (tmp_path / "out" / "bpe.codes").mkdir(parents=True)
    database = [] if extra else ["--bible-db", str(tmp_path / "no.db")]
    argv = ["--sources", "fr", "--target", "en", "--out-dir", str(tmp_path / out_dir), "--quiet", *database,
            *[value.format(tmp=tmp_path) for value in extra]]
    assert build_corpus.main(argv) == build_corpus.EXIT_ERROR
    line = capsys.readouterr().err.strip()
    assert line.startswith("build_corpus: error: " + message.format(tmp=tmp_path)) and "\n" not in line


# --- --max-update 0 ---------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--max-update", "0"), ("--max-update", "-5"), ("--beam", "0"),
                                           ("--seeds", "0")])
def test_demo_refuses_non_positive_counts(option, value, capsys):
    """``--max-update 0`` silently trained the default 400 updates (0 read as "not given")."""
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args([option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: must be at least 1, got {value}" in capsys.readouterr().err


# --- mechanisms: typed options, conflicts ---------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--mlmha-variant", "M-00"],
     "--mlmha-variant M-00 needs --decoder-cross-attention multi-layer, which is off"),
    (["--mlrf-encoder-fusion", "fnn", "--layer-aggregation", "s-agg"],
     "the encoder output 'encoder_out' is written by several mechanisms (--layer-aggregation s-agg, "
     "--mlrf-encoder-fusion fnn): choose one"),
    (["--layer-aggregation", "transparent", "--decoder-cross-attention", "multi-layer"],
     "the decoder cross-attention slot of layer 1 is claimed by several mechanisms "
     "(--decoder-cross-attention multi-layer, --layer-aggregation transparent): choose one"),
])
def test_fairseq_train_refuses_mechanism_options_in_one_line(data_bin, tmp_path, extra, message):
    """Before issue 26: a plain model trained without a word (the first), a ValueError
    traceback (the others)."""
    result = run_fairseq("train", *train_args(data_bin, tmp_path, "slot_transformer", *extra), check=False)
    assert result.returncode == 1
    assert one_line(result.stderr, "train.py").startswith(f"train.py: error: {message}")
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("extra, options", [
    (["--mlrf-encoder-fusion", "sa", "--layer-aggregation", "iter-c-agg"],
     "--layer-aggregation iter-c-agg, --mlrf-encoder-fusion sa"),
    (["--layer-aggregation", "transparent", "--decoder-cross-attention", "multi-layer"],
     "--decoder-cross-attention multi-layer, --layer-aggregation transparent"),
    (["--encoder-self-attention", "mixed", "--dc-encoder-layers", "all"],
     "--encoder-self-attention mixed, --dc-encoder-layers all"),
    (["--dlcl-encoder", "--layer-aggregation", "c-agg"], "--layer-aggregation c-agg, --dlcl-encoder"),
])
def test_conflicting_mechanisms_are_usage_errors_naming_both_options(extra, options):
    with pytest.raises(UsageError, match=r"(claimed by|written by) several mechanisms") as error:
        build_model("slot_transformer", *extra)
    assert f"({options}): choose one" in str(error.value)


@pytest.mark.parametrize("spec, expected", [
    ("global,local", ("G", "L")), ("Forward, BACKWARD", ("F", "B")), ("g,local", ("G", "L")),
])
def test_mma_heads_accept_the_words_the_message_lists(spec, expected):
    """``--mma-heads global,local`` was refused while the message listed those words."""
    assert parse_head_types(spec, 2) == expected
    model = build_model("slot_transformer", "--encoder-self-attention", "mixed", "--encoder-attention-heads", "2",
                        "--mma-heads", spec)
    assert model.encoder.layers[0].self_attn.head_types == expected


def test_an_unknown_mma_head_lists_both_spellings():
    with pytest.raises(UsageError, match=r"unknown head type\(s\) \['glob'\]; give a comma-separated list of "
                                         r"G, L, F, B or global, local, forward, backward$"):
        parse_head_types("glob,L", 2)


# --- python -m mlmha_fairseq.cli.train from any directory ---------------------------------

def test_plugin_train_runs_from_another_directory(data_bin, tmp_path):
    """fairseq refused both --user-dir forms outside the repository root: "module name
    (mlmha_fairseq) is not globally unique"."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    readme_form = ["mlmha_fairseq" if arg == USER_DIR else arg
                   for arg in train_args(data_bin, tmp_path / "ckpt", "slot_transformer", max_update=1)]
    relative = run_fairseq("train", *readme_form, module="mlmha_fairseq.cli.train", cwd=elsewhere, check=False)
    assert relative.returncode == 0, relative.stderr[-2000:]
    assert (tmp_path / "ckpt" / "checkpoint_last.pt").exists()
    absolute = subprocess.run([sys.executable, "-m", "mlmha_fairseq.cli.train", "--user-dir", USER_DIR, "--arch",
                               "slot_transformer", "--help"], capture_output=True, text=True, cwd=elsewhere)
    assert absolute.returncode == 0 and "not globally unique" not in absolute.stderr, absolute.stderr[-2000:]


def test_plugin_train_refuses_another_copy_of_the_package(tmp_path):
    import mlmha_fairseq

    package = mlmha_fairseq.__path__[0]
    argv = ["data", "--user-dir", "mlmha_fairseq", "--user-dir=x/mlmha_fairseq"]
    assert plugin_train.user_dir_of_this_package(argv) == ["data", "--user-dir", package, f"--user-dir={package}"]
    assert plugin_train.user_dir_of_this_package(["--user-dir", "my_plugin"]) == ["--user-dir", "my_plugin"]
    copy = tmp_path / "mlmha_fairseq"
    copy.mkdir()
    with pytest.raises(UsageError, match=rf"^--user-dir {copy} is another copy of mlmha_fairseq than the one running"):
        plugin_train.user_dir_of_this_package(["--user-dir", str(copy)])


# --- --restore-file with other options --------------------------------------------------

def test_restoring_a_checkpoint_with_other_options_warns_in_one_line(data_bin, tmp_path):
    """An M-10 checkpoint loaded silently into an M-00 model (same shapes, another meaning)."""
    mlmha = ["--decoder-cross-attention", "multi-layer", "--mlmha-variant"]
    run_fairseq("train", *train_args(data_bin, tmp_path / "m10", "slot_transformer", *mlmha, "M-10", max_update=1))
    restored = run_fairseq("train", *train_args(data_bin, tmp_path / "m00", "slot_transformer", *mlmha, "M-00",
                                                max_update=2),
                           "--restore-file", tmp_path / "m10" / "checkpoint_last.pt")
    lines = [line for line in (restored.stdout + restored.stderr).splitlines() if "other options" in line]
    assert len(lines) == 1 and "| WARNING |" in lines[0]
    assert lines[0].endswith("the checkpoint was trained with other options of this package: --mlmha-variant M-00 "
                             "(checkpoint: M-10); its weights are loaded into the model these options build, which "
                             "may read them differently (to resume the checkpoint's training, give its values)")
    assert "num_updates 2" in restored.stdout + restored.stderr  # restored at update 1, trained on


def test_the_warning_names_what_gives_the_weights_their_meaning_only(caplog):
    """Not the same options, nor an inference-only ablation (``--model-overrides
    "{'mlmha_mask_encoder_layer': 2}"``); a state dict without the record (older checkpoints)
    loads silently too."""
    mlmha = ["--decoder-cross-attention", "multi-layer", "--mlmha-variant"]
    trained = build_model("slot_transformer", *mlmha, "M-10").state_dict()
    with caplog.at_level(logging.WARNING):
        build_model("slot_transformer", *mlmha, "M-10").load_state_dict(trained)
        build_model("slot_transformer", *mlmha, "M-10", "--mlmha-mask-encoder-layer", "2").load_state_dict(trained)
        build_model("slot_transformer", *mlmha, "M-00").load_state_dict(dict(trained))  # no metadata
        assert not [record for record in caplog.records if "other options" in record.getMessage()]
        build_model("slot_transformer", *mlmha, "M-00").load_state_dict(trained)
    assert [record.getMessage() for record in caplog.records if "other options" in record.getMessage()] == [
        "the checkpoint was trained with other options of this package: --mlmha-variant M-00 (checkpoint: M-10); "
        "its weights are loaded into the model these options build, which may read them differently (to resume "
        "the checkpoint's training, give its values)"]
