#!/usr/bin/env bash
# The default pipeline on 2 GPUs through Snakemake with K training shards (benchmarks/results/h200x2_shards/):
#   bash benchmarks/gpu_pipeline_shards.sh OUT_DIR 2     # 2 shards: expansion, warm chain, training, evaluation
#   bash benchmarks/gpu_pipeline_shards.sh OUT_DIR 1     # then 1 shard in the same results/: the warm chain
#                                                        # (other shapes per GPU), training and evaluation rerun
# The same recipe must give the same drafter. Needs gpu_inputs/tiny_target (see config/gpu_1x_tiny.yaml).
# GPUS=8 ... 8 on an 8-GPU node.
# Builds training and the held-out math evaluation (DFlash and AR; the peers are in h200_default/), packs
# the small results into OUT_DIR/k<K>.tar.gz and prints the figures compared.
set -uo pipefail
out=${1:?usage: gpu_pipeline_shards.sh OUT_DIR K [TIMEOUT_S]}
k=${2:?usage: gpu_pipeline_shards.sh OUT_DIR K [TIMEOUT_S]}
mkdir -p "$out"
cd "$(dirname "$0")/.."
gpus=${GPUS:-2}  # GPUs of the machine: expansion shards and Snakemake's gpu budget
printf 'gpu: {slots: %s}\nexpand: {shards: %s}\ntrain: {shards: %s}\nevaluate: {methods: [dflash, ar]}\n' "$k" "$gpus" "$k" > "$out/k$k.yaml"
start=$(date +%s)
timeout "${3:-560}" python3 -m snakemake results/train/summary.json results/eval/math_heldout.summary.json \
  --cores 16 --resources gpu="$gpus" --configfile config/config.yaml config/gpu_1x_tiny.yaml "$out/k$k.yaml" \
  > "$out/snakemake_k$k.log" 2>&1
echo "k$k: snakemake rc $?, wall $(( $(date +%s) - start )) s"
grep -E "ERROR|Error in rule" "$out/snakemake_k$k.log" | head -5
tar czf "$out/k$k.tar.gz" --ignore-failed-read results/logs results/warm results/benchmarks results/eval/*.json \
  results/train/*.json results/train/*.csv results/tokenized/stats.json 2>/dev/null
python3 - "$k" <<'PY'
import json, sys
s = json.load(open("results/train/summary.json"))
e = json.load(open("results/eval/math_heldout.summary.json"))["methods"]["dflash"]
hot = [r["hot_start"]["counters"] for r in s["ranks"]]
print("k" + sys.argv[1], {k: s[k] for k in ("steps", "world_size", "global_batch", "rank_batch", "heldout_acc", "tokens_per_s")},
      "misses", [c["fxgraph_cache_miss"] + c["autograd_cache_miss"] for c in hot],
      "tau_pooled", e["tau_pooled"], "speedup", e["speedup_vs_ar"])
PY
