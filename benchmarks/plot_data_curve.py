"""The data-and-steps curve: held-out simulated tau and accuracy against training samples seen.

Reads the training metrics of every run in each RESULTS folder of the workflow (``RESULTS/runs/<name>/train/``
with named runs, config ``runs``; ``RESULTS/train/`` without) or, from a committed report, every
``<name>_metrics.csv`` in it or the one named (no batch size there: against steps). Plots one line per run and
prints, per run, where its simulated tau comes within 2% of its last value (the samples it took to flatten).
Seeds of one recipe (runs named ``<recipe>_s<seed>``, as in config/recipes.yaml) share a colour.

    python benchmarks/plot_data_curve.py results [RESULTS...] curve.png
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

FLAT = 0.02  # within 2% of the last held-out figure


def curves(runs: Path) -> dict[str, pd.DataFrame]:
    out = {}
    # a results folder: its named runs (runs/<name>/train/, each "<name> (<folder>)"), or its one run (train/)
    folder = runs.resolve().name
    trained = []
    if runs.is_dir():
        named = sorted(runs.glob("runs/*/train/metrics.csv"))
        trained = [(m.parents[1].name, f"{m.parents[1].name} ({folder})", m) for m in named]
        trained += [(folder, folder, m) for m in runs.glob("train/metrics.csv")]
    for run, name, metrics in trained:
        df = pd.read_csv(metrics).dropna(subset=["heldout_sim_tau"])
        summary = json.loads((metrics.parent / "summary.json").read_text())
        df["samples"] = df["step"] * int(summary.get("global_batch") or 0)
        df.attrs["run"] = run
        out[name] = df
    # a committed report's copies: the folder's, or the one file named
    for metrics in [runs] if runs.is_file() else sorted(runs.glob("*_metrics.csv")):
        df = pd.read_csv(metrics).dropna(subset=["heldout_sim_tau"])
        df["samples"] = 0
        df.attrs["run"] = metrics.name.removesuffix("_metrics.csv")
        out[f"{metrics.name.removesuffix('_metrics.csv')} ({metrics.parent.parent.name}/{metrics.parent.name})"] = df
    return out


def flattened_at(df: pd.DataFrame, x: pd.Series) -> int:
    """x (samples or steps) when the held-out simulated tau first comes within FLAT of its last value, to stay."""
    last = df["heldout_sim_tau"].iloc[-1]
    close = (df["heldout_sim_tau"] >= (1 - FLAT) * last).tolist()
    first = next(i for i in range(len(close)) if all(close[i:]))
    return int(x.iloc[first])


def main(*args: str) -> int:
    *runs, png = args
    data = {name: df for r in runs for name, df in curves(Path(r)).items()}
    by_samples = all(df["samples"].max() > 0 for df in data.values())
    unit = "samples" if by_samples else "steps"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    recipes = {name: re.sub(r"_s\d+$", "", df.attrs["run"]) for name, df in data.items()}
    colours: dict[str, str] = {}
    for name, df in data.items():
        x = df["samples"] if by_samples else df["step"]
        recipe = recipes[name]
        seeds = list(recipes.values()).count(recipe)
        # a recipe's seeds: one colour, one legend entry
        label = name if seeds == 1 else "_" if recipe in colours else f"{recipe} ({seeds} runs)"
        colour = colours.setdefault(recipe, f"C{len(colours) % 10}")
        axes[0].plot(x, df["heldout_sim_tau"], marker=".", color=colour, label=label)
        axes[1].plot(x, df["heldout_acc"], marker=".", color=colour, label=label)
        print(f"{name}: simulated tau {df['heldout_sim_tau'].iloc[-1]:.2f} at {int(x.iloc[-1]):,} {unit}; "
              f"within {FLAT:.0%} of it from {flattened_at(df, x):,} {unit}")
    for ax, title in zip(axes, ["held-out simulated tau", "held-out accuracy (block positions)"]):
        ax.set_xlabel("training samples seen" if by_samples else "training steps")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
