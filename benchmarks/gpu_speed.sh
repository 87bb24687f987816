#!/usr/bin/env bash
# Issue 37's GPU figures on one H200, from the repo root (.whl carried for `datasets`):
#   bash benchmarks/gpu_speed.sh profile OUT   # DFlash 2 + KL vs the paper's recipe: step split,
#                                              # profiler tables, memory at the peak
#   bash benchmarks/gpu_speed.sh train OUT     # the training figures, baselines in the same call
#   bash benchmarks/gpu_speed.sh memory OUT    # DFlash 2 + KL with train.activation_memory_budget 1 and 0.7
#   bash benchmarks/gpu_speed.sh batch1 OUT    # the evaluation's batch-1 AR and DFlash steps
set -uo pipefail
what=${1:?usage: gpu_speed.sh profile|train|memory|batch1 OUT}
out=${2:?usage: gpu_speed.sh $what OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
summary() { grep -E '"(context_tokens_per_s|step_s|peak_gib|mfu|error|target_forward|drafter_forward|backward|optimizer)"' "$1"; }
tput() {  # NAME SECONDS ARGS...: one training-throughput run
  local name=$1 limit=$2; shift 2
  echo "[$(date +%T)] $name"
  timeout "$limit" python3 benchmarks/train_throughput.py --cache /tmp/inductor_cache "$@" \
    --out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "rc $?"; summary "$out/$name.json" 2>/dev/null || tail -3 "$out/$name.log"
}
case $what in
profile)
  tput dflash2_kl 170 --steps 10 --profile "$out/profile_dflash2_kl.txt" --memory "$out/memory_dflash2_kl.txt"
  tput dflash_ce 140 --steps 10 --set arch=dflash loss=ce --profile "$out/profile_dflash_ce.txt" \
    --memory "$out/memory_dflash_ce.txt"
  tput dflash2_ce 110 --steps 10 --set loss=ce
  tput dflash2_kl_no_selector 110 --steps 10 --set selector_weight=0
  ;;
train)
  tput dflash2_kl 200 --profile "$out/profile_dflash2_kl.txt" --memory "$out/memory_dflash2_kl.txt"
  tput dflash_ce 160 --set arch=dflash loss=ce --profile "$out/profile_dflash_ce.txt"
  ;;
memory)
  tput dflash2_kl 130 --steps 10
  tput dflash2_kl_budget07 130 --steps 10 --set activation_memory_budget=0.7
  ;;
batch1)
  echo "[$(date +%T)] batch1"
  timeout 200 python3 benchmarks/decode_speed.py --parts batch1 --no-eager --static-modes static_compiled \
    --out "$out/batch1.json" > "$out/batch1.log" 2>&1
  echo "rc $?"; grep -E '"(ar_static_compiled_ms_per_token|verify_static_compiled_ms|dflash_block_static_compiled_ms|draft_static_compiled_ms|memory_bound_ms_per_token|dflash_block_over_ar_static_compiled)"' "$out/batch1.json"
  ;;
*)
  echo "unknown: $what" >&2; exit 2 ;;
esac
echo "[$(date +%T)] done"
# the device returns few files: all of them in one
tar czf "/tmp/$what.tar.gz" -C "$out" . && rm -rf "${out:?}"/* && mv "/tmp/$what.tar.gz" "$out/"
