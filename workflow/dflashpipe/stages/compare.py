"""The named runs compared (config ``runs``): results/tables/runs.csv (per run and eval set: DFlash's tau, speed-up
over the same harness's AR, training's simulated tau and cost) and results/tables/recipes.csv (per recipe, the runs
that differ only in their seed: the mean and the min-max of each figure), with results/plots/runs.png; and the same
per user turn and per category of the sets that have them (each run's eval_groups.csv, DFlash's rows):
results/tables/runs_groups.csv, results/tables/recipes_groups.csv and results/plots/runs_groups.png."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dflashpipe.jobs.atomic import atomic_path
from dflashpipe.stages.tables import read_csv

#: what each run's row carries: from its eval.csv (DFlash's row) and its training summary
FIGURES = ["tau_pooled", "tau_mean", "speedup_vs_ar", "simulated_tau", "train_seconds", "train_gpu_seconds"]
#: what each run's group row carries besides its key (its eval_groups.csv, DFlash's row)
GROUP_FIGURES = ["n_prompts", "n_samples", "tau_pooled", "speedup_vs_ar", "speedup_ci_low", "speedup_ci_high"]
#: a recipe's group row: the mean, min and max over its runs of tau and the speed-up; how many samples a run's
#: group held (min-max); and from the lowest of the runs' 95% interval's low bounds to the highest high bound
GROUP_RECIPE_COLUMNS = ["n_samples_min", "n_samples_max", *(f"{f}_{s}" for f in ("tau_pooled", "speedup_vs_ar")
                                                            for s in ("mean", "min", "max")),
                        "speedup_ci_low_min", "speedup_ci_high_max"]
#: a group row's key within a run
GROUP_KEYS = ["dataset", "group_kind", "group"]


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


def runs_groups_table(runs: dict[str, dict], seed: int, groups_csvs: dict[str, str]) -> pd.DataFrame:
    """Per run, eval set and group (``group_kind`` turn: group 1, 2, ...; category: MT-Bench's 8, turns pooled):
    DFlash's figures as the run's tables job wrote them (:func:`~dflashpipe.stages.tables.group_table`), the
    speed-up over the same run's AR on the same samples with its 95% interval. No rows where no set has groups."""
    frames = []
    for run, overlay in runs.items():
        g = read_csv(groups_csvs[run]).astype({"group": str})
        g = g[g["method"] == "dflash"].rename(columns={"speedup_vs_ar_ci_low": "speedup_ci_low",
                                                        "speedup_vs_ar_ci_high": "speedup_ci_high"})
        frames.append(g.assign(run=run, recipe=recipe_of(overlay), seed=overlay.get("seed", seed)))
    columns = ["run", "recipe", "seed", *GROUP_KEYS, *GROUP_FIGURES]
    rows = [f[columns] for f in frames if len(f)]
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=columns)


def recipes_table(per_run: pd.DataFrame, keys: tuple[str, ...] = ("dataset",),
                  figures: list[str] = FIGURES) -> pd.DataFrame:
    """Per recipe and ``keys`` (the eval set; for the groups, the set, group kind and group): how many runs
    (seeds), and each of ``figures``' mean, min and max over them."""
    rows = []
    for (recipe, *key), g in per_run.groupby(["recipe", *keys], sort=False):
        row = {"recipe": recipe, **dict(zip(keys, key)), "runs": " ".join(g["run"]), "n_runs": len(g)}
        for f in figures:
            row |= {f"{f}_mean": g[f].mean(), f"{f}_min": g[f].min(), f"{f}_max": g[f].max()}
        rows.append(row)
    return pd.DataFrame(rows, columns=["recipe", *keys, "runs", "n_runs",
                                       *(f"{f}_{s}" for f in figures for s in ("mean", "min", "max"))])


def recipes_groups_table(per_run_groups: pd.DataFrame) -> pd.DataFrame:
    """Per recipe, eval set and group: :func:`recipes_table` over the runs' group rows, in
    ``GROUP_RECIPE_COLUMNS``."""
    table = recipes_table(per_run_groups, tuple(GROUP_KEYS), GROUP_FIGURES[1:])
    return table[["recipe", *GROUP_KEYS, "runs", "n_runs", *GROUP_RECIPE_COLUMNS]]


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


def group_label(kind: str, group: str) -> str:
    return f"turn {group}" if kind == "turn" else str(group)


