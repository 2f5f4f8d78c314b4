#!/usr/bin/env bash
# The checks that need a GPU, in one run on a lent CUDA machine (the CI machine has none):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Uses the machine's python3 and torch (no virtual environment); wheels it lacks (ortools and its
# needs) are installed from .whl/ when that folder is present. Logs go to OUT_DIR (default /tmp/gpu).
# 1. tests/test_cuda.py: CUDA streams and events, pinned swaps, bf16 / fp16, any batch shape;
# 2. examples/train_anywhere.py under torchrun (2 ranks; NCCL needs a GPU per rank, else gloo);
# 3. bench/precision.py on the GPU: the demo model and a GPT-2-small-sized one;
# 4. the rest of the suite on this machine's torch (a check that stagewise runs on it), in parallel
#    (SUITE_TESTS="tests/test_a.py tests/test_b.py" runs those only; SUITE=0 none; SUITE_S its limit).
set -uo pipefail
out="${1:-/tmp/gpu}"
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import torch, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ortools', ortools.__version__)" | tee -a "$out/machine.txt"

step() { echo "== $1 ($(date +%T))"; }
step "CUDA tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -rs 2>&1 | tail -40 | tee "$out/cuda_tests.txt"
step "torchrun, 2 ranks"
timeout 90 torchrun --standalone --nproc-per-node 2 examples/train_anywhere.py 2>&1 | grep -v Warning | tail -12 | tee "$out/torchrun.txt"
step "bench: bf16 against fp32 on the GPU"
timeout 120 python3 bench/precision.py --device cuda --no-pin 2>&1 | tail -14 | tee "$out/bench_precision_demo.txt"
timeout 240 python3 bench/precision.py --device cuda --no-pin --layers 12 --dim 768 --heads 12 --batch 16 --length 512 \
  --steps 10 2>&1 | tail -14 | tee "$out/bench_precision_gpt2_small.txt"
if [ "${SUITE:-1}" = 1 ]; then
  step "the suite on this torch"
  timeout "${SUITE_S:-300}" python3 -m pytest -q -p no:cacheprovider -n 12 --maxfail=5 --ignore tests/test_cuda.py \
    ${SUITE_TESTS:-tests} 2>&1 | tail -30 \
    | tee "$out/suite.txt"
fi
step "done"
