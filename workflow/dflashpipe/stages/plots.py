"""Matplotlib figures of a run: evaluation, training curves, compile times.

Each function reads one table from results/tables/ (so figures and tables
always agree) and writes one PNG atomically.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from dflashpipe.jobs.atomic import atomic_path  # noqa: E402
from dflashpipe.stages.tables import SIMULATED  # noqa: E402

def _save(fig, path: str) -> None:
    if not fig.get_layout_engine():
        fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def training_curves(training_csv: str, loss_png: str, tokens_png: str) -> None:
    """Loss and top-1 accuracy of the global batch vs step (with held-out points), and context tokens/s."""
    df = pd.read_csv(training_csv)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(df["step"], df["loss"], label="train batch", alpha=0.8)
    ax_acc.plot(df["step"], df["acc"], label="train batch", alpha=0.8)
    held = df.dropna(subset=["heldout_loss"])
    if len(held):
        ax_loss.plot(held["step"], held["heldout_loss"], "ko--", label="held-out")
        ax_acc.plot(held["step"], held["heldout_acc"], "ko--", label="held-out")
    # log scale: the first steps' loss (tens of nats) would otherwise flatten the rest of the curve
    log_y = bool((df["loss"].dropna() > 0).all())
    ax_loss.set(xlabel="optimiser step", ylabel="position-weighted loss, nats" + (" (log scale)" if log_y else ""),
                title="Drafter loss (train.loss: CE, KL or DSpark's)", yscale="log" if log_y else "linear")
    ax_acc.set(xlabel="optimiser step", ylabel="weighted top-1 accuracy", title="Drafter accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, loss_png)

    fig, ax = plt.subplots(figsize=(7, 4))
    one_rank = "tokens_per_s_per_gpu" not in df or (df["tokens_per_s_per_gpu"] == df["tokens_per_s"]).all()
    curves = [("tokens_per_s", "")] if one_rank else [("tokens_per_s", "all shards, "), ("tokens_per_s_per_gpu", "per shard, ")]
    for col, label in curves:
        line = ax.plot(df["step"], df[col], alpha=0.25, lw=0.8)[0]
        smooth = df[col].rolling(25, min_periods=1, center=True).mean()
        ax.plot(df["step"], smooth, color=line.get_color(), lw=2, label=f"{label}25-step mean")
    ax.set(xlabel="optimiser step (light: per step; length buckets differ)", ylabel="context tokens / s",
           title="Training throughput")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, tokens_png)


def compile_times(compile_csv: str, out_png: str) -> None:
    """Per slot: seconds of the warm job (compiling, or loading what the previous slot compiled)
    vs. the shard's hot start from that cache; bars labelled with cache misses."""
    df = pd.read_csv(compile_csv)
    fig, ax = plt.subplots(figsize=(7, 4))
    phases = list(dict.fromkeys(df["phase"]))
    width = 0.8 / max(1, len(phases))
    for i, phase in enumerate(phases):
        g = df[df["phase"] == phase]
        bars = ax.bar(g["slot"] + i * width, g["seconds"], width, label=phase)
        ax.bar_label(bars, labels=[f"{m} miss" for m in g["cache_misses"]], fontsize=7)
    slots = sorted(set(df["slot"]))
    ax.set_xticks([s + width * (len(phases) - 1) / 2 for s in slots])
    ax.set_xticklabels([f"slot {s}" for s in slots])
    ax.set(ylabel="seconds (compile / prime every bucket)", title="Compile: warm jobs vs. hot shard start")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, out_png)


def tau_speedup(eval_csv: str, out_png: str, method_labels: dict[str, str]) -> None:
    """Bars per dataset and method: tokens per target forward (tau for DFlash) and decode speed-up over AR.

    ``method_labels``: method name -> legend label, in the order to draw them (the registry's,
    :mod:`dflashpipe.evaluate.methods`, which the workflow passes as the job's params).
    """
    df = pd.read_csv(eval_csv)
    methods = [m for m in method_labels if m in set(df["method"])]
    datasets = list(dict.fromkeys(df["dataset"]))
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        g = df[df["method"] == m].set_index("dataset").reindex(datasets)
        xs = [j + i * width for j in range(len(datasets))]
        b1 = ax_tau.bar(xs, g["tokens_per_target_forward"], width, label=method_labels[m])
        b2 = ax_sp.bar(xs, g["speedup_vs_ar"], width, label=method_labels[m])
        ax_tau.bar_label(b1, fmt="%.2f", fontsize=7)
        ax_sp.bar_label(b2, fmt="%.2f", fontsize=7)
        if m == "dflash" and "simulated_tau" in g and g["simulated_tau"].notna().any():
            ax_tau.plot(xs, g["simulated_tau"], "k_", markersize=18, mew=2.5,
                        label="DFlash, simulated in training (held-out blocks)")
            for x, sim in zip(xs, g["simulated_tau"]):  # its value beside the marker, clear of the bar's label
                if pd.notna(sim):
                    ax_tau.annotate(f"{sim:.2f}", (x, sim), xytext=(11, 0), textcoords="offset points",
                                    ha="left", va="center", fontsize=7)
    for ax in (ax_tau, ax_sp):
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))])
        ax.set_xticklabels(datasets)
        ax.grid(alpha=0.3, axis="y")
    ax_tau.set(ylabel="output tokens per target forward (DFlash: tau)", title="Acceptance length")
    ax_sp.axhline(1.0, color="k", lw=0.8)
    ax_sp.set(ylabel="decode speed-up over AR (x)", title="Speed-up (same harness, decode only)")
    handles, labels = ax_tau.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    _save(fig, out_png)


def per_position(positions_csv: str, out_png: str) -> None:
    """Per draft position k: P(position k accepted | positions before it accepted)."""
    df = pd.read_csv(positions_csv)
    fig, ax = plt.subplots(figsize=(7, 4))
    for d, g in df.groupby("dataset", sort=False):
        simulated = d == SIMULATED
        ax.plot(g["position"], g["acceptance_rate"], "k--" if simulated else "o-", label=d)
    ax.set(xlabel="draft position k in the block", ylabel="P(accept k | accepted < k)", ylim=(0, 1.02),
           title="Per-position acceptance (DFlash)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out_png)


def histogram(histogram_csv: str, out_png: str) -> None:
    """Share of verify steps that accepted 0..bs-1 drafted tokens."""
    df = pd.read_csv(histogram_csv)
    datasets = list(dict.fromkeys(df["dataset"]))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(datasets))
    for i, d in enumerate(datasets):
        g = df[df["dataset"] == d]
        ax.bar(g["accepted"] + i * width, g["fraction"], width, label=d)
    ax.set(xlabel="drafted tokens accepted in a verify step", ylabel="share of verify steps",
           title="Acceptance-length histogram (DFlash)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    _save(fig, out_png)
