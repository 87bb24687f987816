#!/usr/bin/env bash
# A training-step change beside its baseline, in one call on one GPU (issue 69; at most 9.5 minutes): the
# default recipe (DFlash 2 + KL) at Qwen3-8B's shapes on the baseline tree (this one with PATCH reversed) and on
# this one (with its profile, the GPU's idle gaps and the host's syncs), then the paper's recipe (DFlash + CE) on
# this one (benchmarks/train_throughput.py, one rank).
#   git diff BASE -- workflow > PATCH; bash benchmarks/gpu_train_ab.sh OUT_DIR PATCH
# Env: ORDER="new base" (the first run also pays the cold compile; the shared cache serves the second);
# STEPS (train_throughput's, default 20); CE=0: no paper's-recipe row; PROFILE=0: no profile or syncs;
# MID=PATCH2: a third tree after the two, this one with PATCH2 (a part of PATCH) reversed: the rest of PATCH alone.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_train_ab.sh OUT_DIR PATCH}"); patch_file=$(realpath "${2:?usage: gpu_train_ab.sh OUT_DIR PATCH}")
mkdir -p "$out"; mid_patch=${MID:+$(realpath "$MID")}
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
base=$(mktemp -d); cp -r benchmarks workflow "$base"/ && (cd "$base" && patch -s -R -p1 < "$patch_file") || { echo "the patch does not reverse"; exit 1; }
cache=$(mktemp -d)  # shared: the two trees' compiled graphs are the same where their code is
run() {  # NAME TREE SECONDS ARGS...
  local name=$1 tree=$2 limit=$3; shift 3
  echo "[$(date +%T)] $name"
  timeout "$limit" python3 "$tree/benchmarks/train_throughput.py" --cache "$cache" --steps "${STEPS:-20}" --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "rc $?"; python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('context_tokens_per_s', 'step_s', 'split_ms', 'mfu', 'first_losses', 'error')}, r.get('memory', {}).get('peak_gib'))" "$out/$name.json" 2>/dev/null || tail -3 "$out/$name.log"
}
for which in ${ORDER:-base new}; do
  if [ "$which" = base ]; then run dflash2_kl_base "$base" 200
  elif [ "${PROFILE:-1}" = 0 ]; then run dflash2_kl_new . 200
  else run dflash2_kl_new . 220 --profile "$out/profile_dflash2_kl_new.txt" --syncs "$out/syncs_dflash2_kl_new.txt"; fi
done
if [ -n "$mid_patch" ]; then
  mid=$(mktemp -d); cp -r benchmarks workflow "$mid"/
  if (cd "$mid" && patch -s -R -p1 < "$mid_patch"); then run dflash2_kl_mid "$mid" 170; else echo "MID does not reverse"; fi
fi
[ "${CE:-1}" = 0 ] || run dflash_ce_new . 150 --set arch=dflash loss=ce
echo "[$(date +%T)] done"
