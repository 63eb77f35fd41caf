"""The suite's fairseq runner reruns a tool that aborts in interpreter teardown, except a
training that had finished: its rerun would resume from the checkpoint it wrote and train past
--max-update (a fixture checkpoint with 2 updates instead of 1 failed CI once)."""
import signal

import pytest

from fairseq_helpers import run_fairseq

# stands in for a fairseq tool: counts its runs, logs `said`, then dies as the teardown crash does
ABORTS_IN_TEARDOWN = """
import os, sys
with open("runs", "a") as runs:
    runs.write("x")
print({said!r}, flush=True)
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


@pytest.mark.parametrize("tool, said, runs", [
    ("train", "done training in 1.0 seconds", 1),  # finished: kept, not rerun
    ("train", "epoch 001 | loss 9.1", 2),  # aborted mid-training: rerun once, then failed
    ("generate", "done training in 1.0 seconds", 2),  # not a training: rerun once
])
def test_a_tool_aborting_in_teardown_is_rerun_once_unless_a_training_finished(tmp_path, tool, said, runs):
    (tmp_path / "aborts_in_teardown.py").write_text(ABORTS_IN_TEARDOWN.format(said=said))
    result = run_fairseq(tool, module="aborts_in_teardown", cwd=tmp_path, check=False)
    assert (tmp_path / "runs").read_text() == "x" * runs
    assert result.returncode == (0 if runs == 1 else -signal.SIGABRT)
