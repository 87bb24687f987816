"""The speed-up under load through Snakemake: turned on in a finished mini run, it runs only its own jobs,
writes the table, the plot and the crossover, and DFlash's outputs at every concurrency equal batch-1 greedy
decoding token for token."""

import json

import pandas as pd
import yaml

from conftest import planned_rules, snakemake, write_config


def test_concurrency_measures_under_load_and_decodes_what_batch_one_decodes(mini_copy):
    work, cfg_path = mini_copy
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["evaluate"].update(concurrency=[1, 2], concurrency_waves=2)
    write_config(cfg_path, cfg)
    # a new key of the speed-up under load reruns no batch-1 evaluation, no table, no plot: only its own jobs
    assert planned_rules(work, "--configfile", str(cfg_path)) == {
        "concurrency": 1, "concurrency_report": 1, "effective_config": 1, "all": 1}
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = work / "results"

    measured = json.loads((r / "eval/math_heldout.concurrency.json").read_text())
    assert [row["concurrency"] for row in measured["rows"]] == [1, 2] and measured["device"] == "cpu"
    samples = pd.read_parquet(r / "eval/math_heldout.samples.parquet")
    batch1 = {row.id: list(row.output_ids) for row in samples[samples["method"] == "ar"].itertuples()}
    assert len(batch1) == 2
    for row in measured["rows"]:
        assert row["ar"]["requests"] == 2 * row["concurrency"] and row["lossless_rows"] == row["ar"]["requests"]
        assert row["dflash_outputs"] == batch1  # every distinct prompt, token for token
        assert row["dflash"]["tau"] >= 1.0 and row["speedup_total"] > 0

    table = pd.read_csv(r / "tables/concurrency.csv")
    assert list(table["concurrency"]) == [1, 2] and set(table["dataset"]) == {"math_heldout"}
    assert {"speedup_total", "speedup_per_user", "crossover_total", "crossover_per_user"} <= set(table.columns)
    expected = next((c for c, x in zip(table["concurrency"], table["speedup_total"]) if x <= 1.0), None)
    assert (table["crossover_total"].isna().all() if expected is None else (table["crossover_total"] == expected).all())
    assert (r / "plots/concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (r / "logs/plots/concurrency.log").read_text()
    assert "math_heldout: DFlash under load" in log

    # a draft vocabulary: both evaluations run again, DFlash drafting among its tokens (rule draft_vocab)
    cfg["evaluate"]["draft_vocab"] = 48
    write_config(cfg_path, cfg)
    assert planned_rules(work, "--configfile", str(cfg_path)) == {
        "draft_vocab": 1, "evaluate": 1, "concurrency": 1, "tables": 1, "plots": 1, "concurrency_report": 1,
        "effective_config": 1, "all": 1}
    cfg["evaluate"]["draft_vocab"] = 0

    # turned off again: nothing runs, and nothing measured is deleted
    cfg["evaluate"]["concurrency"] = []
    write_config(cfg_path, cfg)
    assert planned_rules(work, "--configfile", str(cfg_path)) == {"effective_config": 1, "all": 1}
