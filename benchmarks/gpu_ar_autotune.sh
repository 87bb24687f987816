#!/usr/bin/env bash
# The batch-1 AR step (issue 24's evaluation row), in one call on one GPU: why Dynamo splits the
# static target step (decode_speed.py --parts explain), then its GPU kernels with the default
# Inductor settings (the baseline) and with max-autotune (Inductor benchmarks Triton matmul
# templates against cuBLAS for each shape at batch 1). Run from the repo root, .whl carried:
#   OUT=dir bash benchmarks/gpu_ar_autotune.sh
set -uo pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
summary() { grep -E '"(graphs|graph_breaks|ar_ms_per_token_wall|kernels_per_token|gpu_busy_ms_per_token|matmul|attention|fused \(Inductor\))"' "$1"; }
echo "[$(date +%T)] default"; timeout 200 python3 benchmarks/decode_speed.py --parts explain,profile_ar --out $OUT/profile_ar_default.json > $OUT/profile_ar_default.log 2>&1; echo rc $?; summary $OUT/profile_ar_default.log
grep -A8 break_reasons $OUT/profile_ar_default.log | head -12
echo "[$(date +%T)] max_autotune"; timeout 330 python3 benchmarks/decode_speed.py --parts profile_ar --inductor max_autotune=1 --out $OUT/profile_ar_max_autotune.json > $OUT/profile_ar_max_autotune.log 2>&1; echo rc $?; summary $OUT/profile_ar_max_autotune.log
echo "[$(date +%T)] done"
