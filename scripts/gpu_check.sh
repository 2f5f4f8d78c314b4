#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most ~9 minutes on a lent CUDA machine (CI has none):
#   bash scripts/gpu_check.sh [OUT_DIR]
# Uses the machine's python3 and torch (no virtual environment); wheels it lacks (ortools and its
# needs) are installed from .whl/ when that folder is present. Full logs go to OUT_DIR (default
# /tmp/gpu), their ends to stdout. Phases:
# 1. at once, side by side (none of them timed): tests/test_cuda.py on the GPU (CUDA streams and events,
#    pinned swaps, bf16 / fp16, any batch shape, CUDA graphs); examples/train_anywhere.py under torchrun
#    (2 ranks, CPU devices over gloo: NCCL needs a GPU per rank); the rest of the suite on the CPU (CUDA
#    hidden: its int device counts would mean GPUs) on this machine's torch, in parallel;
# 2. then, alone on the machine, the timed benches: bench/gpu_step.py (GPT-2-small, 1 and 4 logical
#    devices against eager, fp32 and bf16, host dispatch against GPU busy time) and bench/memory_bound.py
#    (a ~1.3B GPT on a capped GPU: stagewise swapping against FSDP2 with CPU offload) and
#    bench/compiled_stages.py (cuda_graphs=True on GPT-2 small in bf16 against eager, one device).
# BENCH=0 skips phase 2; SUITE=0 skips the suite; SUITE_TESTS="tests/test_a.py ..." runs those only;
# SUITE_S, CUDA_S, STEP_S, MEMORY_S, GRAPHS_S: each part's limit in seconds; STEPS: gpu_step's timed steps.
# The defaults fit one call of the device tool (600 s) with the machine's start.
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
python3 -c "import torch, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ortools', ortools.__version__)" \
  | tee -a "$out/machine.txt"
nproc | sed 's/^/cores /' | tee -a "$out/machine.txt"

step() { echo "== $1 ($(date +%T))"; }
step "phase 1: CUDA tests, torchrun and the suite, side by side"
if [ "${SUITE:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES="" timeout "${SUITE_S:-200}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
    -n 10 --maxfail=40 --ignore tests/test_cuda.py ${SUITE_TESTS:-tests} > "$out/suite.txt" 2>&1 &
  suite=$!
fi
CUDA_VISIBLE_DEVICES="" timeout 90 torchrun --standalone --nproc-per-node 2 examples/train_anywhere.py \
  > "$out/torchrun.txt" 2>&1 &
torchrun_job=$!
timeout "${CUDA_S:-200}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short -rs tests/test_cuda.py \
  tests/test_atomic_step.py -k "cuda or gpu" > "$out/cuda_tests.txt" 2>&1
echo "-- CUDA tests"; tail -25 "$out/cuda_tests.txt"
wait $torchrun_job
echo "-- torchrun, 2 ranks (exit $?)"; grep -v Warning "$out/torchrun.txt" | tail -6
if [ "${SUITE:-1}" = 1 ]; then
  wait $suite
  echo "-- the suite on this torch (exit $?)"; grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$out/suite.txt" | tail -30
fi
if [ "${BENCH:-1}" = 1 ]; then
  step "phase 2: bench/gpu_step.py"
  timeout "${STEP_S:-130}" python3 bench/gpu_step.py --device cuda --no-pin --steps "${STEPS:-6}" \
    --json "$out/gpu_step.json" > "$out/gpu_step.txt" 2>&1
  tail -24 "$out/gpu_step.txt"
  step "phase 2: bench/memory_bound.py"
  timeout "${MEMORY_S:-120}" python3 bench/memory_bound.py --steps 2 --no-eager --json "$out/memory_bound.json" \
    > "$out/memory_bound.txt" 2>&1
  tail -24 "$out/memory_bound.txt"
  step "phase 2: bench/compiled_stages.py, cuda_graphs"
  timeout "${GRAPHS_S:-110}" python3 bench/compiled_stages.py --device cuda --no-pin --layers 12 --dim 768 --heads 12 \
    --batch 16 --length 512 --precision bf16 --devices 1 --steps 6 --no-compile > "$out/cuda_graphs.txt" 2>&1
  tail -16 "$out/cuda_graphs.txt"
fi
step "done"
