#!/usr/bin/env bash
# Regeneration (the batched expansion backend, 512 rows, flex, compiled) on 1,024 prompts at Qwen3-8B
# shapes, with q/k/v and gate/up as separate matmuls (the baseline) and fused, in one process, both
# from an empty compile cache. Run from the repo root with .whl carried:
#   OUT=dir bash benchmarks/gpu_regen_fused.sh
set -uo pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
echo "[$(date +%T)] regeneration"
timeout 270 python3 benchmarks/decode_speed.py --parts expand --slots 512:flex:compiled:unfused,512:flex:compiled \
  --batched-prompts 1024 --prompts 1024 --baseline-prompts 0 --cb-configs '[]' --out "$OUT/regen_fused.json" > "$OUT/regen_fused.log" 2>&1
echo "rc $?"
grep -hoE '"(slots|mode|useful_tokens_per_s|setup_compile_capture_s|decode_step_ms_at_mean_position|error)": [^,]*' "$OUT/regen_fused.log"
echo "[$(date +%T)] done"
