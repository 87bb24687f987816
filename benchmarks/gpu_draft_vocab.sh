#!/usr/bin/env bash
# The draft vocabulary beside the whole one at Qwen3-8B's shapes (evaluate.draft_vocab; issue 70), in one call
# on one GPU: decode_speed.py's batch-1 steps without it, then with 32,768 tokens (the first ids stand for the
# most frequent: the time does not depend on which), then, in what is left of BUDGET_S (330), flex's tiles for
# the verify's attention (benchmarks/flex_blocks.py).
#   bash benchmarks/gpu_draft_vocab.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_draft_vocab.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
budget=${BUDGET_S:-330}
for v in 0 32768; do
  t "batch1_qwen3_8b_vocab$v"; timeout 150 python3 benchmarks/decode_speed.py --parts batch1 --no-eager \
    --static-modes static_compiled --draft-vocab $v --out "$out/batch1_qwen3_8b_vocab$v.json" > "$out/batch1_qwen3_8b_vocab$v.log" 2>&1
  echo "rc $?"; grep -E '"(ar_static_compiled_ms|dflash_block_static|draft_static|verify_static)' "$out/batch1_qwen3_8b_vocab$v.log" | tail -4
done
left=$((budget - SECONDS))
if [ "$left" -gt 40 ]; then
  t "flex_blocks ($left s)"; timeout "$left" python3 benchmarks/flex_blocks.py --steps verify_qwen3_8b,verify_smollm2,draft_smollm2 \
    --tiles 16x64x4,16x128x4,32x64x4 --out "$out/flex_blocks.json" 2>&1 | grep '^{"' | tee "$out/flex_blocks.log"
fi
t done
