#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the CI test suite offline, on 1 torch thread.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the end-to-end runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider "$@"
