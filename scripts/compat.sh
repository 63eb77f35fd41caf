#!/usr/bin/env bash
# make compat: the fast tier of the suite on one Python x torch combination, in an environment of
# its own, set up the way the README's commands set up .venv (scripts/setup_venv.sh), e.g.
#
#   PYTHON=python3.13 TORCH_SPEC=torch==2.15.0 make compat
#
# Appends one line per run to $COMPAT_RECORD (docs/compat.tsv): date, commit, Python, torch and
# fairseq as imported, the tier's counts and its wall time, or the step that failed. README's
# "Tested with" matrix is read off that file. Not part of CI: a new combination downloads torch
# (several GB for PyPI's CUDA builds) and builds fairseq-fixed (minutes).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
COMPAT_DIR=${COMPAT_DIR:-.compat}
COMPAT_RECORD=${COMPAT_RECORD:-docs/compat.tsv}
# equations of every mechanism, incremental decoding against the full forward with beam
# reordering, one fairseq-train/-generate round trip per model, loading earlier checkpoints,
# checkpoint safety, hydra
COMPAT_TESTS=${COMPAT_TESTS:-tests/test_equations.py tests/test_module_api.py tests/test_cli_roundtrip.py tests/test_checkpoint_compat.py tests/test_checkpoint_safety.py tests/test_hydra.py}

say() { printf '[compat] %s\n' "$*"; }

if ! py_version=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null); then
    say "error: no interpreter '$PYTHON' here: give PYTHON=/path/to/python3.X" >&2
    exit 2
fi
torch_wanted=${TORCH_SPEC#torch}
torch_wanted=${torch_wanted#==}
venv="$COMPAT_DIR/py$py_version-torch${torch_wanted:-any}"
log="$venv.log"
mkdir -p "$COMPAT_DIR"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+dirty"

record() {  # status, detail
    local versions="$py_version	${torch_have:-$torch_wanted (not installed)}	${fairseq_have:--}"
    [ -s "$COMPAT_RECORD" ] || printf 'date\tcommit\tpython\ttorch\tfairseq\tresult\tdetail\n' > "$COMPAT_RECORD"
    printf '%s\t%s\t%s\t%s\t%s\n' "$(date -u +%F)" "$commit" "$versions" "$1" "$2" >> "$COMPAT_RECORD"
    say "$1: $2 (Python $py_version, torch ${torch_have:-$torch_wanted}; log: $log; recorded in $COMPAT_RECORD)"
}

say "Python $py_version, $TORCH_SPEC: environment $venv (log: $log)"
: > "$log"
if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv" >> "$log" 2>&1 || { record "setup failed" "python -m venv"; exit 1; }
fi
# torch first, from wherever pip finds this release (a CUDA build from PyPI runs on a CPU too):
# setup_venv.sh keeps a torch the environment already has, as it does for a user's own.
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    say "installing $TORCH_SPEC"
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -q "$TORCH_SPEC" >> "$log" 2>&1; then
        record "setup failed" "pip install $TORCH_SPEC: $(grep -m1 -E 'ERROR' "$log" | cut -c1-160)"
        exit 1
    fi
fi
torch_have=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>>"$log")
say "setting up the rest as scripts/setup_venv.sh does"
if ! bash scripts/setup_venv.sh "$venv" >> "$log" 2>&1; then
    record "setup failed" "scripts/setup_venv.sh: $(grep -E '\[setup\]|ERROR|error' "$log" | tail -1 | cut -c1-160)"
    exit 1
fi
fairseq_have=$("$venv/bin/python" -c 'import fairseq; print(fairseq.__version__)' 2>>"$log")

say "fast tier: $COMPAT_TESTS"
start=$(date +%s)
"$venv/bin/python" -m pytest $COMPAT_TESTS -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile \
    >> "$log" 2>&1
rc=$?
seconds=$(( $(date +%s) - start ))
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//; s/ in [0-9.]+s.*//')
if [ "$rc" = 0 ]; then
    record "passed" "${summary:-no summary}, ${seconds} s"
else
    record "failed" "${summary:-pytest exit $rc}, ${seconds} s"
    exit 1
fi
