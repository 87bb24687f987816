"""The named runs compared (config ``runs``): results/tables/runs.csv (per run and eval set: DFlash's tau, speed-up
over the same harness's AR, training's simulated tau and cost) and results/tables/recipes.csv (per recipe, the runs
that differ only in their seed: the mean and the min-max of each figure), with results/plots/runs.png."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dflashpipe.jobs.atomic import atomic_path

#: what each run's row carries: from its eval.csv (DFlash's row) and its training summary
FIGURES = ["tau_pooled", "tau_mean", "speedup_vs_ar", "simulated_tau", "train_seconds", "train_gpu_seconds"]


def recipe_of(overlay: dict) -> str:
    """A run's recipe: its overlay without the seed, as one line (``config``: the config's own recipe)."""
    rest = {k: v for k, v in sorted(overlay.items()) if k != "seed"}
    return json.dumps(rest, sort_keys=True, separators=(", ", ": ")) if rest else "config"


def runs_table(runs: dict[str, dict], seed: int, eval_csvs: dict[str, str], summaries: dict[str, str]) -> pd.DataFrame:
    rows = []
    for run, overlay in runs.items():
        ev = pd.read_csv(eval_csvs[run])
        train = json.loads(Path(summaries[run]).read_text())
        for _, r in ev[ev["method"] == "dflash"].iterrows():
            rows.append({"run": run, "recipe": recipe_of(overlay), "seed": overlay.get("seed", seed),
                         "dataset": r["dataset"], "tau_pooled": r["tau_pooled"], "tau_mean": r["tau_mean"],
                         "speedup_vs_ar": r["speedup_vs_ar"],
                         # the run's own 95% interval (bootstrap over its prompts): older tables lack it
                         "speedup_ci_low": r.get("speedup_vs_ar_ci_low"), "speedup_ci_high": r.get("speedup_vs_ar_ci_high"),
                         "simulated_tau": train.get("heldout_sim_tau"),
                         "train_steps": train.get("steps"), "train_seconds": train.get("total_seconds"),
                         "train_gpu_seconds": (train.get("total_seconds") or 0) * train.get("world_size", 1)})
    return pd.DataFrame(rows, columns=["run", "recipe", "seed", "dataset", *FIGURES[:3], "speedup_ci_low", "speedup_ci_high",
                                       FIGURES[3], "train_steps", *FIGURES[4:]])


def recipes_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per recipe and eval set: how many runs (seeds), and each figure's mean, min and max over them."""
    rows = []
    for (recipe, dataset), g in per_run.groupby(["recipe", "dataset"], sort=False):
        row = {"recipe": recipe, "dataset": dataset, "runs": " ".join(g["run"]), "n_runs": len(g)}
        for f in FIGURES:
            row |= {f"{f}_mean": g[f].mean(), f"{f}_min": g[f].min(), f"{f}_max": g[f].max()}
        rows.append(row)
    return pd.DataFrame(rows)


def runs_plot(recipes: pd.DataFrame, path: str) -> None:
    """Speed-up over AR and pooled tau per recipe and eval set: bars at the mean, whiskers from min to max."""
    import matplotlib.pyplot as plt
    import numpy as np

    from dflashpipe.stages.plots import save_png

    names, sets = list(dict.fromkeys(recipes["recipe"])), list(dict.fromkeys(recipes["dataset"]))
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.2 * len(sets) * len(names)), 4.8))
    width = 0.8 / max(1, len(names))
    for ax, figure, label in ((axes[0], "speedup_vs_ar", "speedup_vs_ar (DFlash over the same harness's AR)"),
                              (axes[1], "tau_pooled", "tau_pooled (DFlash)")):
        for k, name in enumerate(names):
            g = recipes[recipes["recipe"] == name].set_index("dataset").reindex(sets)
            x = np.arange(len(sets)) + (k - (len(names) - 1) / 2) * width
            mean = g[f"{figure}_mean"].to_numpy(dtype=float)
            err = np.vstack([mean - g[f"{figure}_min"].to_numpy(dtype=float), g[f"{figure}_max"].to_numpy(dtype=float) - mean])
            n = int(g["n_runs"].max())
            ax.bar(x, mean, width, yerr=err, capsize=3, label=f"{name} ({n} run{'s' if n > 1 else ''})")
        ax.set_xticks(np.arange(len(sets)), sets)
        ax.set_ylabel(label, fontsize=9)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")  # AR's own speed
    axes[0].set_ylim(0, max(1.1, float(np.nanmax(recipes["speedup_vs_ar_max"])) * 1.1))
    fig.suptitle("Runs by recipe: bars the mean over a recipe's runs (seeds), whiskers min-max", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=7, frameon=False)
    fig.set_layout_engine("tight", rect=(0, 0.06 * len(names) + 0.02, 1, 0.95))  # room for the legend below
    save_png(fig, path)


def write_compare(runs: dict[str, dict], seed: int, eval_csvs: dict[str, str], summaries: dict[str, str], out: dict,
                  log=print) -> None:
    per_run = runs_table(runs, seed, eval_csvs, summaries)
    recipes = recipes_table(per_run)
    for name, df in (("runs", per_run), ("recipes", recipes)):
        with atomic_path(out[name]) as tmp:
            df.to_csv(tmp, index=False)
    runs_plot(recipes, out["plot"])
    cols = ["recipe", "dataset", "n_runs", "tau_pooled_mean", "speedup_vs_ar_mean", "speedup_vs_ar_min", "speedup_vs_ar_max"]
    log("\n" + recipes[cols].to_string(index=False))
