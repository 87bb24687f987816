#!/usr/bin/env bash
# The training-throughput figures of benchmarks/results/ (one GPU): the three
# train.compile modes at Qwen3-8B shapes, plus a profiler table of the default.
#   bash benchmarks/gpu_throughput.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_throughput.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
for mode in layers flex none; do
  extra=()
  [ "$mode" = layers ] && extra=(--profile "$out/profile_layers.txt")
  python3 benchmarks/train_throughput.py --compile "$mode" --out "$out/throughput_$mode.json" "${extra[@]}" \
    > "$out/throughput_$mode.log" 2>&1
  echo "$mode: rc $?"; grep -E '"(context_tokens_per_s|step_s|peak_gib|mfu|error)"' "$out/throughput_$mode.json"
done
