#!/usr/bin/env bash
# Create .venv and install the pinned CPU stack plus this package (editable).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# --no-compile: no .pyc for every file of every package at install time (half of a fresh install's
# 2.6 min on 2 cores); scripts/precompile.py then writes the .pyc of the modules the jobs import
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile --no-deps -e .
# once per set of pins, with bytecode writing on even where PYTHONDONTWRITEBYTECODE is set (else every
# job would compile torch and transformers from source again: ~10 s per job on 2 cores)
pins=$(cat requirements.txt scripts/precompile.py | sha256sum | cut -c1-16)
[ "$(cat .venv/.precompiled 2>/dev/null)" = "$pins" ] || {
  env -u PYTHONDONTWRITEBYTECODE .venv/bin/python scripts/precompile.py && echo "$pins" > .venv/.precompiled
}
