"""Every process the package starts ends with its parent (a killed runner leaves no
fairseq-train or fairseq-preprocess writing into a folder that a rerun writes again)."""
import ast
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import mlmha_fairseq

PACKAGE = pathlib.Path(mlmha_fairseq.__file__).parent
# the only children that may outlive the package's process: none of them writes a run folder
OUTLIVING = {("cli/benchmark.py", "run"), ("experiments/slurm.py", "run")}


def _starts(path: pathlib.Path):
    """``(function name, has preexec_fn=end_with_parent)`` of each subprocess.run/Popen call."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                and node.func.attr in {"run", "Popen", "call", "check_call", "check_output"}):
            yield node.func.attr, any(k.arg == "preexec_fn" and getattr(k.value, "id", "") == "end_with_parent"
                                      for k in node.keywords)


def test_every_child_process_of_the_package_ends_with_its_parent():
    unbound = [(str(path.relative_to(PACKAGE)), name) for path in PACKAGE.rglob("*.py")
               for name, bound in _starts(path) if not bound]
    assert set(unbound) <= OUTLIVING, sorted(set(unbound) - OUTLIVING)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_end_with_parent_dies_with_a_killed_parent(tmp_path):
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "from mlmha_fairseq.child_processes import end_with_parent\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=end_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "child.wait()\n")])
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as stat:  # a zombie (reaped by init later) is dead
            if stat.read().split(")")[-1].split()[0] == "Z":
                return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its killed parent")
