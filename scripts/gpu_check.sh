#!/usr/bin/env bash
# The checks of one bounded GPU session, in one command (docs/testing-gpu.md): on an offline
# machine with a CUDA build of torch, run from the project's root with the offline kit in
# $KIT (hydra-core, omegaconf, antlr4, bitarray, sacremoses, subword-nmt, nltk, mt-thresholds
# wheels and fairseq-fixed's sdist under $KIT/whl) and gpu-base.toml's corpus in
# work-experiment-gpu-base-corpus:
#   OUT=gpu-check BUDGET=560 bash scripts/gpu_check.sh
# It trains the grids of $CONFIGS (default: examples/experiment/gpu-base-matched.toml, issue
# 47; examples/experiment/gpu-base-fp16.toml is issue 45's), all runs at once on the GPU, beside
# the GPU test tier and the README's GPU snippets, and writes everything to $OUT before
# $BUDGET seconds have passed, unfinished runs' logs included.
set -u
OUT=${OUT:-gpu-check}
KIT=${KIT:-.device}
BUDGET=${BUDGET:-560}
CONFIGS=${CONFIGS:-examples/experiment/gpu-base-matched.toml}
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# Set-up: the wheels, then fairseq's two Cython extensions and its C++ BLEU scorer built in
# its unpacked sdist (fairseq-generate imports libbleu); pip's full build takes minutes more.
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$KIT"/whl/*.whl
src=$(mktemp -d)
tar -xzf "$KIT"/whl/fairseq_fixed-*.tar.gz -C "$src"
fairseq_src=$(echo "$src"/fairseq_fixed-*)
(cd "$fairseq_src" && PYTHONPATH="$site" python3 - > "$OUT/setup.log" 2>&1 <<'EOF'
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

exts = [Extension(f"fairseq.data.{name}", [f"fairseq/data/{name}.pyx"], language="c++",
                  include_dirs=[numpy.get_include()], extra_compile_args=["-std=c++11", "-O3"])
        for name in ("data_utils_fast", "token_block_utils_fast")]
exts.append(Extension("fairseq.libbleu", ["fairseq/clib/libbleu/libbleu.cpp", "fairseq/clib/libbleu/module.cpp"],
                      language="c++", extra_compile_args=["-std=c++11"]))
setup(name="fairseq-cython", ext_modules=cythonize(exts, language_level=3),
      script_args=["build_ext", "--inplace", "-j", "8"])
EOF
) || { echo "fairseq build failed"; tail -20 "$OUT/setup.log"; }
export PYTHONPATH="$site:$fairseq_src:$(pwd)" PATH="$site/bin:$PATH"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, fairseq; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'fairseq', fairseq.__version__)"
  echo "set-up: $(( $(date +%s) - T0 )) s"
} | tee "$OUT/env.txt"

# 1. The grids, each run's records in work-experiment-records/<config>.
runners=()
for config in $CONFIGS; do
  name=$(basename "$config" .toml)
  mkdir -p "work-experiment-records/$name"
  python3 -m mlmha_fairseq.cli.experiment "$config" --jobs 8 --threads 2 \
    --records "work-experiment-records/$name" > "$OUT/$name.log" 2>&1 &
  runners+=($!)
done
running() { for pid in "${runners[@]}"; do kill -0 "$pid" 2>/dev/null && return 0; done; return 1; }

# 2. The README's GPU snippets that the tier does not run: fairseq-train under torchrun with
# --fp16 and --checkpoint-activations, then fairseq-generate on the GPU (tiny model, 20 updates).
snip=$(mktemp -d)
{
  timeout 90 python3 -m torch.distributed.run --nproc_per_node 1 -m mlmha_fairseq.cli.train work-experiment-gpu-base-corpus/data-bin \
    --user-dir mlmha_fairseq --arch mlmha_transformer_iwslt --encoder-layers 2 --decoder-layers 2 \
    --encoder-embed-dim 64 --decoder-embed-dim 64 --encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 \
    --encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings \
    --optimizer adam --lr 1e-3 --criterion label_smoothed_cross_entropy --max-tokens 2048 --max-update 20 \
    --fp16 --checkpoint-activations --save-dir "$snip" --no-epoch-checkpoints --log-interval 5 --no-progress-bar
  echo "snippet torchrun --fp16 --checkpoint-activations: rc $?"
  timeout 60 python3 -m fairseq_cli.generate work-experiment-gpu-base-corpus/data-bin --user-dir mlmha_fairseq \
    --path "$snip/checkpoint_last.pt" --gen-subset test --beam 4 --max-tokens 4096 --fp16 --remove-bpe | tail -2
  echo "snippet fairseq-generate --fp16: rc ${PIPESTATUS[0]}"
} > "$OUT/snippets.log" 2>&1
grep "^snippet" "$OUT/snippets.log" | tee -a "$OUT/env.txt"

# 3. The GPU test tier, bounded so that it ends before the budget.
timeout $(( $(left) - 60 )) python3 -m pytest tests -m cuda -n 6 -q -rfE -p no:cacheprovider \
  --continue-on-collection-errors --junitxml="$OUT/cuda-junit.xml" > "$OUT/pytest-cuda.log" 2>&1
echo "pytest -m cuda: rc $? after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.txt"
tail -3 "$OUT/pytest-cuda.log"

# 4. Wait for the runners while the budget lasts, then keep what they wrote (no checkpoints).
while running && [ "$(left)" -gt 25 ]; do sleep 5; done
running && echo "a runner was still running at the budget" | tee -a "$OUT/env.txt"
work_dirs=$(python3 -c 'import sys; from mlmha_fairseq.experiments.config import load_config
print(*(load_config(path).work_dir for path in sys.argv[1:]))' $CONFIGS)
tar -czf "$OUT/runs.tgz" --exclude='*.pt' work-experiment-records $work_dirs
nvidia-smi >> "$OUT/env.txt" 2>&1
echo "done after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.txt"
