#!/usr/bin/env bash
# A decoding change beside its baseline, in one call on one GPU (at most 9.5 minutes): the CUDA paths'
# checks on the new tree, then the batch-1 steps (decode_speed.py --parts batch1) at Qwen3-8B's shapes
# (the figures' DFlash drafter) and SmolLM2's (the config's DFlash 2, blocks of 8), baseline then new for each,
# then the new draft's kernels at SmolLM2's shapes. The baseline is this tree with PATCH reversed
# (`git diff BASE > PATCH` before the call; carry the patch).
#   bash benchmarks/gpu_batch1_ab.sh OUT_DIR PATCH
# Env: SKIP_CHECKS=1, SKIP_PROFILE=1, ORDER="new base", BATCH1_TIMEOUT_S (170 a run), SHAPES (qwen3_8b smollm2).
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_batch1_ab.sh OUT_DIR PATCH}"); patch_file=$(realpath "${2:?usage: gpu_batch1_ab.sh OUT_DIR PATCH}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t() { echo "[$(date +%T)] $*"; }
nvidia-smi --query-gpu=name --format=csv,noheader
base=$(mktemp -d); cp -r benchmarks workflow "$base"/ && (cd "$base" && patch -s -R -p1 < "$patch_file") || { echo "the patch does not reverse"; exit 1; }
[ "${SKIP_CHECKS:-0}" = 1 ] || { t cuda_paths; timeout 140 python3 tests/test_cuda_paths.py > "$out/cuda_paths.log" 2>&1; echo "rc $?"
grep -E "^ok|drafts equal|Error" "$out/cuda_paths.log" | head -12; }
batch1() {  # name tree args...
  local name=$1 tree=$2; shift 2
  t "$name"; timeout "${BATCH1_TIMEOUT_S:-170}" python3 "$tree/benchmarks/decode_speed.py" --parts batch1 --no-eager --static-modes static_compiled \
    "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1; echo "rc $?"
  grep -E '"(ar_static_compiled_ms|dflash_block_static|draft_static|verify_static)' "$out/$name.log" | tail -5
}
for shapes in ${SHAPES:-qwen3_8b smollm2}; do
  args=(--shapes "$shapes"); [ "$shapes" = smollm2 ] && args+=(--block-size 8 --arch dflash2)
  for which in ${ORDER:-base new}; do  # ORDER="new base": the first run of a shape also pays the cold compile
    if [ "$which" = base ]; then batch1 "batch1_${shapes}_base" "$base" "${args[@]}"; else batch1 "batch1_${shapes}_new" . "${args[@]}"; fi
  done
done
[ "${SKIP_PROFILE:-0}" = 1 ] && { t done; exit 0; }
t profile_draft_smollm2; timeout 60 python3 benchmarks/decode_speed.py --shapes smollm2 --block-size 8 --parts profile_draft \
  --out "$out/profile_draft_smollm2.json" > "$out/profile_draft_smollm2.log" 2>&1; echo "rc $?"
grep '^{"dflash' "$out/profile_draft_smollm2.log" | cut -c1-400
t done
