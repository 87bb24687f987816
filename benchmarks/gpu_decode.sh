#!/usr/bin/env bash
# Issue 24's regeneration and evaluation rows, in one call (one GPU, Qwen3-8B shapes):
#  1. the CUDA paths' correctness checks (tests/test_cuda_paths.py: captured and compiled steps decode
#     what the eager ones do; the FP8 target's matmuls),
#  2. regeneration (the batched backend, flex, compiled) on 1,024 prompts from an EMPTY compile cache,
#  3. the same in a second process with the cache the first one filled (as a later expansion job on the
#     same GPU slot finds it), at 256 and 512 rows,
#  4. the evaluation's batch-1 loops with compiled steps: AR per token, the DFlash step,
#  5. the FP8 target's training step with activation_memory_budget 0.5, with what is alive at its peak.
#   bash benchmarks/gpu_decode.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu_decode.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
t() { echo "[$(date +%T)] $*"; }
t cuda_paths; timeout 150 python3 tests/test_cuda_paths.py > "$out/cuda_paths.log" 2>&1; echo "rc $?"; grep -E "^ok|Error" "$out/cuda_paths.log" | head
export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
t expand_cold; timeout 170 python3 benchmarks/decode_speed.py --parts expand --slots 256:flex:compiled --batched-prompts 1024 \
  --prompts 1024 --baseline-prompts 0 --cb-configs '[]' --out "$out/expand_cold_cache.json" > "$out/expand_cold_cache.log" 2>&1; echo "rc $?"
t expand_warm; timeout 200 python3 benchmarks/decode_speed.py --parts expand --slots 256:flex:compiled,512:flex:compiled \
  --batched-prompts 1024 --prompts 1024 --baseline-prompts 0 --cb-configs '[]' --out "$out/expand_warm_cache.json" > "$out/expand_warm_cache.log" 2>&1; echo "rc $?"
grep -hoE '"(slots|mode|useful_tokens_per_s|setup_compile_capture_s|decode_step_ms_at_mean_position)": [^,]*' "$out"/expand_*_cache.log
t batch1; timeout 230 python3 benchmarks/decode_speed.py --parts batch1 --static-modes static_compiled --no-eager --out "$out/batch1.json" > "$out/batch1.log" 2>&1; echo "rc $?"
grep -E '"(ar_|dflash_block|draft_|verify_)' "$out/batch1.log"
t train_fp8_budget; timeout "${TRAIN_TIMEOUT_S:-110}" python3 benchmarks/train_throughput.py --set arch=dflash loss=ce target_fp8=true activation_memory_budget=0.5 \
  --memory "$out/memory_peak_dflash_ce_fp8_budget0.5.txt" --out "$out/dflash_ce_fp8_budget0.5.json" > "$out/dflash_ce_fp8_budget0.5.log" 2>&1; echo "rc $?"
grep -E '"(context_tokens_per_s|peak_gib|after_step_gib|error)"' "$out/dflash_ce_fp8_budget0.5.json" | head -4
t done
