#!/usr/bin/env bash
# Where the DFlash draft's time goes (issues 70 and 68), in one call on one GPU (at most 9.2 minutes):
#  1. the CUDA paths' checks (tests/test_cuda_paths.py: captured/compiled steps decode as the eager ones,
#     the compiled flex drafter drafts as the eager one),
#  2. the draft's kernels at SmolLM2's shapes, DFlash and DFlash 2 (decode_speed.py --parts profile_draft),
#  3. the batch-1 steps at SmolLM2's shapes with the config's DFlash 2 drafter,
#  4. the draft's kernels at Qwen3-8B shapes (DFlash: the figures' drafter).
#   bash benchmarks/gpu_draft.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_draft.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
t cuda_paths; timeout 150 python3 tests/test_cuda_paths.py > "$out/cuda_paths.log" 2>&1; echo "rc $?"
grep -E "^ok|drafts equal|Error" "$out/cuda_paths.log" | head -12
t profile_draft_smollm2; timeout 130 python3 benchmarks/decode_speed.py --shapes smollm2 --block-size 8 --parts profile_draft \
  --out "$out/profile_draft_smollm2.json" > "$out/profile_draft_smollm2.log" 2>&1; echo "rc $?"
grep '^{"dflash' "$out/profile_draft_smollm2.log"
t batch1_smollm2_dflash2; timeout 100 python3 benchmarks/decode_speed.py --shapes smollm2 --block-size 8 --arch dflash2 --parts batch1 \
  --no-eager --static-modes static_compiled --out "$out/batch1_smollm2_dflash2.json" > "$out/batch1_smollm2_dflash2.log" 2>&1; echo "rc $?"
grep -E '"(ar_|dflash_block|draft_|verify_)' "$out/batch1_smollm2_dflash2.log" | tail -6
t profile_draft_qwen3_8b; timeout 170 python3 benchmarks/decode_speed.py --parts profile_draft --out "$out/profile_draft_qwen3_8b.json" \
  > "$out/profile_draft_qwen3_8b.log" 2>&1; echo "rc $?"
grep '^{"dflash' "$out/profile_draft_qwen3_8b.log"
t done
