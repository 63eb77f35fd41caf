"""tests/fairseq_launcher.py runs fairseq's tools as a new interpreter would: the same exit
status and error output as ``python -m``, and no process of the tool outlives it."""
import os
import subprocess
import sys
import time
import uuid

from fairseq_helpers import generate, hypotheses_and_references, run_fairseq, train_args


def test_a_refused_option_ends_as_it_does_in_a_new_interpreter(data_bin, tmp_path):
    argv = [*map(str, train_args(data_bin, tmp_path, "slot_transformer", "--mlmha-variant", "M-00"))]
    forked = run_fairseq("train", *argv, check=False)
    new = subprocess.run([sys.executable, "-m", "fairseq_cli.train", *argv], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert forked.returncode == new.returncode == 1
    assert forked.stderr == new.stderr and forked.stderr.startswith("train.py: error: ")


def processes_with(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if marker in handle.read():
                    found.append(int(pid))
        except OSError:  # ended meanwhile, or not ours
            pass
    return found


def test_no_process_of_a_tool_outlives_it(data_bin, tmp_path):
    """fairseq-generate's default --num-workers 1 starts a DataLoader worker; it ends with the
    tool (it once lived on under a forkserver of its own, holding memory for the whole suite)."""
    run_fairseq("train", *train_args(data_bin, tmp_path, "transformer", max_update=1))
    marker = f"LAUNCHER_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    os.environ[name] = value
    try:
        hypotheses, _ = hypotheses_and_references(generate(data_bin, tmp_path / "checkpoint_last.pt", "--num-workers", "1"))
    finally:
        del os.environ[name]
    assert len(hypotheses) == 16
    deadline = time.monotonic() + 10
    while processes_with(marker.encode()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(marker.encode()) == []
