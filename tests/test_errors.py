"""UsageError ends a process with one line and exit status 1; other errors keep their traceback."""
import subprocess
import sys


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_usage_error_is_one_line_without_traceback():
    result = _run("import mlmha_fairseq\nfrom mlmha_fairseq.errors import UsageError\n"
                  "raise UsageError('--mlmha-top-n 7: the encoder has 6 layers;\\n use 1..6')")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "-c: error: --mlmha-top-n 7: the encoder has 6 layers; use 1..6"


def test_other_errors_keep_their_traceback():
    result = _run("import mlmha_fairseq\nraise KeyError('x')")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "KeyError" in result.stderr
