"""Matplotlib figures of a run: evaluation, training curves, compile times.

Each function reads one table from results/tables/ (so figures and tables
always agree) and writes one PNG atomically; the loss plot also reads which loss
ran (the training summary), the compile plot whether anything compiled (the warm stamps).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from dflashpipe.jobs.atomic import atomic_path  # noqa: E402
from dflashpipe.stages.tables import SIMULATED, read_csv, read_json  # noqa: E402

#: train.loss -> what it trains on, for the loss plot's title
LOSSES = {"ce": "cross-entropy with the data's tokens", "kl": "KL to the target's distribution",
          "dspark": "DSpark's: 0.1 CE + 0.9 L1 to the target"}


def save_png(fig, path: str) -> None:
    """Write ``fig`` as a PNG atomically (laid out tight unless it has a layout of its own) and close it."""
    if not fig.get_layout_engine():
        fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def text_figure(path: str, title: str, text: str, height: float = 2.5) -> None:
    """A text-only figure where a plot has nothing to draw: its title and why, written as :func:`save_png` does."""
    fig, ax = plt.subplots(figsize=(7, height))
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=8, wrap=True, transform=ax.transAxes)
    save_png(fig, path)


def training_curves(training_csv: str, loss_png: str, tokens_png: str, train_summary: str) -> None:
    """Loss (titled with the train.loss that ran) and top-1 accuracy of the global batch vs step (with
    held-out points), and context tokens/s."""
    df = read_csv(training_csv)
    loss = read_json(train_summary).get("loss", "?")
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
                title=f"Drafter loss, train.loss: {loss}\n({LOSSES.get(loss, 'unknown loss')})",
                yscale="log" if log_y else "linear")
    ax_acc.set(xlabel="optimiser step", ylabel="weighted top-1 accuracy", title="Drafter accuracy", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_png(fig, loss_png)

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
    save_png(fig, tokens_png)


def compiled_nothing(stamps: list[str]) -> bool:
    """True when no warm job compiled or loaded a graph (no Inductor / AOTAutograd cache event)."""
    return not any(sum(read_json(p)["counters"].values()) for p in stamps)


def compile_times(compile_csv: str, out_png: str, stamps: list[str]) -> None:
    """Per slot: seconds of the warm job (compiling, or loading what the previous slot compiled)
    vs. the shard's hot start from that cache; bars labelled with cache misses. Where nothing
    compiled (``stamps``: the warm stamps), a figure that says so instead of bars."""
    if compiled_nothing(stamps):
        _nothing_compiled(stamps, out_png)
        return
    df = read_csv(compile_csv)
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
    save_png(fig, out_png)


def _nothing_compiled(stamps: list[str], out_png: str) -> None:
    """A text-only figure: the warm jobs compiled nothing, so there is no compile time to compare."""
    first = read_json(stamps[0]) if stamps else {}
    cfg = first.get("parts", {}).get("config", {})
    lines = [
        f"No warm job compiled or loaded a graph (0 Inductor / AOTAutograd cache hits and misses in {len(stamps)} "
        "warm stamps).",
        f"train.compile: {cfg.get('compile', '?')}, attention: {cfg.get('attention', '?')}, "
        f"on {first.get('device_name', '?')}: the training step ran eagerly.",
        "The seconds in results/tables/compile.csv time eager first steps, not compiles.",
    ]
    text_figure(out_png, "Nothing compiled: no cold vs. hot compile to compare", "\n".join(lines), height=4)


def tau_speedup(eval_csv: str, out_png: str, method_labels: dict[str, str]) -> None:
    """Bars per dataset and method: tau (eval.csv's ``tau_mean``, with ``tau_pooled`` marked) and decode
    speed-up over AR (``speedup_vs_ar``). DFlash's ``simulated_tau`` comes from the training mix's
    held-out blocks, not from any eval set: one reference line, labelled so.

    ``method_labels``: method name -> legend label, in the order to draw them (the registry's,
    :mod:`dflashpipe.evaluate.methods`, which the workflow passes as the job's params).
    """
    df = read_csv(eval_csv)
    methods = [m for m in method_labels if m in set(df["method"])]
    datasets = list(dict.fromkeys(df["dataset"]))
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        g = df[df["method"] == m].set_index("dataset").reindex(datasets)
        xs = [j + i * width for j in range(len(datasets))]
        b1 = ax_tau.bar(xs, g["tau_mean"], width, label=method_labels[m])
        b2 = ax_sp.bar(xs, g["speedup_vs_ar"], width, label=method_labels[m])
        if {"speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high"} <= set(g.columns):  # the 95% interval over prompts
            low, high = g["speedup_vs_ar_ci_low"], g["speedup_vs_ar_ci_high"]
            ax_sp.errorbar(xs, g["speedup_vs_ar"], yerr=[(g["speedup_vs_ar"] - low).clip(lower=0),
                                                         (high - g["speedup_vs_ar"]).clip(lower=0)],
                           fmt="none", ecolor="k", elinewidth=0.8, capsize=2)
            _label_above(ax_sp, xs, g["speedup_vs_ar"], high, [_fmt(v) for v in g["speedup_vs_ar"]])
        else:
            ax_sp.bar_label(b2, labels=[_fmt(v) for v in g["speedup_vs_ar"]], fontsize=7)
        ax_tau.bar_label(b1, labels=[_fmt(v) for v in g["tau_mean"]], fontsize=7)
        pooled = ax_tau.plot(xs, g["tau_pooled"], "k.", markersize=6)[0]
    marks = [(pooled, "tau_pooled: all prompts' forwards pooled")] if methods else []
    sims = df.loc[df["method"] == "dflash", "simulated_tau"].dropna().unique() if "simulated_tau" in df else []
    for sim in sims:  # one value: the training summary's
        line = ax_tau.axhline(sim, color="k", ls="--", lw=1)
        marks.append((line, f"simulated_tau {sim:.2f}: DFlash, simulated on the training mix's held-out blocks "
                            "(no eval set)"))
    for ax in (ax_tau, ax_sp):
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))])
        ax.set_xticklabels(datasets)
        ax.grid(alpha=0.3, axis="y")
    ax_tau.set(ylabel="tau_mean (tokens per target forward)", title="Acceptance length (bars: tau_mean)")
    ax_sp.axhline(1.0, color="k", lw=0.8)
    ax_sp.margins(y=0.1)  # room for the labels over the whiskers
    ax_sp.set(ylabel="speedup_vs_ar: decode speed-up over AR (x)",
              title="Speed-up (decode only; whiskers: 95% interval)")
    handles, labels = ax_tau.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.06 if marks else 0),
               ncol=max(1, len(methods)), fontsize=8, frameon=False)
    if marks:
        fig.legend(*zip(*marks), loc="lower center", ncol=len(marks), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14 if marks else 0.07, 1, 1))
    save_png(fig, out_png)


def groups(groups_csv: str, out_png: str) -> None:
    """DFlash's speed-up over AR per user turn and per category of each eval set that has them
    (``eval_groups.csv``), with the 95% interval and tau_pooled over each bar; a text-only figure where no set
    has several turns or categories."""
    df = read_csv(groups_csv)
    df = df[df["method"] == "dflash"]
    datasets = list(dict.fromkeys(df["dataset"]))
    if not datasets:
        text_figure(out_png, "Per turn and per category: no eval set has several user turns or categories",
                    "results/tables/eval_groups.csv has no rows: every eval set is single-turn, without a category field.")
        return
    fig, axes = plt.subplots(len(datasets), 1, figsize=(9, 3.4 * len(datasets)), squeeze=False)
    for ax, d in zip(axes[:, 0], datasets):
        g = df[df["dataset"] == d].reset_index(drop=True)
        names = [f"turn {v}" if k == "turn" else str(v) for k, v in zip(g["group_kind"], g["group"])]
        colors = ["tab:blue" if k == "turn" else "tab:orange" for k in g["group_kind"]]
        ax.bar(range(len(g)), g["speedup_vs_ar"], color=colors)
        low, high = g["speedup_vs_ar_ci_low"], g["speedup_vs_ar_ci_high"]
        ax.errorbar(range(len(g)), g["speedup_vs_ar"], yerr=[(g["speedup_vs_ar"] - low).clip(lower=0).fillna(0),
                                                             (high - g["speedup_vs_ar"]).clip(lower=0).fillna(0)],
                    fmt="none", ecolor="k", elinewidth=0.8, capsize=2)
        _label_above(ax, range(len(g)), g["speedup_vs_ar"], high,
                     [f"{_fmt(sp)}x\ntau {_fmt(t)}" for sp, t in zip(g["speedup_vs_ar"], g["tau_pooled"])])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(g)), names, rotation=20, fontsize=8)
        ax.set(ylabel="speedup_vs_ar (x)", title=f"{d}: DFlash per turn (blue) and per category (orange, turns pooled)")
        ax.margins(y=0.25)
        ax.grid(alpha=0.3, axis="y")
    save_png(fig, out_png)


def _label_above(ax, xs, heights, tops, labels) -> None:
    """Each bar's label over its whisker (``tops``: the interval's upper ends; the bar's height where none), so
    that no label sits on a whisker."""
    for x, h, top, label in zip(xs, heights, tops, labels):
        if pd.isna(h):
            continue
        ax.annotate(label, (x, h if pd.isna(top) else max(h, top)), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7)


def _fmt(v) -> str:
    return "" if pd.isna(v) else f"{v:.2f}"


def per_position(positions_csv: str, out_png: str) -> None:
    """Per draft position k: P(position k accepted | positions before it accepted)."""
    df = read_csv(positions_csv)
    fig, ax = plt.subplots(figsize=(7, 4))
    for d, g in df.groupby("dataset", sort=False):
        simulated = d == SIMULATED
        ax.plot(g["position"], g["acceptance_rate"], "k--" if simulated else "o-", label=d)
    ax.set(xlabel="draft position k in the block", ylabel="P(accept k | accepted < k)", ylim=(0, 1.02),
           title="Per-position acceptance (DFlash)")
    positions = sorted(set(df["position"])) if len(df) else []
    ax.set_xticks(positions)  # every position, whole numbers (a locator gives 0.95, 0.975, ... with one point)
    if positions:
        ax.set_xlim(positions[0] - 0.5, positions[-1] + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, out_png)


def histogram(histogram_csv: str, out_png: str) -> None:
    """Share of verify steps that accepted 0..bs-1 drafted tokens."""
    df = read_csv(histogram_csv)
    datasets = list(dict.fromkeys(df["dataset"]))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(datasets))
    for i, d in enumerate(datasets):
        g = df[df["dataset"] == d]
        ax.bar(g["accepted"] + i * width, g["fraction"], width, label=d)
    accepted = sorted(set(df["accepted"])) if len(df) else []
    ax.set_xticks([a + width * (len(datasets) - 1) / 2 for a in accepted], [str(a) for a in accepted])
    ax.set(xlabel="drafted tokens accepted in a verify step", ylabel="share of verify steps",
           title="Acceptance-length histogram (DFlash)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save_png(fig, out_png)
