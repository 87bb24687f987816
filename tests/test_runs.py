"""Named drafter runs (config `runs`): one workflow trains and evaluates several recipes or seeds on the same
data, through Snakemake. Shared stages run once; a run's stages take a {run} wildcard under results/runs/."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import re
import shutil
import sys

import pandas as pd
import pytest

from conftest import REPO, mini_config, planned_after_edit, planned_rules, sha256, snakemake, snakemake_env, write_config

RUNS = {"a": {}, "b": {"seed": 1}}
PER_RUN = {"train", "export", "evaluate", "tables", "plots"}
COMPARE = {"compare": 1}  # the runs side by side: any run's new figures rewrite it
#: what any config change plans besides: the record of the config (a local job) and the default target
RECORD = {"effective_config": 1, "all": 1}
#: an expansion setting changed: the two training sets' replies, the one tokenized set and the one warm chain
#: (2 slots, warmed on that set) made again once, for both runs
DATA_PLAN = {"expand_shard": 2, "merge_expanded": 2, "tokenize": 1, "warm_slot": 2}


def runs_config(runs: dict) -> dict:
    cfg = mini_config()
    cfg["evaluate"]["methods"] = ["dflash", "ar"]  # the peers are another test's
    cfg["runs"] = copy.deepcopy(runs)
    return cfg


#: the mini run's data stages (the same config keys as the runs'): two_runs starts from them
DATA = ("prompts", "target", "expanded", "tokenized", "logs/prompts", "logs/target", "logs/expand", "logs/tokenize")


@pytest.fixture(scope="module")
def two_runs(mini_run, tmp_path_factory):
    """ONE workflow of two runs (the same recipe, seeds 0 and 1) on the mini config, in a folder that holds
    the mini run's data stages and their Snakemake records (nothing of its training or evaluation): the
    run adds what the runs make. A dry run of the same config in an empty folder is the plan from nothing."""
    src, _ = mini_run
    work = tmp_path_factory.mktemp("runs")
    shutil.copytree(src / ".snakemake", work / ".snakemake", symlinks=True)
    for d in DATA:
        shutil.copytree(src / "results" / d, work / "results" / d, symlinks=True)
    cfg = write_config(work / "config.yaml", runs_config(RUNS))
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work, cfg, res.stdout + res.stderr


@pytest.fixture
def runs_copy(two_runs, tmp_path):
    work, _, _ = two_runs
    dst = tmp_path / "runs"
    shutil.copytree(work, dst, symlinks=True)
    return dst, dst / "config.yaml"


def test_two_runs_share_the_data_and_train_a_drafter_each(two_runs, tmp_path):
    """One expansion and one tokenization for both runs; each run has its own training, drafter, evaluation,
    tables and plots under results/runs/<run>; runs that compile the same code share one warm chain."""
    work, cfg, out = two_runs
    r = work / "results"
    empty = tmp_path / "empty"
    empty.mkdir()
    plan = planned_rules(empty, "--configfile", str(cfg))  # from nothing
    assert plan["tokenize"] == 1 and plan["expand_shard"] == 2  # math and code, once
    assert plan["train"] == 2 and plan["warm_slot"] == 2  # one chain: slots 0 and 1
    jobs = re.findall(r"(?m)^(?:local)?rule (\w+):$", out)
    assert "tokenize" not in jobs and "expand_shard" not in jobs  # the data the folder held, for both runs
    assert jobs.count("train") == 2 and jobs.count("warm_slot") == 2
    for run in RUNS:
        assert (r / f"runs/{run}/drafter/model.safetensors").is_file()
        assert (r / f"runs/{run}/tables/eval.csv").is_file() and (r / f"runs/{run}/plots/tau_speedup.png").is_file()
        assert "train rank 0/2" in (r / f"runs/{run}/logs/train/rank0.log").read_text()
    assert sha256(r / "runs/a/drafter/model.safetensors") != sha256(r / "runs/b/drafter/model.safetensors")  # seeds
    assert "\nseed: 1\n" in (r / "runs/b/drafter/README.md").read_text()  # the card records the run's config
    assert len(list((r / "warm").iterdir())) == 1 and not (r / "train").exists() and not (r / "drafter").exists()
    # compared: per run, and per recipe over the runs that differ only in their seed
    per_run = pd.read_csv(r / "tables/runs.csv")
    assert list(per_run["run"]) == ["a", "b"] and set(per_run["dataset"]) == {"math_heldout"}
    assert list(per_run["seed"]) == [0, 1] and (per_run["train_steps"] == 6).all()
    recipes = pd.read_csv(r / "tables/recipes.csv")
    assert len(recipes) == 1 and recipes["recipe"][0] == "config" and recipes["runs"][0] == "a b"
    for f in ("tau_pooled", "speedup_vs_ar", "simulated_tau"):
        assert recipes[f"{f}_min"][0] <= recipes[f"{f}_mean"][0] <= recipes[f"{f}_max"][0]
        assert recipes[f"{f}_mean"][0] == pytest.approx(per_run[f].mean())
    assert (r / "plots/runs.png").stat().st_size > 10_000 and jobs.count("compare") == 1
    # per turn and category: math_heldout has neither, so the tables are their header and the plot says so
    from dflashpipe.stages.compare import GROUP_FIGURES, GROUP_KEYS, GROUP_RECIPE_COLUMNS

    assert (r / "runs/a/tables/eval_groups.csv").is_file()  # what compare read, the tables job's
    groups = pd.read_csv(r / "tables/runs_groups.csv")
    assert list(groups.columns) == ["run", "recipe", "seed", *GROUP_KEYS, *GROUP_FIGURES] and groups.empty
    recipe_groups = pd.read_csv(r / "tables/recipes_groups.csv")
    assert list(recipe_groups.columns) == ["recipe", *GROUP_KEYS, "runs", "n_runs", *GROUP_RECIPE_COLUMNS]
    assert recipe_groups.empty and (r / "plots/runs_groups.png").stat().st_size > 5_000


def test_editing_adding_and_removing_runs(runs_copy):
    """An edit of one run's overlay plans that run's stages only; a new run only its own (its compile
    signature's warm chain too when it compiles other code); a removed run plans nothing and deletes nothing.
    A data key is the workflow's: the data is made again once, for every run."""
    work, _ = runs_copy
    edited = copy.deepcopy(RUNS)
    edited["b"]["train"] = {"lr": 0.002}
    added = copy.deepcopy(RUNS) | {"c": {"drafter": {"num_layers": 2}}}
    longer = runs_config(RUNS)  # the data is the workflow's: other replies are made and tokenized once
    longer["expand"]["max_new_tokens"] += 8
    configs = {"edited": runs_config(edited), "added": runs_config(added), "removed": runs_config({"a": {}}),
               "longer": longer}
    kept = {f: sha256(f) for f in (work / "results/runs/b").rglob("*.safetensors")}
    paths = [write_config(work / f"{name}.yaml", c) for name, c in configs.items()]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # dry runs: two at a time, a core each
        plans = dict(zip(configs, pool.map(lambda path: planned_rules(work, "--configfile", str(path)), paths)))

    assert plans["edited"] == dict.fromkeys(PER_RUN, 1) | COMPARE | RECORD
    assert plans["added"] == dict.fromkeys(PER_RUN, 1) | {"warm_slot": 2} | COMPARE | RECORD  # a new signature: its own chain
    assert plans["removed"] == COMPARE | RECORD
    assert {f: sha256(f) for f in (work / "results/runs/b").rglob("*.safetensors")} == kept and kept
    # every run trains on the new data
    assert plans["longer"] == DATA_PLAN | {rule: 2 for rule in PER_RUN} | COMPARE | RECORD, plans["longer"]
    # the comparison's code changed: its tables and plots only, every run's stages as they were
    assert planned_after_edit(work, work / "config.yaml", "stages/compare.py") == {"compare", "all"}


def test_a_killed_run_resumes_and_the_other_runs_outputs_stay(runs_copy):
    """Run b's training killed mid-run (a rank dies at step 4) and run again: b resumes from its checkpoint;
    a's outputs are never touched."""
    work, cfg = runs_copy
    r = work / "results"
    a_files = {f: sha256(f) for f in (r / "runs/a").rglob("*") if f.is_file() and "/logs/" not in str(f)}
    shutil.rmtree(r / "runs/b/train/checkpoints")  # b's finished run forgotten: it trains again
    kill = {"DFLASH_FAULTS": json.dumps([{"at": "train.step", "step": 4, "rank": 1, "do": "kill"}])}
    res = snakemake(work, "results/runs/b/train/final.safetensors", "--cores", "2", "--forcerun", "train",
                    "--configfile", str(cfg), env=snakemake_env(**kill))
    assert res.returncode != 0
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resumed from step 2" in (r / "runs/b/logs/train/rank0.log").read_text()
    assert {f: sha256(f) for f in a_files} == a_files


def test_a_run_that_sets_the_gpus_or_a_bad_key_is_one_line(tmp_path):
    from dflashpipe.config import validate_config
    from dflashpipe.jobs.errors import UserError
    from dflashpipe.jobs.settings import SCHEMA_PATH

    for runs, line in [({"b": {"train": {"shards": 1}}}, "my.yaml: runs.b.train.shards: the GPUs are the workflow's, "
                        "not a run's: set train.shards at the top level"),
                       ({"b": {"drafter": {"block_szie": 8}}}, "my.yaml: runs.b.drafter.block_szie: unknown key (did "
                        "you mean 'block_size'?)"),
                       ({"b c": {}}, "my.yaml: runs.b c: a run name holds only letters, digits, '_', '.' and '-' (it "
                        "names the folder results/runs/<name>); rename it, e.g. 'b_c'")]:
        with pytest.raises(UserError) as err:
            validate_config(runs_config(runs), str(SCHEMA_PATH), "my.yaml")
        assert str(err.value) == line


def test_the_recipes_table_groups_the_runs_that_differ_only_in_their_seed(tmp_path):
    from dflashpipe.stages.compare import recipe_of, recipes_table

    assert recipe_of({"seed": 3}) == "config" and recipe_of({}) == "config"
    assert recipe_of({"seed": 1, "train": {"loss": "ce"}}) == recipe_of({"train": {"loss": "ce"}}) == '{"train": {"loss": "ce"}}'
    per_run = pd.DataFrame({"run": ["a", "b", "c"], "recipe": ["config", "config", "x"], "dataset": ["m"] * 3,
                            "tau_pooled": [2.0, 4.0, 3.0], "tau_mean": [1.0, 2.0, 3.0], "speedup_vs_ar": [1.5, 2.5, 2.0],
                            "simulated_tau": [2.0, 2.0, 2.0], "train_seconds": [1.0, 3.0, 2.0],
                            "train_gpu_seconds": [2.0, 6.0, 4.0]})
    table = recipes_table(per_run).set_index("recipe")
    assert table.loc["config", "n_runs"] == 2 and table.loc["config", "runs"] == "a b"
    assert (table.loc["config", "tau_pooled_mean"], table.loc["config", "tau_pooled_min"], table.loc["config", "tau_pooled_max"]) == (3.0, 2.0, 4.0)
    assert table.loc["x", "n_runs"] == 1 and table.loc["x", "speedup_vs_ar_min"] == table.loc["x", "speedup_vs_ar_max"] == 2.0


def _run_files(folder, sets: dict, tau: float, train: dict) -> dict:
    """A run's eval.csv, eval_groups.csv (by the tables job's own builder) and training summary, from
    ``sets``: eval set -> its summary's DFlash ``turns`` and ``categories`` (group -> (speed-up, ci low, ci high))."""
    from dflashpipe.stages.tables import eval_tables, group_table, write_csv

    folder.mkdir(parents=True)
    ar = {"n_prompts": 2, "n_samples": 4, "tau_pooled": 1.0, "speedup_vs_ar": 1.0, "speedup_vs_ar_ci_low": 1.0,
          "speedup_vs_ar_ci_high": 1.0}
    summaries = {}
    for name, groups in sets.items():
        s = {"methods": {"dflash": {"tau_pooled": tau, "tau_mean": tau, "speedup_vs_ar": 1.5}, "ar": ar}}
        for entry, by_group in groups.items():
            s[entry] = {g: {"ar": ar, "dflash": {"n_prompts": 2, "n_samples": 2, "tau_pooled": tau + sp, "speedup_vs_ar": sp,
                                                 "speedup_vs_ar_ci_low": low, "speedup_vs_ar_ci_high": high}}
                        for g, (sp, low, high) in by_group.items()}
        summaries[name] = folder / f"{name}.summary.json"
        summaries[name].write_text(json.dumps(s))
    (folder / "summary.json").write_text(json.dumps(train))
    write_csv(eval_tables({k: str(v) for k, v in summaries.items()})[0], folder / "eval.csv")
    write_csv(group_table({k: str(v) for k, v in summaries.items()}), folder / "eval_groups.csv")
    return {"eval": str(folder / "eval.csv"), "summary": str(folder / "summary.json"),
            "groups": str(folder / "eval_groups.csv")}


def test_the_runs_groups_tables_and_plot_compare_runs_per_turn_and_category(tmp_path, monkeypatch):
    """runs_groups.csv: each run's DFlash rows of its eval_groups.csv (never AR's), with its recipe and seed;
    recipes_groups.csv: per recipe and group, the mean, min and max over its seeds, and the span of the runs'
    own intervals; runs_groups.png: a row of panels per set with groups. Without groups: the header and a
    figure that says so."""
    from dflashpipe.stages import compare, plots

    drawn, save = [], plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, path: (drawn.append(fig), save(fig, path)))
    runs = {"a": {}, "b": {"seed": 1}, "c": {"train": {"loss": "ce"}, "seed": 4}}
    files = {}
    for k, run in enumerate(runs):  # run a: 1.1x on turn 1, b: 1.3x, c: 2.3x; turn 2 and the categories 0.1x more
        sp = 1.1 + 0.2 * k + (0.8 if run == "c" else 0)
        groups = {"turns": {"1": (sp, sp - 0.3, sp + 0.3), "2": (sp + 0.1, sp - 0.2, sp + 0.4)},
                  "categories": {"writing": (sp + 0.1, sp - 0.5, sp + 0.5), "math": (sp + 0.1, None, None)}}
        files[run] = _run_files(tmp_path / run, {"math_heldout": {}, "mt_bench": groups}, 2.0,
                                {"heldout_sim_tau": 2.5, "steps": 6, "total_seconds": 10.0, "world_size": 2})
    out = {name: str(tmp_path / f"{name}.{'png' if 'plot' in name else 'csv'}")
           for name in ("runs", "recipes", "plot", "runs_groups", "recipes_groups", "groups_plot")}
    pick = lambda what: {run: f[what] for run, f in files.items()}  # noqa: E731
    compare.write_compare(runs, 0, pick("eval"), pick("summary"), pick("groups"), out, log=lambda _: None)

    per_run = pd.read_csv(out["runs_groups"])
    assert list(zip(per_run["run"], per_run["group_kind"], per_run["group"])) == [
        (run, kind, group) for run in runs for kind, group in (("turn", "1"), ("turn", "2"), ("category", "writing"),
                                                              ("category", "math"))]
    assert set(per_run["dataset"]) == {"mt_bench"} and list(per_run["seed"].drop_duplicates()) == [0, 1, 4]
    a = per_run[per_run["run"] == "a"].set_index("group")
    assert a.loc["1", "speedup_vs_ar"] == pytest.approx(1.1) and a.loc["1", "tau_pooled"] == pytest.approx(3.1)
    assert (a.loc["1", "speedup_ci_low"], a.loc["1", "speedup_ci_high"]) == pytest.approx((0.8, 1.4))
    assert a.loc["writing", "n_samples"] == 2 and pd.isna(a.loc["math", "speedup_ci_low"])

    recipes = pd.read_csv(out["recipes_groups"]).set_index(["recipe", "group"])
    assert recipes.loc[("config", "1"), "runs"] == "a b" and recipes.loc[("config", "1"), "n_runs"] == 2
    config_turn1 = recipes.loc[("config", "1")]
    assert (config_turn1["speedup_vs_ar_mean"], config_turn1["speedup_vs_ar_min"], config_turn1["speedup_vs_ar_max"]) \
        == pytest.approx((1.2, 1.1, 1.3))
    # a's interval's low bound (0.8) to b's high one (1.6): the seeds' spread and each run's own
    assert (config_turn1["speedup_ci_low_min"], config_turn1["speedup_ci_high_max"]) == pytest.approx((0.8, 1.6))
    ce = recipes.loc[(compare.recipe_of(runs["c"]), "writing")]
    assert ce["n_runs"] == 1 and ce["speedup_vs_ar_min"] == ce["speedup_vs_ar_max"] == pytest.approx(2.4)

    fig = drawn[-1]  # runs_groups.png: one set with groups, a speed-up and a tau panel
    ax_sp, ax_tau = fig.axes  # the speed-up above the tau
    assert [t.get_text() for t in ax_sp.get_xticklabels()] == ["turn 1", "turn 2", "writing", "math"]
    assert "mt_bench" in ax_sp.get_title() and "mt_bench" in ax_tau.get_title()
    bars = {c.get_label(): [p.get_height() for p in c] for c in ax_sp.containers if not c.get_label().startswith("_")}
    assert bars["config (2 runs)"] == pytest.approx([1.2, 1.3, 1.3, 1.3])
    assert bars[f"{compare.recipe_of(runs['c'])} (1 run)"] == pytest.approx([2.3, 2.4, 2.4, 2.4])
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("95% intervals" in t for t in legend)

    # no set with turns or categories: the tables' header, and a figure that says so
    for run in runs:
        files[run] = _run_files(tmp_path / f"single_{run}", {"math_heldout": {}}, 2.0, {"steps": 6})
    compare.write_compare(runs, 0, pick("eval"), pick("summary"), pick("groups"), out, log=lambda _: None)
    assert pd.read_csv(out["runs_groups"]).empty and pd.read_csv(out["recipes_groups"]).empty
    assert "no eval set has several user turns" in drawn[-1].axes[0].get_title()


