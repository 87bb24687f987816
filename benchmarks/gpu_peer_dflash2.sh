#!/usr/bin/env bash
# Issue 69: a peer's DFlash 2 trainer beside ours at Qwen3-8B shapes, one call on one GPU (at most 9 minutes):
# our default recipe (DFlash 2 + KL, benchmarks/train_throughput.py, 512 anchors x 1 sequence), then NVIDIA NeMo
# AutoModel 0.7.0's DFlash 2 step (benchmarks/nemo_dflash2_step.py) at our shape (512 x 1) and at its yaml's
# (256 anchors x 2 sequences). From the repo root, with .whl carried:
#   bash benchmarks/gpu_peer_dflash2.sh OUT_DIR
# Env: STEPS (timed steps per row, default 20); OURS=0: no row of ours; OURS_PEER_SHAPES=1: also ours at 256 x 2
# (150 s more: with OURS=0, or a second call, to stay inside the 9 minutes).
#
# Carry .whl (ignored by .gitignore) holding exactly these 5 wheels, 5,124,614 bytes (4.9 MiB) beside the
# ~28 MB of tracked files, well inside the 64 MiB a call:
#   nemo_automodel-0.7.0-py3-none-any.whl                                                       3,773,800
#   datasets-5.2.0-py3-none-any.whl                                                               608,276
#   xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl 472,238
#   multiprocess-0.70.19-py312-none-any.whl                                                       150,281
#   dill-0.4.1-py3-none-any.whl                                                                   120,019
# fetched with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform \
#     manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     nemo-automodel==0.7.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
# NeMo's DFlash modules import `datasets` (through components/datasets/llm); pydantic is optional (a warnings
# filter) and not carried. The rest they import comes with the box's torch 2.11 / transformers 5.17 / pandas /
# pyarrow / Pillow; no pyarrow is carried (a second one broke datasets before: docs/install.md). NeMo 0.7.0 pins
# transformers 5.18 and torchao etc.; --no-deps skips them, the modules run here need neither.
set -uo pipefail
out=$(realpath -m "${1:?usage: gpu_peer_dflash2.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$out/pip.log" 2>&1 || { echo "wheels did not install"; tail -5 "$out/pip.log"; exit 1; }
PYTHONPATH=/tmp/site python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in
  ('torch', 'transformers', 'nemo-automodel', 'datasets', 'pyarrow', 'pandas', 'fsspec')})" | tee "$out/versions.txt"
steps=${STEPS:-20}
summary() { grep -E '"(context_tokens_per_s|step_s|peak_gib|first_step_s|error|target_forward|drafter_forward|backward|optimizer|step_metrics)"' "$1"; }
run() {  # NAME SECONDS SCRIPT ARGS...: one row, its JSON and log under OUT_DIR
  local name=$1 limit=$2 script=$3; shift 3
  echo "[$(date +%T)] $name"
  timeout "$limit" python3 "benchmarks/$script" --steps "$steps" --out "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "rc $?"; summary "$out/$name.json" 2>/dev/null || tail -3 "$out/$name.log"
}
# ours without the carried wheels on the path; NeMo's rows with them
[ "${OURS:-1}" = 0 ] || run ours_dflash2_kl 210 train_throughput.py --cache /tmp/inductor_cache
[ "${OURS_PEER_SHAPES:-0}" = 1 ] && run ours_dflash2_kl_a256_b2 150 train_throughput.py --cache /tmp/inductor_cache \
  --anchors 256 --batch 2
export PYTHONPATH=/tmp/site
run nemo_dflash2_a512_b1 150 nemo_dflash2_step.py --anchors 512 --batch 1
run nemo_dflash2_a256_b2 150 nemo_dflash2_step.py --anchors 256 --batch 2
echo "[$(date +%T)] done"
