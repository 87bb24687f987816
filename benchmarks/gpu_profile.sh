#!/usr/bin/env bash
# Where the time goes (issue 24), in one call on one GPU: a pipeline job's start-up steps
# (benchmarks/job_startup.py), the export job's imports, and the batch-1 AR step's GPU kernels
# (decode_speed.py --parts profile_ar). Run from the repo root with the wheels of .whl carried:
#   OUT=dir bash benchmarks/gpu_profile.sh
set -uo pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "[$(date +%T)] startup"; python3 benchmarks/job_startup.py > $OUT/job_startup.json 2>$OUT/job_startup.err; cat $OUT/job_startup.json
echo "[$(date +%T)] importtime"; PYTHONPATH=/tmp/site:workflow python3 -X importtime -c "import dflashpipe.export.write" 2> $OUT/importtime_export.txt; sort -t'|' -k2 -n $OUT/importtime_export.txt | tail -12
echo "[$(date +%T)] profile_ar"; timeout 400 python3 benchmarks/decode_speed.py --parts profile_ar --out $OUT/profile_ar.json > $OUT/profile_ar.log 2>&1; echo rc $?; tail -60 $OUT/profile_ar.log
echo "[$(date +%T)] done"
