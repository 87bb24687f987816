"""A user's own target and corpus (issue 63): the recipe a real target trains, through Snakemake."""

from __future__ import annotations

import shutil

import yaml

from conftest import PROMPTS, REPO, snakemake, write_config
from dflashpipe.config import TINY_RECIPE, load_yaml
from dflashpipe.jobs.settings import SCHEMA_PATH, load_schema


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _schema_default(dotted: str):
    node = load_schema(str(SCHEMA_PATH))
    for part in dotted.split("."):
        node = node["properties"][part]
    return node["default"]


def _checkout_like(tmp_path):
    """A working folder like the checkout: the shipped config/config.yaml where the Snakefile looks for it,
    so that a user's --configfile overlays it, as it does from a clone."""
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config/config.yaml", tmp_path / "config/config.yaml")
    return tmp_path


def test_a_real_target_trains_the_real_recipe_and_the_tiny_one_the_demo_cuts(tmp_path, micro_target):
    """An overlay naming only a real target.path and its datasets inherits none of the CPU demo's cuts: every
    key of config/tiny_target.yaml takes the schema's default; the console says the recipe and whose it is,
    and results/effective_config.yaml records every key. The embedded target keeps the cuts, under the keys a
    user sets."""
    work = _checkout_like(tmp_path)
    data = {"mine": {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 8},
            "mine_eval": {"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "use": "eval"}}
    user = write_config(work / "user.yaml", {"target": {"path": str(micro_target)}, "datasets": data})
    res = snakemake(work, "effective_config", "--cores", "1", "--configfile", str(user))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("recipe: drafter.arch=dflash2 train.loss=kl drafter.num_layers=5 drafter.block_size=16 (the schema's "
            "recipe for a real target, under your config)") in res.stderr
    effective = yaml.safe_load((work / "results/effective_config.yaml").read_text())
    cuts = dict(_leaves(load_yaml(str(TINY_RECIPE))))
    assert len(cuts) > 20
    for key in cuts:
        assert _get(effective, key) == _schema_default(key), key
    assert set(effective["datasets"]) == {"mine", "mine_eval"} and effective["target"]["path"] == str(micro_target)

    # the embedded target: the demo's cuts fill what the files leave out; a key the user sets wins
    tiny = write_config(work / "tiny.yaml", {"drafter": {"num_layers": 2}, "datasets": data})
    res = snakemake(work, "effective_config", "--cores", "1", "--configfile", str(tiny))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("recipe: drafter.arch=dflash2 train.loss=ce drafter.num_layers=2 drafter.block_size=6 (the embedded tiny "
            "target's 2-core demo recipe, config/tiny_target.yaml, under your config)") in res.stderr
    effective = yaml.safe_load((work / "results/effective_config.yaml").read_text())
    for key, value in cuts.items():
        assert _get(effective, key) == (2 if key == "drafter.num_layers" else value), key
