#!/usr/bin/env bash
# Create .venv and install the pinned CPU stack plus this package (editable).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
