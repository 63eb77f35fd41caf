"""A checkpoint whose stored options carry code (a string that fairseq passes to eval() while it
builds the model) is refused, with one line naming the option, by every tool that loads a
checkpoint; the code never runs. Each payload would create a sentinel file if it ran."""
import argparse
import os
import pathlib
import pickle
import re
import shutil

import fairseq
import pytest
import torch

from fairseq_helpers import USER_DIR, run_fairseq, train_args
from mlmha_fairseq.cli import (
    aif_dependency, attention_stats, dc_diversity, dump_attention, mlrf_hop_weights, multi_source_attention, numerics,
    probe,
)
from mlmha_fairseq.experiments import grid, systems
from mlmha_fairseq import compat
from mlmha_fairseq.compat import REFUSED, CheckedNamespace, UnsafeCheckpointError, literal_value, refusal
from mlmha_fairseq.evaluation.model_loading import load_model
from mlmha_fairseq.evaluation.text_io import InputError
from test_bad_input import _RunsCommandWhenUnpickled
from test_eval_bad_input import cli_error

# where a payload reaches fairseq's eval() from these models' options: under fairseq's own names
# (copied into cfg.encoder/cfg.decoder.xformers_att_config before evaluation) and as a sub-dict
REACHABLE = ("adaptive_softmax_cutoff", "encoder_xformers_att_config", "decoder_xformers_att_config",
             "decoder.xformers_att_config")


def payload(sentinel) -> str:
    return f"__import__('os').system('touch {sentinel}') or [5]"


