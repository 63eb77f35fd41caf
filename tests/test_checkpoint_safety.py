"""A checkpoint whose stored options carry code (a string that fairseq passes to eval() while it
builds the model) is refused, with one line naming the option, by every tool that loads a
checkpoint; the code never runs. Each payload would create a sentinel file if it ran."""
import argparse
import ast
import os
import pathlib
import pickle
import shutil
import warnings

import fairseq
import pytest
import torch

from fairseq_helpers import USER_DIR, run_fairseq, train_args
from mlmha_fairseq.cli import (
    aif_dependency, attention_stats, dc_diversity, dump_attention, mlrf_hop_weights, multi_source_attention, numerics,
    probe,
)
from mlmha_fairseq.experiments import grid, systems
from mlmha_fairseq.compat import EVALUATED_OPTIONS, CheckedNamespace, is_code
from mlmha_fairseq.evaluation.model_loading import load_model
from mlmha_fairseq.evaluation.text_io import InputError
from test_bad_input import _RunsCommandWhenUnpickled
from test_eval_bad_input import cli_error

# the options of this package's models (and fairseq's transformer) that fairseq evaluates
REACHABLE = ("adaptive_softmax_cutoff", "xformers_att_config")
REFUSED = "is Python code, not a value"


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
    setattr(model, field, payload(sentinel))
    if as_dict:
        state["cfg"]["model"] = vars(model)
    malicious = tmp_path / f"malicious-{field}.pt"
    torch.save(state, malicious)
    return malicious, sentinel


def assert_refused(stderr: str, field: str):
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr
    assert f"{field}=" in lines[-1] and REFUSED in lines[-1]


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
    assert f"{field}=" in line and REFUSED in line and str(malicious) in line
    assert not sentinel.exists()
    assert not list(tmp_path.glob("out*"))


def test_options_stored_as_a_dict_are_checked_before_the_model_is_built(trained, data_bin, tmp_path):
    malicious, sentinel = planted(trained, "adaptive_softmax_cutoff", tmp_path, as_dict=True)
    with pytest.raises(InputError, match=r"checkpoint option cfg\.model\.adaptive_softmax_cutoff="):
        load_model(str(malicious), str(data_bin))
    assert not sentinel.exists()


@pytest.mark.parametrize("value", [
    "__import__('os').system('true')", "exec('1')", "open('x', 'w')", "[x for x in ()]", "lambda: 0",
    "().__class__", "os.environ", "f'{1}'", "[5] + foo", "(x := 1)",
])
def test_code_is_recognised(value):
    assert is_code(value)


@pytest.mark.parametrize("value", [
    "5000,20000", "[5000, 20000]", "(0.9, 0.98)", "(0.9,0.98)", "{'dropout': 0.1}", '{"name": "blocksparse"}',
    "[(512, 3)] * 20", "-1", "True", "None", "1e-3", "", "not python ((", "relu",
])
def test_data_is_not_code(value):
    """Literals, fconv's default layer spec (a product of literals), and strings that are not an
    expression at all (eval fails before running anything). A bare name such as ``relu`` is no
    code either (eval would only look it up) but holds no value: it is refused as code, which no
    option fairseq evaluates ever stores."""
    assert is_code(value) is (value == "relu")


def _evaluated_attributes(source: str):
    """``X`` of every ``eval(<...>.X)``, ``eval_str_list(<...>.X)``, ``eval_str_dict(<...>.X)``,
    ``eval_bool(<...>.X)`` call in ``source``."""
    with warnings.catch_warnings():  # fairseq's own invalid escape sequences
        warnings.simplefilter("ignore", DeprecationWarning)
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Attribute):
            function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if function in {"eval", "eval_str_list", "eval_str_dict", "eval_bool"}:
                yield node.args[0].attr


def test_every_option_the_installed_fairseq_evaluates_is_checked():
    root = pathlib.Path(fairseq.__file__).parent
    found = {name for path in root.rglob("*.py") if "examples" not in path.parts
             for name in _evaluated_attributes(path.read_text(errors="replace"))}
    assert found, "the scan found no eval() of an option: it no longer reads fairseq's source"
    assert found <= EVALUATED_OPTIONS, sorted(found - EVALUATED_OPTIONS)


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
