"""The speed-up under load as a table and a plot: every eval set's measurement at each concurrency
(:mod:`dflashpipe.evaluate.concurrency`), and where DFlash stops paying."""

from __future__ import annotations

import json

import pandas as pd

from dflashpipe.evaluate.crossover import COLUMNS, crossover, crossover_line, table_rows
from dflashpipe.stages.plots import plt, save_png
from dflashpipe.stages.tables import write_csv


def write_concurrency_report(measured: dict[str, str], csv_out: str, png_out: str, log=print) -> pd.DataFrame:
    """``measured``: eval set -> its concurrency JSON. Writes the table (one row per set and concurrency, with
    each set's crossovers) and the plot (speed-up vs concurrency, total and per user); logs one line per set."""
    rows, skipped = [], {}
    for dataset, path in measured.items():
        with open(path) as f:
            m = json.load(f)
        if m.get("skipped"):
            skipped[dataset] = m["skipped"]
            log(f"{dataset}: concurrency not measured: {m['skipped']}")
            continue
        flat = table_rows(m)
        for r in flat:
            r["crossover_total"] = crossover(flat, "speedup_total")
            r["crossover_per_user"] = crossover(flat, "speedup_per_user")
        rows += flat
        log(crossover_line(dataset, flat))
    df = pd.DataFrame(rows, columns=[*COLUMNS, "crossover_total", "crossover_per_user"])
    write_csv(df, csv_out)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for dataset, part in df.groupby("dataset", sort=False):
        line = ax.plot(part["concurrency"], part["speedup_total"], marker="o", label=f"{dataset}: total")[0]
        ax.plot(part["concurrency"], part["speedup_per_user"], marker="s", ls=":", color=line.get_color(),
                label=f"{dataset}: per user")
    ax.axhline(1.0, color="grey", lw=0.8)
    if len(df):
        levels = sorted(df["concurrency"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not measured: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()),
                ha="center", va="center", wrap=True, fontsize=8, transform=ax.transAxes)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("speed-up DFlash / AR (greedy, same harness)")
    ax.set_title("DFlash under load: below 1, AR serves faster", fontsize=10)
    ax.grid(alpha=0.3)
    save_png(fig, png_out)
    return df
