"""Every drafter recipe through the real workflow (mini config): arch, loss, position weights, windows.

Each test changes only drafter/train keys of the shared finished mini run, so Snakemake reruns the
warm chain, training, evaluation, tables and plots (not the target or the data), and checks what a user
reads: the run's summary records the recipe, the evaluation is lossless, and the simulated tau sits
beside the measured one.
"""

import json

import pandas as pd
import pytest
import yaml

from conftest import planned_rules, snakemake, write_config
from dflashpipe.export.write import ARCHITECTURES

RECIPES = {
    # the paper's DFlash and loss with D-PACE weights and a TV term, one sliding-window layer beside a full one
    # (the mini run itself trains the default: DFlash 2 by distillation, full attention)
    "dflash_ce_dpace_swa": {
        "drafter": {"arch": "dflash", "num_layers": 2, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
        "train": {"loss": "ce", "position_weights": "dpace", "tv_weight": 0.5},
    },
    # DFlash 2 (convolutions, candidate selector, capped logits) trained by distillation, all layers sliding
    "dflash2_kl_capped": {
        "drafter": {"arch": "dflash2", "num_layers": 2, "sliding_window": 12, "conv_group_size": 16,
                    "selector_rank": 8, "selector_top_k": 4, "final_logit_softcapping": 20.0,
                    "output_multiplier": 0.5},
        "train": {"loss": "kl"},
    },
    # DSpark (every block position drafts, Markov and confidence heads) with DeepSpec's loss
    "dspark": {
        "drafter": {"arch": "dspark", "num_layers": 1, "markov_rank": 8},
        "train": {"loss": "dspark"},
    },
}
#: run on every push: each arch no other workflow test trains, so every arch goes through Snakemake in CI
#: (the default recipe, DFlash 2, goes through it in every workflow test; tests/test_recipes.py checks the
#: other losses and models without it)
EVERY_PUSH = {"dspark", "dflash_ce_dpace_swa"}


# ~75 s each; those not in EVERY_PUSH with -m slow
@pytest.mark.parametrize("name", [n if n in EVERY_PUSH else pytest.param(n, marks=pytest.mark.slow) for n in sorted(RECIPES)])
def test_recipe_trains_exports_and_evaluates_through_snakemake(mini_copy, name):
    work, cfg_path = mini_copy
    cfg = yaml.safe_load(cfg_path.read_text())
    recipe = RECIPES[name]
    for section, keys in recipe.items():
        cfg[section].update(keys)
    cfg["evaluate"]["methods"] = ["dflash", "ar"]  # the recipe is the drafter: its peers are tested elsewhere
    write_config(cfg_path, cfg)
    planned = set(planned_rules(work, "--configfile", str(cfg_path)))
    assert {"warm_slot", "train", "evaluate", "tables", "plots"} <= planned
    assert not planned & {"tiny_target", "expand_shard", "tokenize", "prompts"}  # data and target are kept
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = work / "results"

    summary = json.loads((r / "train/summary.json").read_text())
    arch = recipe["drafter"]["arch"]
    drafts = 4 if arch == "dspark" else 3  # block size 4: DSpark drafts at every position, DFlash after the anchor
    assert summary["arch"] == arch
    assert summary["loss"] == recipe["train"]["loss"]
    assert 1.0 <= summary["heldout_sim_tau"] <= 1 + drafts
    assert len(summary["heldout_accept_by_position"]) == drafts
    exported = json.loads((r / "drafter/config.json").read_text())
    assert exported["layer_types"] == summary_layer_types(recipe)
    assert exported["architectures"] == [ARCHITECTURES[arch]]
    metrics = pd.read_csv(r / "train/metrics.csv")
    assert metrics["heldout_sim_tau"].notna().any()

    ev = json.loads((r / "eval/math_heldout.summary.json").read_text())
    assert ev["lossless"]["checked"] and ev["lossless"]["passed"]
    assert len(ev["methods"]["dflash"]["acceptance_histogram"]) == drafts + 1
    table = pd.read_csv(r / "tables/eval.csv").set_index("method")
    assert table.loc["dflash", "simulated_tau"] == pytest.approx(summary["heldout_sim_tau"])
    assert table.loc["dflash", "tau_pooled"] >= 1
    assert "simulated (training held-out)" in set(pd.read_csv(r / "tables/per_position_acceptance.csv")["dataset"])


def summary_layer_types(recipe) -> list[str]:
    d = recipe["drafter"]
    return d.get("layer_types") or ["sliding_attention" if d.get("sliding_window") else "full_attention"] * d["num_layers"]