def runs_groups_plot(recipes: pd.DataFrame, path: str) -> None:
    """Per eval set with turns or categories, two panels, one above the other: DFlash's speed-up over the run's
    AR and its pooled tau per group, a bar per recipe at the mean over its runs (seeds), black whiskers from min
    to max; on the speed-up, a grey band from the lowest to the highest bound of the runs' own 95% intervals (a
    group is a few prompts: its interval is wide). Text only where no run's eval set has groups."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    from dflashpipe.stages.plots import save_png, text_figure

    sets = list(dict.fromkeys(recipes["dataset"]))
    if not sets:
        text_figure(path, "Runs per turn and per category: no eval set has several user turns or categories",
                    "results/tables/runs_groups.csv has no rows: every run's eval sets are single-turn, without a "
                    "category field (each run's eval_groups.csv is empty).")
        return
    names = list(dict.fromkeys(recipes["recipe"]))
    n_groups = max(len(recipes[recipes["dataset"] == d][["group_kind", "group"]].drop_duplicates()) for d in sets)
    fig, axes = plt.subplots(2 * len(sets), 1, figsize=(max(9, 0.3 * n_groups * len(names) + 2),
                                                        3.2 * 2 * len(sets) + 0.2 * len(names) + 0.8), squeeze=False)
    axes = axes.reshape(len(sets), 2)  # per set: the speed-up above its tau
    width = 0.8 / len(names)
    for (ax_sp, ax_tau), d in zip(axes, sets):
        on = recipes[recipes["dataset"] == d]
        groups = list(dict.fromkeys(zip(on["group_kind"], on["group"])))
        for k, name in enumerate(names):
            g = on[on["recipe"] == name].set_index(["group_kind", "group"]).reindex(groups)
            x = np.arange(len(groups)) + (k - (len(names) - 1) / 2) * width
            n = int(g["n_runs"].max()) if g["n_runs"].notna().any() else 0
            for ax, figure in ((ax_sp, "speedup_vs_ar"), (ax_tau, "tau_pooled")):
                mean = g[f"{figure}_mean"].to_numpy(dtype=float)
                if ax is ax_sp:  # the runs' own intervals, under the seeds' min-max
                    low, high = g["speedup_ci_low_min"].to_numpy(dtype=float), g["speedup_ci_high_max"].to_numpy(dtype=float)
                    ax.bar(x, high - low, width * 0.5, bottom=low, color="grey", alpha=0.45, zorder=3)
                err = np.vstack([mean - g[f"{figure}_min"].to_numpy(dtype=float),
                                 g[f"{figure}_max"].to_numpy(dtype=float) - mean])
                ax.bar(x, mean, width, color=f"C{k}", yerr=err, capsize=2, error_kw={"elinewidth": 0.8, "zorder": 4},
                       label=f"{name} ({n} run{'s' if n != 1 else ''})")
        turns = sum(kind == "turn" for kind, _ in groups)
        for ax, label in ((ax_sp, "speedup_vs_ar (x)"), (ax_tau, "tau_pooled")):
            ax.set_xticks(np.arange(len(groups)), [group_label(*kg) for kg in groups], rotation=20, fontsize=8)
            if 0 < turns < len(groups):  # turns left of the line, categories (every turn pooled) right of it
                ax.axvline(turns - 0.5, color="k", lw=0.6, ls=":")
            ax.set_ylabel(label, fontsize=9)
            ax.grid(alpha=0.3, axis="y")
        ax_sp.axhline(1.0, color="k", lw=0.8)  # AR's own speed
        kinds = "per turn, then per category (every turn pooled)" if 0 < turns < len(groups) else (
            "per turn" if turns else "per category")
        ax_sp.set_title(f"{d}: DFlash's speed-up over the run's AR, {kinds}", fontsize=9)
        ax_tau.set_title(f"{d}: DFlash's pooled tau, {kinds}", fontsize=9)
        ax_sp.set_ylim(bottom=0)
    fig.suptitle("Runs by recipe, per turn and category: bars the mean over a recipe's runs (seeds), black whiskers "
                 "min-max", fontsize=10)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles.append(Patch(color="grey", alpha=0.45))
    labels.append("grey: the runs' own 95% intervals (bootstrap over the group's samples), lowest to highest bound")
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=7, frameon=False)
    fig.set_layout_engine("tight", rect=(0, (0.17 * (len(names) + 1) + 0.1) / fig.get_figheight(), 1, 0.96))
    save_png(fig, path)


def write_compare(runs: dict[str, dict], seed: int, eval_csvs: dict[str, str], summaries: dict[str, str],
                  groups_csvs: dict[str, str], out: dict, log=print) -> None:
    per_run = runs_table(runs, seed, eval_csvs, summaries)
    recipes = recipes_table(per_run)
    per_run_groups = runs_groups_table(runs, seed, groups_csvs)
    recipes_groups = recipes_groups_table(per_run_groups)
    for name, df in (("runs", per_run), ("recipes", recipes), ("runs_groups", per_run_groups),
                     ("recipes_groups", recipes_groups)):
        with atomic_path(out[name]) as tmp:
            df.to_csv(tmp, index=False)
    runs_plot(recipes, out["plot"])
    runs_groups_plot(recipes_groups, out["groups_plot"])
    cols = ["recipe", "dataset", "n_runs", "tau_pooled_mean", "speedup_vs_ar_mean", "speedup_vs_ar_min", "speedup_vs_ar_max"]
    log("\n" + recipes[cols].to_string(index=False))
    if len(recipes_groups):
        log("\nPer turn and category:\n" + recipes_groups[["recipe", *GROUP_KEYS, "n_runs", *cols[3:]]].to_string(index=False))