@pytest.fixture(scope="module")
def trained(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("trained")
    run_fairseq("train", *train_args(data_bin, save_dir, "slot_transformer", max_update=1))
    return save_dir / "checkpoint_last.pt"


def planted(checkpoint, field, tmp_path, as_dict=False):
    """A copy of ``checkpoint`` whose stored model option ``field`` is a payload, and the
    sentinel file the payload would create. ``as_dict``: the options stored as a dict, as
    fairseq-hydra-train stores them."""
    sentinel = tmp_path / f"code-ran-{field}"
    state = torch.load(checkpoint, weights_only=False)
    model = state["cfg"]["model"]
    if "." in field:  # a sub-dict: decoder = {"xformers_att_config": ...}
        section, name = field.split(".")
        setattr(model, section, {name: payload(sentinel)})
    else:
        setattr(model, field, payload(sentinel))
    if as_dict:
        state["cfg"]["model"] = vars(model)
    malicious = tmp_path / f"malicious-{field}.pt"
    torch.save(state, malicious)
    return malicious, sentinel


def named(field: str) -> str:
    """How a refusal names ``field``: the sub-dict's key follows its section's name."""
    return f"{field.split('.')[-1]}="


def assert_refused(stderr: str, field: str):
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr
    assert len(lines) == 1 or not lines[-1].startswith(" ")
    assert named(field) in lines[-1] and REFUSED in lines[-1]


@pytest.mark.parametrize("field", REACHABLE)
@pytest.mark.parametrize("tool", ["generate", "interactive"])
def test_fairseq_tools_refuse_a_checkpoint_with_code_in_an_option(trained, data_bin, tmp_path, field, tool):
    malicious, sentinel = planted(trained, field, tmp_path)
    result = run_fairseq(tool, data_bin, "--user-dir", USER_DIR, "--path", malicious, "--cpu", "--beam", "1",
                         "--source-lang", "src", "--target-lang", "tgt", input="w1 w2 w3\n", check=False)
    assert result.returncode != 0
    assert_refused(result.stderr, field)
    assert not sentinel.exists()


def test_the_same_checkpoint_without_the_payload_still_loads(trained, data_bin):
    """The check refuses code, not the options fairseq stores: a literal value loads."""
    model, _task = load_model(str(trained), str(data_bin))
    assert model.decoder.adaptive_softmax is None


TOOLS = {  # each of the package's tools that loads a checkpoint, with the least it needs
    "attention_stats": (attention_stats.main, ["--split", "test", "--output-prefix", "{out}"]),
    "dump_attention": (dump_attention.main, ["--input", "{source}", "--no-plots", "--output-dir", "{out}"]),
    "mlrf_hop_weights": (mlrf_hop_weights.main, ["--output-prefix", "{out}"]),
    "dc_diversity": (dc_diversity.main, ["--split", "test", "--output-prefix", "{out}"]),
    "aif_dependency": (aif_dependency.main, ["--split", "test", "--output-prefix", "{out}"]),
    "multi_source_attention": (multi_source_attention.main, ["--no-plots", "--output-dir", "{out}"]),
    "probe": (probe.main, ["--tasks", "{probing}", "--output-prefix", "{out}"]),
    "numerics": (numerics.main, ["--output-prefix", "{out}"]),
}


@pytest.mark.parametrize("as_dict", [False, True], ids=["namespace", "hydra-dict"])
@pytest.mark.parametrize("field", REACHABLE)
@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_package_tools_refuse_a_checkpoint_with_code_in_an_option(trained, data_bin, tmp_path, capsys, tool, field,
                                                                   as_dict):
    malicious, sentinel = planted(trained, field, tmp_path, as_dict)
    files = {"source": tmp_path / "source.txt", "probing": tmp_path / "probing.txt", "out": tmp_path / "out"}
    files["source"].write_text("w1 w2 w3\n")
    files["probing"].write_text("".join(f"{split}\t{label}\tw1 w{i}\n" for i, (split, label) in
                                        enumerate([(s, l) for s in ("tr", "va", "te") for l in "ab"])))
    main, options = TOOLS[tool]
    line = cli_error(main, [malicious, "--data-bin", data_bin, *[o.format(**files) for o in options]], capsys)
    assert named(field) in line and REFUSED in line and str(malicious) in line
    assert not sentinel.exists()
    assert not list(tmp_path.glob("out*"))


def test_options_stored_as_a_dict_are_checked_before_the_model_is_built(trained, data_bin, tmp_path):
    malicious, sentinel = planted(trained, "adaptive_softmax_cutoff", tmp_path, as_dict=True)
    with pytest.raises(InputError, match=r"checkpoint option cfg\.model\.adaptive_softmax_cutoff="):
        load_model(str(malicious), str(data_bin))
    assert not sentinel.exists()


@pytest.mark.parametrize("value", [
    "__import__('os').system('true')", "exec('1')", "open('x', 'w')", "[x for x in ()]", "lambda: 0",
    "f'{1}'", "f'{0:999999999}'", "[5] + foo()", "(x := 1)", "'%9999999999d' % 0", "2 ** 10 ** 10", "1 << 10 ** 10",
    "[0 for a in 'abcdefgh' for b in 'abcdefgh']", "sys.modules['os']", "{1: 2} * 3", "{1} * 2", "[1] * 2.0", "{**x}", "(os.system\n('x'))", " \t__import__('os')",
])
def test_code_is_refused_whatever_it_is_stored_under(value):
    assert refusal(value) == REFUSED
    with pytest.raises(compat.NotALiteral):
        literal_value(value)


@pytest.mark.parametrize("value", ["[0] * 10000000000", "'a' * 100000", "(1,) * 70000", "[0] * 60000 + [0] * 60000",
                                   "10000000000 * [[0]]"])
def test_a_literal_that_would_exhaust_memory_is_refused(value):
    assert refusal(value).startswith("is a literal that would build a value of")
    with pytest.raises(UnsafeCheckpointError, match="is a literal that would build a value of"):
        fairseq.utils.eval_str_list(value)


@pytest.mark.parametrize("value", [
    "5000,20000", "[5000, 20000]", "(0.9, 0.98)", "(0.9,0.98)", "{'dropout': 0.1}", '{"name": "blocksparse"}',
    "[(512, 3)] * 20", "[(512, 3)] * 9 + [(1024, 3)] * 4", "[(512, 10, 5)] + [(512, 3, 2)] * 4", "-1", "True",
    "None", "1e-3", "1e-30,1e-3", "{}", "[]", "False",
])
def test_literals_evaluate_as_eval_does(value):
    """The values fairseq documents for the options it evaluates (defaults and examples of its
    help), through the literal-only parsers: what fairseq's eval() gives."""
    expected = eval(value)  # noqa: S307 (the test's own literals)
    assert refusal(value) is None
    assert literal_value(value) == expected
    assert fairseq.utils.eval_str_dict(value) == expected
    assert fairseq.utils.eval_bool(value) == bool(expected)


@pytest.mark.parametrize("value", ["relu", "transformer_wmt_en_de", "data-bin/wmt14.en-de", "M-10", "s1,s2",
                                   "not python ((", "/abs/path/x.pt", "checkpoints/run.1", ""])
def test_names_and_paths_stay_in_a_checkpoint(value):
    """A name or a path is looked up, never run: a checkpoint may store it (an architecture, a
    data folder, a preset). fairseq's parsers still refuse it, as no literal."""
    assert refusal(value) is None
    if value.isidentifier():
        with pytest.raises(UnsafeCheckpointError, match="is not a literal value"):
            fairseq.utils.eval_str_list(value)


def test_no_loaded_fairseq_module_holds_an_eval_based_option_parser():
    """fairseq's eval_str_list, eval_str_dict and eval_bool are replaced wherever fairseq bound
    them (``fairseq.utils``, the modules that imported them by name); fairseq's other direct
    ``eval()`` calls read Namespaces, whose strings are checked on unpickling."""
    import sys

    held = [(name, attr) for name, module in list(sys.modules.items())
            if module is not None and name.split(".")[0] in {"fairseq", "fairseq_cli"}
            for attr in compat.LITERAL_OPTION_PARSERS
            if getattr(getattr(module, attr, None), "__module__", None) == "fairseq.utils"]
    assert not held
    assert fairseq.utils.eval_str_dict is compat.eval_str_dict


def test_a_command_line_option_that_is_code_is_refused_naming_it(tmp_path):
    sentinel = tmp_path / "ran"
    with pytest.raises(UnsafeCheckpointError) as refused:
        fairseq.utils.eval_str_list(payload(sentinel), type=int)
    assert REFUSED in str(refused.value) and not sentinel.exists()


def test_a_checked_namespace_is_saved_again_as_fairseqs_plain_namespace(trained):
    state = torch.load(trained)
    assert type(state["cfg"]["model"]) is CheckedNamespace
    data = pickle.dumps(state["cfg"]["model"])
    assert b"CheckedNamespace" not in data
    assert type(pickle.loads(data)) is argparse.Namespace
    assert vars(pickle.loads(data)) == vars(state["cfg"]["model"])


def test_the_runner_moves_an_unsafe_last_checkpoint_aside_and_says_why(trained, tmp_path, caplog):
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path / "run"))
    os.makedirs(run.checkpoints)
    malicious, sentinel = planted(trained, "adaptive_softmax_cutoff", tmp_path)
    last = os.path.join(run.checkpoints, "checkpoint_last.pt")
    shutil.copyfile(malicious, last)
    assert grid.usable_last_checkpoint(run) == 0  # nothing safe to resume from
    assert not os.path.exists(last)
    with open(last + ".unsafe", "rb") as kept, open(malicious, "rb") as original:
        assert kept.read() == original.read()  # the evidence is kept
    assert f"{last} is unsafe (checkpoint option adaptive_softmax_cutoff=" in caplog.text and REFUSED in caplog.text
    assert not sentinel.exists()