def test_the_data_curve_reads_the_runs_and_committed_reports_together(two_runs, tmp_path, capsys):
    """benchmarks/plot_data_curve.py: a results folder's runs against samples (steps x their summary's global
    batch), a committed report's NAME_metrics.csv copies against steps; folders and single files in one figure."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_data_curve

    work, _, _ = two_runs
    assert plot_data_curve.main(str(work / "results"), str(tmp_path / "a.png")) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["a (results)", "b (results)"], out
    assert all(" at 24 samples; within 2% of it from " in line for line in out), out  # 6 steps of 4 sequences
    report = REPO / "benchmarks" / "results" / "smollm2_h200_s23" / "train"
    s22 = REPO / "benchmarks" / "results" / "smollm2_h200_s22" / "train" / "dflash2_mix_s0_metrics.csv"
    assert plot_data_curve.main(str(report), str(s22), str(tmp_path / "b.png")) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dflash_ce_s0 (smollm2_h200_s23/train): simulated tau 3.99 at 3,000 steps; within 2% of it from 2,600 steps",
        "dflash_kl_s0 (smollm2_h200_s23/train): simulated tau 3.92 at 3,000 steps; within 2% of it from 2,600 steps",
        "dflash2_mix_s0 (smollm2_h200_s22/train): simulated tau 4.69 at 3,000 steps; within 2% of it from 2,600 steps"]
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
