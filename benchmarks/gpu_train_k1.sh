#!/usr/bin/env bash
# Issue 24's training row, re-measured in one call with its baselines (one GPU, Qwen3-8B shapes):
# the default recipe (DFlash 2 + KL) at K = 1 as the pipeline runs it now (no DDP, plain AdamW),
# the same step through DDP + ZeRO-1 (the one-rank path before), and the paper's recipe (DFlash + CE);
# then both recipes with train.activation_memory_budget 0.5, with what is alive at the memory peak.
#   bash benchmarks/gpu_train_k1.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_train_k1.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
cache=$(mktemp -d)  # shared: the baseline's graphs are the default's
run() {  # NAME ARGS...
  local name=$1; shift
  timeout 280 python3 benchmarks/train_throughput.py --cache "$cache" --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "$name: rc $?"; grep -E '"(context_tokens_per_s|step_s|peak_gib|error)"' "$out/$name.json"
}
run k1_default
run k1_default_ddp --ddp
run k1_dflash_ce --set arch=dflash loss=ce
run k1_default_budget0.5 --set activation_memory_budget=0.5 --memory "$out/memory_peak_default_budget0.5.txt"
run k1_dflash_ce_budget0.5 --set arch=dflash loss=ce activation_memory_budget=0.5 --memory "$out/memory_peak_dflash_ce_budget0.5.txt"