def test_a_truncated_last_checkpoint_is_replaced_by_the_newer_of_best_and_the_update_checkpoint(trained, tmp_path):
    """Where every update ends an epoch fairseq writes no update checkpoint: a stop during its
    copy of checkpoint_best.pt to checkpoint_last.pt must resume from the best one, not from
    scratch; an update checkpoint with more updates than the best one wins."""
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path / "run"))
    os.makedirs(run.checkpoints)
    last, best = (os.path.join(run.checkpoints, f"checkpoint_{name}.pt") for name in ("last", "best"))
    shutil.copyfile(trained, best)
    with open(trained, "rb") as whole, open(last, "wb") as truncated:
        truncated.write(whole.read()[:1000])
    assert grid.usable_last_checkpoint(run) == 1  # `trained`: one update
    assert os.path.exists(last + ".unreadable")
    with open(last, "rb") as resumed, open(trained, "rb") as original:
        assert resumed.read() == original.read()

    with open(last, "wb") as truncated:
        truncated.write(b"truncat")
    with open(os.path.join(run.checkpoints, "checkpoint_1_5.pt"), "wb") as update:
        update.write(b"five")
    assert grid.usable_last_checkpoint(run) == 5
    with open(last, "rb") as resumed:
        assert resumed.read() == b"five"


