#!/usr/bin/env bash
# The batch-1 decode step with the target's layers written out and their projections fused
# (dflashpipe.decode.layer) against HF's layer modules, in one call on one GPU, Qwen3-8B shapes:
#  1. the CUDA paths' correctness checks (tests/test_cuda_paths.py: captured, compiled, fused steps
#     decode what the eager ones do),
#  2. batch 1 (AR per token, verify, draft, the DFlash step) with both, then the AR step's GPU kernels
#     with both (decode_speed.py --parts batch1,profile_ar), in one process.
# Run from the repo root with .whl carried:   OUT=dir bash benchmarks/gpu_fused.sh
set -uo pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
t() { echo "[$(date +%T)] $*"; }
t cuda_paths; timeout 150 python3 tests/test_cuda_paths.py > "$OUT/cuda_paths.log" 2>&1; echo "rc $?"; grep -E "^ok|Error|assert" "$OUT/cuda_paths.log" | head
t batch1_profile; timeout 330 python3 benchmarks/decode_speed.py --parts batch1,profile_ar --no-eager \
  --static-modes static_compiled_hf_layers,static_compiled --out "$OUT/batch1_fused.json" > "$OUT/batch1_fused.log" 2>&1; echo "rc $?"
grep -E '"(ar_static|dflash_block_static|draft_static|verify_static|mode|ar_ms_per_token_wall|kernels_per_token|gpu_busy_ms_per_token|matmul|attention|memory_bound)' "$OUT/batch1_fused.log"
t done
