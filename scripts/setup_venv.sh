#!/usr/bin/env bash
# Create (or complete) the local virtual environment used by `make test` and `make demo`.
#
#   torch    kept if the environment (or, for a new one, the calling python) already has it,
#            e.g. a CUDA build a GPU user installed first; otherwise the CPU wheel on a machine
#            without an NVIDIA GPU (a local wheel if pip's find-links has one, else PyTorch's CPU
#            index), never a multi-GB CUDA build by accident.
#   fairseq  fairseq-fixed (fairseq's main branch, importable on Python 3.11), installed with
#            --no-deps: its metadata requires torchaudio, which would replace torch.
#   requirements.txt, pinned: fairseq's runtime dependencies, the lab's libraries (pyproject.toml's
#            `lab` extra) and the tests': everything, whereas `pip install .` brings the plugin's only.
#   this package, editable, so `--user-dir mlmha_fairseq` and `import mlmha_fairseq` work anywhere.
#   COMET    with WITH_COMET=1: requirements-comet.txt, installed with --no-deps: unbabel-comet
#            declares numpy<2 and protobuf<5, which would replace requirements.txt's.
set -euo pipefail

VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
FAIRSEQ_SPEC=${FAIRSEQ_SPEC:-fairseq-fixed==0.12.3.1}

log() { printf '[setup] %s\n' "$*"; }

# Python 3.11 is the version tested (pyproject.toml's requires-python).
INTERPRETER=$PYTHON
[ -x "$VENV/bin/python" ] && INTERPRETER="$VENV/bin/python"
if ! "$INTERPRETER" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    printf '[setup] error: %s is not Python 3.11 or newer; use PYTHON=python3.11 (and remove %s if it exists)\n' \
        "$INTERPRETER" "$VENV" >&2
    exit 1
fi

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        log "creating $VENV with access to the torch already installed for $PYTHON"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        log "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if "$PY" -c "import torch" >/dev/null 2>&1; then
    log "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed: kept"
elif command -v nvidia-smi >/dev/null 2>&1; then
    log "installing $TORCH_SPEC (NVIDIA GPU found)"
    pip_install "$TORCH_SPEC"
else
    log "installing the CPU build of $TORCH_SPEC (no NVIDIA GPU found)"
    if ! pip_install --no-index --no-deps "$TORCH_SPEC" 2>/dev/null; then
        pip_install --no-deps --index-url "$TORCH_CPU_INDEX" "$TORCH_SPEC"
    fi
    pip_install "$TORCH_SPEC"  # its dependencies; torch itself is already satisfied
fi

log "installing requirements.txt"
pip_install -r requirements.txt

if "$PY" -c "import fairseq" >/dev/null 2>&1; then
    log "fairseq $("$PY" -c 'import fairseq; print(fairseq.__version__)' 2>/dev/null) already installed: kept"
else
    log "building $FAIRSEQ_SPEC (compiles C++ extensions, about two minutes)"
    pip_install --no-deps --no-build-isolation "$FAIRSEQ_SPEC"
fi

if [ "${WITH_COMET:-0}" = 1 ]; then
    log "installing requirements-comet.txt (unbabel-comet, --no-deps)"
    pip_install --no-deps -r requirements-comet.txt
fi

log "installing mlmha_fairseq (editable)"
pip_install --no-deps --no-build-isolation -e .
"$PY" -c "import torch, fairseq, mlmha_fairseq; print('[setup] ready: torch', torch.__version__, '| fairseq', fairseq.__version__)"
"$PY" -m mlmha_fairseq.cli.link_user_dir