def test_the_runner_and_the_demo_refuse_to_decode_a_checkpoint_with_code_in_an_option(trained, data_bin, tmp_path):
    """Both decode a run folder's checkpoint with grid.decode (fairseq-generate)."""
    run = grid.Run(systems.lookup("transformer"), 1, str(tmp_path / "run"))
    malicious, sentinel = planted(trained, "adaptive_softmax_cutoff", tmp_path)
    with pytest.raises(grid.RunFailed) as failure:
        grid.decode(run, grid.Settings(str(data_bin), "tgt", 1), str(malicious),
                          run.path("generate"), str(tmp_path))
    first = str(failure.value).splitlines()[0]
    assert first.startswith("fairseq_cli.generate failed (1): ") and "adaptive_softmax_cutoff=" in first
    assert REFUSED in first
    assert not sentinel.exists()


def test_a_pickled_callable_is_refused_by_the_package_tools_naming_it_without_the_unsafe_advice(trained, data_bin,
                                                                                               tmp_path, capsys):
    sentinel = tmp_path / "code-ran"
    state = torch.load(trained, weights_only=False)
    state["extra_state"]["payload"] = _RunsCommandWhenUnpickled(sentinel)
    malicious = tmp_path / "malicious.pt"
    torch.save(state, malicious)
    line = cli_error(attention_stats.main, [malicious, "--data-bin", data_bin, "--split", "test",
                                            "--output-prefix", tmp_path / "out"], capsys)
    assert line.endswith(f"error: checkpoint {malicious}: the checkpoint holds posix.system, which safe loading "
                         "refuses: fairseq checkpoints store no such thing, so the file carries code or was not "
                         "written by fairseq; do not load it")
    assert not sentinel.exists()


@pytest.mark.parametrize("tool", ["generate", "train"])
@pytest.mark.parametrize("cut", [0, 5000], ids=["empty", "truncated"])
def test_an_empty_or_truncated_checkpoint_is_named_in_one_line(trained, data_bin, tmp_path, tool, cut):
    """fairseq-generate --path and fairseq-train --restore-file, as a run stopped during a copy
    leaves a checkpoint."""
    cut_short = tmp_path / "cut.pt"
    cut_short.write_bytes(trained.read_bytes()[:cut])
    if tool == "generate":
        argv = [data_bin, "--user-dir", USER_DIR, "--path", cut_short, "--cpu", "--beam", "1"]
    else:
        argv = [*train_args(data_bin, tmp_path / "resumed", "slot_transformer", max_update=2),
                "--restore-file", cut_short]
    result = run_fairseq(tool, *argv, check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]  # torch's reason differs between its versions
    assert re.search(rf"error: checkpoint {re.escape(str(cut_short))} is empty or truncated \(.+\): use another", last)
