# Input functions and shared helpers. Nothing here runs a stage.

import os
import sys
from pathlib import Path

REPO = Path(workflow.basedir)
sys.path.insert(0, str(REPO / "workflow"))

from dflashpipe.codedeps import script_closure
from dflashpipe.config import canonical, compile_keys, prepare_config, result_params
from dflashpipe.errors import UserError

_config_source = ", ".join(str(f) for f in workflow.configfiles) or "config"
try:
    for _note in prepare_config(config, _config_source, workflow.config_settings.configfiles,
                                workflow.config_settings.config):
        print(_note, file=sys.stderr)
except UserError as err:
    raise SystemExit(f"ERROR: {err}")

R = config["results"]
LIB = REPO / "workflow" / "dflashpipe"

# Outputs that several rules name (each spelled once, here).
TOKENIZED = f"{R}/tokenized/train"
TOKENIZED_STATS = f"{R}/tokenized/stats.json"


def eval_summary(dataset):
    return f"{R}/eval/{dataset}.summary.json"


def lib_code(script):
    """Library source files the stage's script imports (transitively): edits to them rerun the stage."""
    return script_closure(LIB, REPO / "workflow" / "scripts" / script)


def repo_path(p):
    """A config path: absolute, or relative to the working directory, else to the repository."""
    if os.path.isabs(p) or os.path.exists(p):
        return p
    return str(REPO / p)


def datasets_for(use):
    return [name for name, spec in config["datasets"].items() if spec["use"] == use]


def dataset_file(wildcards):
    spec = config["datasets"][wildcards.dataset]
    return [repo_path(spec["path"])] if spec.get("path") else []


def dataset_spec(wildcards):
    spec = dict(config["datasets"][wildcards.dataset])
    if spec.get("path"):
        spec["path"] = repo_path(spec["path"])
    return spec


def target_dir():
    """The target model directory: the configured checkpoint, or the tiny default."""
    if config["target"]["path"] is not None:
        return config["target"]["path"]
    return f"{R}/target/model"


def prompts_file(name):
    return f"{R}/prompts/{name}.parquet"


def expanded_shards(wildcards):
    n = config["expand"]["shards"]
    return [f"{R}/expanded/{wildcards.dataset}/shard{i}.parquet" for i in range(n)]


def all_outputs():
    out = [prompts_file(name) for name in config["datasets"]]
    if config["target"]["path"] is None:
        out.append(f"{R}/target/metrics.json")
    out += [TOKENIZED, TOKENIZED_STATS]
    out += all_stamps()
    out += [TRAIN_SUMMARY, TRAIN_METRICS, DRAFTER]
    out += [eval_summary(d) for d in datasets_for("eval")]
    out += [f"{R}/plots/tau_speedup.png"]
    return out


# ---------------------------------------------------------------------------
# GPU slots, compile-warm chain and training shards
# ---------------------------------------------------------------------------

import importlib.metadata

SLOTS = config["gpu"]["slots"]
SHARDS = config["train"]["shards"]
CACHE_ROOT = f"{R}/compile_cache"

# The training run's outputs (one job writes them all, for any number of shards).
TRAIN_SUMMARY = f"{R}/train/summary.json"
TRAIN_METRICS = f"{R}/train/metrics.csv"
DRAFTER = f"{R}/drafter"


def _refuse(msg):
    raise SystemExit(f"ERROR: {msg}")


if SHARDS > SLOTS:
    _refuse(
        f"train.shards is {SHARDS} but gpu.slots is {SLOTS}: every shard needs its own GPU slot (and warm stamp); "
        "raise gpu.slots or lower train.shards"
    )
_gpu_budget = workflow.global_resources.get("gpu")
_gpu_budget = getattr(_gpu_budget, "value", _gpu_budget)
if isinstance(_gpu_budget, int) and _gpu_budget < SHARDS:
    _refuse(
        f"train.shards is {SHARDS} but --resources gpu={_gpu_budget}: the training job runs its {SHARDS} shards "
        f"at once, one GPU each; use --resources gpu={SHARDS} or more, or lower train.shards"
    )


def torch_version():
    """Installed torch (without importing it): a new torch invalidates the compile caches."""
    return importlib.metadata.version("torch")


def warm_stamp(slot):
    return f"{R}/warm/slot{slot}.json"


def previous_stamp(wildcards):
    """warm_slot{i} waits for warm_slot{i-1}: no two compiles ever overlap."""
    slot = int(wildcards.slot)
    return [warm_stamp(slot - 1)] if slot > 0 else []


def all_stamps():
    return [warm_stamp(i) for i in range(SLOTS)]


def compile_settings():
    """The config that decides compiled code (the warm jobs' params: other keys do not rerun them)."""
    return {"drafter": result_params(config, "drafter"), "train": {k: config["train"][k] for k in sorted(compile_keys())}}


def ar_draft_dir():
    """The assisted-generation peer's draft model, when that peer is evaluated."""
    return [f"{R}/ar_draft"] if "assisted" in config["evaluate"]["methods"] else []
