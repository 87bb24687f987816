#!/usr/bin/env bash
# Create .venv and install the pinned CPU stack plus this package (editable).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# --no-compile: no .pyc for every file of every package at install time (half of a fresh install's
# 2.6 min on 2 cores); Python writes them for the modules it imports, when it imports them
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps -e .
