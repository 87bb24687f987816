"""Write the bytecode (.pyc) of every module the pipeline's jobs import, once, after setup.

setup.sh installs with ``pip --no-compile`` (compiling all of torch and transformers is half of
a fresh install's time). Python normally writes a module's .pyc when it first imports it, but
not where ``PYTHONDONTWRITEBYTECODE`` is set (some shells and CI images set it): then every job
would compile torch and transformers from source again (measured on 2 cores: the export job's
imports 18 s without .pyc, 7 s with). setup.sh runs this script with bytecode writing on, so the
modules the jobs import are compiled once (~30 s on 2 cores), and the rest of the packages never.
Snakemake's own imports (its plugins, and what they import: nbformat, docutils, requests, ...) are
compiled by one dry run of the workflow in a scratch folder, so that every `snakemake` a user or a test
types starts without compiling them.
"""

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Imported lazily by the jobs (inside functions, or by transformers on demand): named here.
LAZY = [
    "snakemake.cli",
    "snakemake.script",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "transformers.generation.utils",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
    "pyarrow.parquet",
]

t0 = time.time()
import dflashpipe  # noqa: E402

for mod in pkgutil.walk_packages(dflashpipe.__path__, "dflashpipe."):
    importlib.import_module(mod.name)
for name in LAZY:
    importlib.import_module(name)
with tempfile.TemporaryDirectory() as scratch:  # plans the default run; writes nothing but Snakemake's metadata there
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    plan = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(repo / "Snakefile"), "-d", scratch, "-n", "--quiet"],
                          env=env, capture_output=True, text=True)
    if plan.returncode:  # not fatal here: the bytecode is only a speed-up; the checks that follow say what is wrong
        print(f"precompile: the dry run of the workflow failed (rc {plan.returncode}): {plan.stderr.strip()[-300:]}")
print(f"precompile: bytecode of the jobs' imports written in {time.time() - t0:.0f} s")
