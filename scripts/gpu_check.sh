#!/usr/bin/env bash
# The checks that need a GPU, in one run on a lent CUDA machine (the CI machine has none):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Uses the machine's python3 and torch (no virtual environment); wheels it lacks (ortools and its
# needs) are installed from .whl/ when that folder is present. Full logs go to OUT_DIR (default
# /tmp/gpu), their ends to stdout.
# 1. tests/test_cuda.py: CUDA streams and events, pinned swaps, bf16 / fp16, any batch shape;
# 2. examples/train_anywhere.py under torchrun (2 ranks, CPU devices over gloo: NCCL needs a GPU per rank);
# 3. bench/precision.py on the GPU: the demo model and a GPT-2-small-sized one;
# 4. the rest of the suite, on the CPU (CUDA hidden: its int device counts would mean GPUs), on this
#    machine's torch (a check that stagewise runs on it), in parallel
#    (BENCH=0 skips step 3; SUITE_TESTS="tests/test_a.py tests/test_b.py" runs those only; SUITE=0 none; SUITE_S its limit).
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
timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/test_cuda.py -rs > "$out/cuda_tests.txt" 2>&1
tail -15 "$out/cuda_tests.txt"
step "torchrun, 2 ranks"
CUDA_VISIBLE_DEVICES="" timeout 90 torchrun --standalone --nproc-per-node 2 examples/train_anywhere.py > "$out/torchrun.txt" 2>&1
grep -v Warning "$out/torchrun.txt" | tail -8
if [ "${BENCH:-1}" = 1 ]; then
step "bench: bf16 against fp32 on the GPU"
timeout 120 python3 bench/precision.py --device cuda --no-pin > "$out/bench_precision_demo.txt" 2>&1
tail -12 "$out/bench_precision_demo.txt"
timeout 240 python3 bench/precision.py --device cuda --no-pin --layers 12 --dim 768 --heads 12 --batch 16 --length 512 \
  --steps 10 > "$out/bench_precision_gpt2_small.txt" 2>&1
tail -12 "$out/bench_precision_gpt2_small.txt"
fi
if [ "${SUITE:-1}" = 1 ]; then
  step "the suite on this torch"
  CUDA_VISIBLE_DEVICES="" timeout "${SUITE_S:-300}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -n 14 --maxfail=40 \
    --ignore tests/test_cuda.py ${SUITE_TESTS:-tests} > "$out/suite.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite.txt" | tail -40
fi
step "done"
