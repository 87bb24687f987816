#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the CI checks offline, on 1 torch thread: the workflow's
# conventions first (snakemake --lint, snakefmt --check, the default graph plans), then pytest
# (the SLURM tests included: their cluster software is installed here, as root).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the end-to-end runs.
# pytest runs TEST_WORKERS workers (pytest-xdist; default 2, this machine's cores; 0: in this process),
# each test file whole in one worker (its module fixtures, e.g. the SLURM cluster, start once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false

# tests/test_slurm.py starts a two-node SLURM cluster on this machine (network namespaces): as root, its
# software is installed when missing (Debian: ~15 s, once) and the tests must run; elsewhere they skip
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DFLASH_REQUIRE_SLURM=1
  for prog in slurmctld slurmd munged srun ip nsenter; do
    if ! command -v "$prog" >/dev/null; then
      echo "== apt-get install slurm-wlm munge iproute2 (for tests/test_slurm.py)"
      DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge iproute2 >/dev/null
      break
    fi
  done
fi
PATH="$PWD/.venv/bin:$PATH"

echo "== snakemake --lint"
snakemake --lint # exits 1 on any finding
echo "== snakefmt --check ."
snakefmt --check . # exits 1 when a file would be reformatted, 123 on a parse error
echo "== snakemake -n (default config)"
plan=$(snakemake -n --quiet all 2>&1) || { echo "$plan"; exit 1; }

exec python -m pytest -q -rs -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
