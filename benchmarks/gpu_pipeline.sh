#!/usr/bin/env bash
# The default pipeline on one GPU through Snakemake (benchmarks/results/h200_default/):
#   bash benchmarks/gpu_pipeline.sh OUT_DIR [more snakemake args]
# The target is the shipped tiny one (config/gpu_1x_tiny.yaml). Packs the small
# results (tables, plots, logs, summaries, stamps, benchmark TSVs) into
# OUT_DIR/results.tar.gz and prints the wall time and each job's span, split into start-up, compiling and work
# (benchmarks/pipeline_jobs.py).
set -uo pipefail
out=${1:?usage: gpu_pipeline.sh OUT_DIR [snakemake args]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
start=$(date +%s)
timeout "${PIPELINE_TIMEOUT_S:-540}" python3 -m snakemake --cores 8 --resources gpu=1 \
  --configfile config/config.yaml config/gpu_1x_tiny.yaml "$@" > "$out/snakemake.log" 2>&1
rc=$?
echo "snakemake rc $rc, wall $(( $(date +%s) - start )) s"
tail -25 "$out/snakemake.log"
python3 benchmarks/pipeline_jobs.py "$out/snakemake.log" --root . --csv "$out/jobs.csv" | tee "$out/jobs.md"
tar czf "$out/results.tar.gz" --ignore-failed-read results/tables results/plots results/logs results/warm \
  results/benchmarks results/eval/*.json results/train/*.json results/train/*.csv results/tokenized/stats.json \
  results/ar_draft/ar_draft_metrics.json 2>/dev/null
exit $rc
