# Input functions and shared helpers. Nothing here runs a stage.

import os
import sys
from pathlib import Path

REPO = Path(workflow.basedir)
sys.path.insert(0, str(REPO / "workflow"))

from dflashpipe.codedeps import script_closure
from dflashpipe.config import validate_config
from dflashpipe.errors import UserError
from dflashpipe.target import check_target_dir

_config_source = ", ".join(str(f) for f in workflow.configfiles) or "config"
try:
    validate_config(config, str(REPO / "workflow/schemas/config.schema.yaml"), _config_source)
    if config["target"]["path"] is not None:
        check_target_dir(config["target"]["path"])
except UserError as err:
    raise SystemExit(f"ERROR: {err}")

R = config["results"]
LIB = REPO / "workflow" / "dflashpipe"


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
    out += [f"{R}/tokenized/train", f"{R}/tokenized/stats.json"]
    out += all_stamps()
    out += [o for k in range(SHARDS) for o in shard_outputs(k)] + [f"{R}/drafter"]
    out += expand(f"{R}/eval/{{d}}.summary.json", d=datasets_for("eval"))
    out += [f"{R}/plots/tau_speedup.png"]
    return out


# ---------------------------------------------------------------------------
# GPU slots, compile-warm chain and training shards
# ---------------------------------------------------------------------------

import importlib.metadata
import uuid

SLOTS = config["gpu"]["slots"]
SHARDS = config["train"]["shards"]
CACHE_ROOT = f"{R}/compile_cache"

# One id per invocation of the workflow, inherited by its jobs (also through a
# cluster executor's exported environment): the shards of one run meet in a
# rendezvous file no earlier (possibly killed) run has used.
os.environ.setdefault("DFLASH_RUN_ID", uuid.uuid4().hex[:12])


def _refuse(msg):
    raise SystemExit(f"ERROR: {msg}")


if SHARDS > SLOTS:
    _refuse(
        f"train.shards is {SHARDS} but gpu.slots is {SLOTS}: every shard needs its own GPU slot; "
        "raise gpu.slots or lower train.shards"
    )
_gpu_budget = workflow.global_resources.get("gpu")
_gpu_budget = getattr(_gpu_budget, "value", _gpu_budget)
if isinstance(_gpu_budget, int) and _gpu_budget < SHARDS:
    _refuse(
        f"train.shards is {SHARDS} but --resources gpu={_gpu_budget}: the {SHARDS} shards of one run must "
        f"run at the same time; use --resources gpu={SHARDS} or more, or lower train.shards"
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


#: Keys that change how a job is operated, not what it computes: jobs read them from the
#: config at run time, so changing them reruns nothing (and a killed training run resumes
#: from its checkpoints, which are keyed by the other keys).
RUNTIME_KEYS = {
    "expand": ("threads",),
    "train": ("threads", "checkpoint_every", "dist_timeout_s"),
    "evaluate": ("threads",),
    "ar_draft": ("threads", "max_minutes"),
}


def section_params(section):
    """A config section as rule params: without its run-time keys."""
    return {k: v for k, v in config[section].items() if k not in RUNTIME_KEYS[section]}


def all_stamps():
    return [warm_stamp(i) for i in range(SLOTS)]


def compile_settings():
    """The config that decides compiled code (the warm jobs' params: other keys do not rerun them)."""
    from dflashpipe.hotstart import COMPILE_KEYS  # light: the DAG build imports no torch

    return {"drafter": config["drafter"], "train": {k: config["train"][k] for k in COMPILE_KEYS}}


def shard_outputs(shard):
    return [f"{R}/train/shard{shard}.summary.json", f"{R}/train/shard{shard}.metrics.csv"]


def ar_draft_dir():
    """The assisted-generation peer's draft model, when that peer is evaluated."""
    return [f"{R}/ar_draft"] if "assisted" in config["evaluate"]["methods"] else []
