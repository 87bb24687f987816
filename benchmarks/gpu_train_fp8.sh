#!/usr/bin/env bash
# Issue 24's training row with the target in FP8 (train.target_fp8), in one call with its bf16 baselines
# (one GPU, Qwen3-8B shapes: S = 3072, 512 anchors, block 16, 5 drafter layers, compile: layers):
# the paper's recipe (DFlash + CE, the issue's row) and the default recipe (DFlash 2 + KL), each with the
# target in bf16 and in FP8.
#   bash benchmarks/gpu_train_fp8.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_train_fp8.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
cache=$(mktemp -d)  # shared: a run loads the graphs an earlier one compiled where they are the same
run() {  # NAME ARGS...
  local name=$1; shift
  timeout "${RUN_TIMEOUT_S:-130}" python3 benchmarks/train_throughput.py --cache "$cache" --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc $?"; grep -E '"(context_tokens_per_s|step_s|peak_gib|after_step_gib|target_gib|error)"' "$out/$name.json"
}
run dflash_ce --set arch=dflash loss=ce
run dflash_ce_fp8 --set arch=dflash loss=ce target_fp8=true
run default
run default_fp8 --set target_fp8=true
