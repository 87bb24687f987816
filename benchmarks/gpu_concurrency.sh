#!/usr/bin/env bash
# Issue 37, the speed-up under load, on one GPU:
#  1. the batched decoder's CUDA-graph path decodes what batch-1 AR decodes (tests/test_concurrency_cuda.py),
#  2. benchmarks/concurrency.py at Qwen3-8B shapes (forced tau 3 and 6) and, given RUN_DIR (a finished
#     pipeline run's results directory, e.g. after benchmarks/gpu_pipeline.sh: results), with its
#     target, drafter and held-out prompts (real acceptance).
#   bash benchmarks/gpu_concurrency.sh OUT_DIR [RUN_DIR [TARGET_DIR]]   (TARGET_DIR: default RUN_DIR/target/model)
set -uo pipefail
out=${1:?usage: gpu_concurrency.sh OUT_DIR [RUN_DIR]}
run=${2:-}
target=${3:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t() { echo "[$(date +%T)] $*"; }
t cuda_check; timeout 120 python3 tests/test_concurrency_cuda.py > "$out/cuda_check.log" 2>&1; echo "rc $?"; grep -E "^ok|Error" "$out/cuda_check.log"
t concurrency; timeout 300 python3 benchmarks/concurrency.py --shapes qwen3-8b ${run:+--run "$run"} ${target:+--target "$target"} --out "$out" \
  > "$out/concurrency.log" 2>&1; echo "rc $?"
tail -3 "$out/concurrency.log"
t done
