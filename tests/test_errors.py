"""A UsageError ends a command with one line and exit status 1, in fairseq's tools (which
import the package through --user-dir) and in the package's own; other errors keep their
traceback; importing the package leaves any other program's ``sys.excepthook`` alone."""
import os
import pickle
import subprocess
import sys

import pytest

from fairseq_helpers import train_args
from mlmha_fairseq.cli._support import command
from mlmha_fairseq.errors import UsageError, lab_imports

# fairseq-train's own words for an option of a mechanism that is off
MECHANISM_OFF = "--mlmha-variant M-00 needs --decoder-cross-attention multi-layer, which is off"
TORCH_REFUSAL = ("Weights only load failed because of an unsupported global. Please file an issue with the following "
                 "so that we can make `weights_only=True` compatible with your use case: WeightsUnpickler error: "
                 "Unsupported global: GLOBAL posix.system was not an allowed global by default.")


def _python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("before", ["", "def mine(*args):\n    pass\nsys.excepthook = mine\n"],
                         ids=["default-hook", "own-hook"])
def test_importing_the_package_leaves_the_excepthook_alone(before):
    """In a notebook, pytest or any program of its own, ``import mlmha_fairseq`` replaced
    ``sys.excepthook``."""
    result = _python("-c", f"import sys\n{before}hook = sys.excepthook\nimport mlmha_fairseq\n"
                           "assert sys.excepthook is hook, sys.excepthook")
    assert result.returncode == 0, result.stderr


def test_a_usage_error_in_another_program_keeps_its_traceback():
    result = _python("-c", "import mlmha_fairseq\nfrom mlmha_fairseq.errors import UsageError\n"
                           "raise UsageError('--mlmha-top-n 7: the encoder has 6 layers; use 1..6')")
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "mlmha_fairseq.errors.UsageError: --mlmha-top-n 7: the encoder has 6 layers; use 1..6")


@pytest.mark.parametrize("program", ["python -m fairseq_cli.train", "fairseq-train"])
def test_fairseq_tools_end_a_usage_error_with_one_line(data_bin, tmp_path, program):
    """Both ways of starting fairseq-train: the module, and the console script that fairseq
    installs (``__main__`` is the script there, so the tool is known by its name)."""
    if program == "fairseq-train":
        start, prog = [os.path.join(os.path.dirname(sys.executable), "fairseq-train")], "fairseq-train"
    else:
        start, prog = [sys.executable, "-m", "fairseq_cli.train"], "train.py"
    extra = ["--mlmha-variant", "M-00"]
    result = subprocess.run([*start, *map(str, train_args(data_bin, tmp_path, "slot_transformer", *extra))],
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"{prog}: error: {MECHANISM_OFF}")


def test_a_package_command_ends_a_usage_error_with_one_line():
    result = _python("-m", "mlmha_fairseq.cli.options", "--arch", "nope")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "options.py: error: --arch nope: not an architecture of this package; choose one of ")


def _raise(error):
    def main():
        raise error
    return main


@pytest.mark.parametrize("error, line", [
    (UsageError("--mlmha-top-n 7: the encoder has 6 layers;\n use 1..6"),
     "tool.py: error: --mlmha-top-n 7: the encoder has 6 layers; use 1..6"),
    (pickle.UnpicklingError(TORCH_REFUSAL),
     "tool.py: error: the checkpoint holds posix.system, which safe loading refuses: fairseq checkpoints store no "
     "such thing, so the file carries code or was not written by fairseq; do not load it"),
    (ModuleNotFoundError("No module named 'compare_mt'", name="compare_mt"),
     "tool.py: error: compare-mt is not installed; the corpus builder, experiment runner and analysis tools need "
     "it: pip install 'mlmha_fairseq[lab]'"),
], ids=["usage-error", "unsafe-checkpoint", "missing-lab-library"])
def test_command_prints_one_line_and_exits_with_status_1(monkeypatch, capsys, error, line):
    monkeypatch.setattr(sys, "argv", ["/somewhere/tool.py"])
    with pytest.raises(SystemExit) as exit_info:
        command(_raise(error))
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == line + "\n"


def test_command_exits_with_mains_status_and_lets_other_errors_through(capsys):
    for status in (None, 0, 3):
        with pytest.raises(SystemExit) as exit_info:
            command(lambda: status)
        assert exit_info.value.code == status
    with pytest.raises(KeyError, match="x"):
        command(_raise(KeyError("x")))
    with pytest.raises(pickle.UnpicklingError, match="invalid load key"):
        command(_raise(pickle.UnpicklingError("invalid load key, 'x'.")))
    with pytest.raises(ModuleNotFoundError, match="torch"):  # the plugin's: a broken install, not an incomplete one
        command(_raise(ModuleNotFoundError("No module named 'torch'", name="torch")))
    assert capsys.readouterr().err == ""


def test_lab_imports_stop_only_the_running_program(capsys):
    missing = ModuleNotFoundError("No module named 'sacremoses'", name="sacremoses")
    with pytest.raises(ModuleNotFoundError, match="sacremoses"):
        with lab_imports("mlmha_fairseq.cli.build_corpus"):  # imported by another program
            raise missing
    with pytest.raises(SystemExit) as exit_info:
        with lab_imports("__main__"):
            raise missing
    assert exit_info.value.code == 1
    assert "sacremoses is not installed" in capsys.readouterr().err
