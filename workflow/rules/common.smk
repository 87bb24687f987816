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
    return out
