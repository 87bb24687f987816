"""Evaluate, tables, plots and the HTML report through the real workflow (mini config)."""

import json

import pandas as pd

from conftest import planned_after_edit, snakemake

METHODS = {"dflash", "ar", "hf_generate", "prompt_lookup", "assisted"}


def test_evaluation_outputs(mini_run):
    work, _ = mini_run
    r = work / "results"
    summary = json.loads((r / "eval/math_heldout.summary.json").read_text())
    assert set(summary["methods"]) == METHODS
    assert summary["lossless"]["checked"] and summary["lossless"]["passed"]
    d = summary["methods"]["dflash"]
    assert d["tau_pooled"] >= 1 and len(d["per_position_acceptance"]) == 3  # block size 4
    samples = pd.read_parquet(r / "eval/math_heldout.samples.parquet")
    assert set(samples["method"]) == METHODS and len(samples) == 2 * len(METHODS)

    ev = pd.read_csv(r / "tables/eval.csv")
    assert set(ev["method"]) == METHODS and set(ev["dataset"]) == {"math_heldout"}
    assert (ev.loc[ev["method"] == "ar", "speedup_vs_ar"] - 1).abs().max() < 1e-9
    positions = pd.read_csv(r / "tables/per_position_acceptance.csv")
    assert positions["dataset"].value_counts().to_dict() == {"math_heldout": 3, "simulated (training held-out)": 3}
    assert ev.loc[ev["method"] == "dflash", "simulated_tau"].between(1, 4).all()  # beside the measured tau
    assert pd.read_csv(r / "tables/acceptance_histogram.csv")["steps"].sum() > 0
    train = pd.read_csv(r / "tables/training.csv")
    assert list(train["step"]) == [1, 2, 3, 4, 5, 6] and (train["tokens_per_s"] > train["tokens_per_s_per_gpu"]).all()
    comp = pd.read_csv(r / "tables/compile.csv")
    assert set(comp["slot"]) == {0, 1}
    for png in ["tau_speedup", "per_position_acceptance", "acceptance_histogram", "training_loss_acc",
                "training_tokens_per_s", "compile_cold_vs_hot"]:
        data = (r / f"plots/{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_plotting_code_edit_does_not_rerun_training(mini_run):
    work, cfg = mini_run

    def planned(module):
        return planned_after_edit(work, cfg, module)

    assert planned("stages/plots.py") == {"plots", "all"}
    assert planned("stages/tables.py") == {"tables", "plots", "all"}
    assert planned("decode/speculative.py") == {"evaluate", "tables", "plots", "all"}


def test_html_report(mini_copy):
    work, cfg = mini_copy
    res = snakemake(work, "--configfile", str(cfg), "--report", "report.html")
    assert res.returncode == 0, res.stderr[-2000:]
    html = (work / "report.html").read_text(errors="ignore")
    assert len(html) > 10000
    for caption_word in ["per second", "bonus token", "cache misses"]:
        assert caption_word in html, caption_word
