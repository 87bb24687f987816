"""The embedded default, end to end, with its goals (slow: ~25 min on 2 cores; not in CI).

Run with `bash scripts/test.sh -m slow`. It runs the README's main job in a temp
working directory and checks the figures the README reports.
"""

import json

import pandas as pd
import pytest

from conftest import REPO, snakemake


@pytest.mark.slow
def test_default_pipeline_meets_its_goals(tmp_path):
    res = snakemake(tmp_path, "--cores", "2", "--configfile", str(REPO / "config/config.yaml"), timeout=3 * 3600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = tmp_path / "results"
    target = json.loads((r / "target/metrics.json").read_text())
    assert target["heldout_loss"] <= 0.8 and target["format_ok"] >= 0.9
    train = json.loads((r / "train/summary.json").read_text())
    assert train["heldout_acc"] >= 0.6
    ev = pd.read_csv(r / "tables/eval.csv").set_index(["dataset", "method"])
    math = ev.loc["math_heldout"]
    assert math.loc["dflash", "tau_pooled"] >= 4
    peers = math.drop(index=["dflash", "ar"])
    assert (math.loc["dflash", "speedup_vs_ar"] > peers["speedup_vs_ar"]).all()
    summary = json.loads((r / "eval/math_heldout.summary.json").read_text())
    assert summary["lossless"]["passed"]
