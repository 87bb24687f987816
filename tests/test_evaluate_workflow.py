"""Evaluate, tables, plots and the HTML report through the real workflow (mini config)."""

import json
import re

import pandas as pd
import yaml

from conftest import PROMPTS, planned_after_edit, planned_rules, snakemake, write_config

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
    groups = pd.read_csv(r / "tables/eval_groups.csv")  # single-turn, no categories: the columns, no rows
    assert groups.empty and {"group_kind", "group", "speedup_vs_ar_ci_low", "tau_pooled"} <= set(groups.columns)
    assert (ev.loc[ev["method"] == "ar", "speedup_vs_ar"] - 1).abs().max() < 1e-9
    positions = pd.read_csv(r / "tables/per_position_acceptance.csv")
    assert positions["dataset"].value_counts().to_dict() == {"math_heldout": 3, "simulated (training held-out)": 3}
    assert ev.loc[ev["method"] == "dflash", "simulated_tau"].between(1, 4).all()  # beside the measured tau
    assert pd.read_csv(r / "tables/acceptance_histogram.csv")["steps"].sum() > 0
    train = pd.read_csv(r / "tables/training.csv")
    assert list(train["step"]) == [1, 2, 3, 4, 5, 6] and (train["tokens_per_s"] > train["tokens_per_s_per_gpu"]).all()
    comp = pd.read_csv(r / "tables/compile.csv")
    assert set(comp["slot"]) == {0, 1}
    for png in ["tau_speedup", "eval_groups", "per_position_acceptance", "acceptance_histogram", "training_loss_acc",
                "training_tokens_per_s", "compile_cold_vs_hot"]:
        data = (r / f"plots/{png}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_a_two_turn_set_with_categories_gets_its_rows_per_turn_and_category(mini_copy):
    """MT-Bench's shipped file (its first 12 questions: 10 writing, 2 roleplay; both turns) added as an eval set
    to the finished mini run: only its prompts and evaluation and the tables run (and the export: the card's
    caveat). The run's 2 prompts are one of each category, not the first two rows (both writing);
    eval_groups.csv has their turns and their categories."""
    work, cfg = mini_copy
    config = yaml.safe_load(cfg.read_text())
    config["datasets"]["mt_bench"] = {"path": str(PROMPTS / "mt_bench.jsonl.gz"), "messages_column": "messages",
                                      "use": "eval", "limit": 12}
    write_config(cfg, config)
    res = snakemake(work, "results/tables/eval_groups.csv", "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = set(re.findall(r"\b(?:local)?rule (\w+):", res.stdout + res.stderr))
    # and the export: the tiny target's caveat, which the model card holds, now names the off-domain set
    assert ran == {"prompts", "evaluate", "tables", "export"}, ran
    r = work / "results"
    samples = pd.read_parquet(r / "eval/mt_bench.samples.parquet")
    assert sorted(zip(samples.loc[samples["method"] == "ar", "id"], samples.loc[samples["method"] == "ar", "turn"])) == [
        ("mt_bench-81", 1), ("mt_bench-81", 2), ("mt_bench-91", 1), ("mt_bench-91", 2)]
    groups = pd.read_csv(r / "tables/eval_groups.csv")
    assert set(groups["dataset"]) == {"mt_bench"} and set(groups["method"]) == METHODS
    dfl = groups[groups["method"] == "dflash"].set_index(["group_kind", "group"])
    assert sorted(dfl.index) == [("category", "roleplay"), ("category", "writing"), ("turn", "1"), ("turn", "2")]
    assert list(dfl.loc[[("turn", "1"), ("turn", "2"), ("category", "writing"), ("category", "roleplay")],
                        "n_samples"]) == [2, 2, 2, 2]
    assert (dfl["tau_pooled"] >= 1).all() and (dfl["speedup_vs_ar"] > 0).all()
    assert set(pd.read_csv(r / "tables/eval.csv")["dataset"]) == {"math_heldout", "mt_bench"}


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


def test_a_draft_vocabulary_reruns_the_evaluations_only(mini_copy):
    """evaluate.draft_vocab set on the finished mini run (with the speed-up under load at one request): the
    vocabulary is counted from the tokenized data and only the evaluations and the table run again; DFlash stays
    lossless in both, and their outputs say what it drafted among. Set back to 0, the evaluation runs again."""
    work, cfg = mini_copy
    config = yaml.safe_load(cfg.read_text())
    before = config["evaluate"].get("concurrency")
    config["evaluate"].update(draft_vocab=48, concurrency=[1])
    write_config(cfg, config)
    res = snakemake(work, "results/tables/eval.csv", "results/eval/math_heldout.concurrency.json", "--cores", "2",
                    "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = set(re.findall(r"\b(?:local)?rule (\w+):", res.stdout + res.stderr))
    assert ran == {"draft_vocab", "evaluate", "concurrency", "tables"}, ran
    r = work / "results"
    vocab = json.loads((r / "tokenized/draft_vocab_48.json").read_text())
    assert vocab["size"] == len(vocab["ids"]) == 48 and 0.5 < vocab["coverage"] < 1
    recorded = {"requested": 48, "size": 48, "coverage": vocab["coverage"]}
    summary = json.loads((r / "eval/math_heldout.summary.json").read_text())
    assert summary["draft_vocab"] == recorded
    assert summary["lossless"]["checked"] and summary["lossless"]["passed"]
    measured = json.loads((r / "eval/math_heldout.concurrency.json").read_text())
    assert measured["draft_vocab"] == recorded
    assert all(row["lossless_rows"] == row["ar"]["requests"] for row in measured["rows"])
    config["evaluate"].update(draft_vocab=0, concurrency=before)
    write_config(cfg, config)
    assert planned_rules(work, "--configfile", str(cfg)) == {"evaluate": 1, "tables": 1, "plots": 1, "all": 1}
