#!/usr/bin/env bash
# Multi-GPU figures of benchmarks/results/ (needs 2 GPUs, e.g. the nvidia-h200-x2 kind):
#   bash benchmarks/gpu_multi_rank.sh OUT_DIR
# 1. the training step at Qwen3-8B shapes with K=1 then K=2 ranks (DDP + ZeRO-1, one sequence per GPU),
#    then K=2 with replicated AdamW state, to compare (benchmarks/train_throughput.py);
# 2. nothing else: the pipeline on 2 GPUs is benchmarks/gpu_pipeline_shards.sh.
set -uo pipefail
out=${1:?usage: gpu_multi_rank.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
timeout 330 python3 benchmarks/train_throughput.py --ranks 1,2 --out "$out/throughput_k1_k2_zero.json" \
  > "$out/throughput_k1_k2_zero.log" 2>&1
echo "zero: rc $?"; grep -E '^\{"ranks"' "$out/throughput_k1_k2_zero.log"
timeout 200 python3 benchmarks/train_throughput.py --ranks 2 --optimizer replicated \
  --out "$out/throughput_k2_replicated.json" > "$out/throughput_k2_replicated.log" 2>&1
echo "replicated: rc $?"; grep -E '^\{"ranks"' "$out/throughput_k2_replicated.log"
