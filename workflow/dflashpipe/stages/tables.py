"""CSV tables of a run (results/tables/): the numbers behind every plot.

Each table is built from the stages' own outputs (evaluation summaries,
the training metrics, warm stamps, the training summary) and written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dflashpipe.jobs.atomic import atomic_path
from dflashpipe.jobs.errors import damaged_output

EVAL_COLUMNS = [
    "n_prompts", "tau_mean", "tau_pooled", "tau_uncut_mean", "tau_uncut_pooled", "tokens_per_s",
    "speedup_vs_ar", "speedup_vs_ar_median_per_prompt", "speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high",
    "tokens_per_target_forward", "decode_tokens", "decode_s", "peak_memory_bytes", "matches_ar",
]  # fmt: skip


#: a column under its name in older evaluation summaries (they still make tables)
RENAMED = {"tau_uncut_mean": "tau_authors_mean", "tau_uncut_pooled": "tau_authors_pooled"}


def read_json(path: str) -> dict:
    """A stage's JSON output, or one line naming it when it is truncated or corrupt."""
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise damaged_output(path, err) from None


def read_csv(path: str) -> pd.DataFrame:
    """A table (results/tables/, the training metrics), or one line naming it when it is truncated or corrupt."""
    try:
        return pd.read_csv(path)
    except (UnicodeDecodeError, ValueError) as err:  # pandas' EmptyDataError and ParserError are ValueErrors
        raise damaged_output(path, err) from None


def write_csv(df: pd.DataFrame, path: str) -> None:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def eval_tables(eval_summaries: dict[str, str], train_summary: str | None = None, caveat: str | None = None):
    """(per dataset and method, per-position acceptance, acceptance-length histogram).

    With the training summary, the DFlash rows also carry ``simulated_tau``: the
    acceptance length the drafter's last held-out evaluation predicted (greedy, from the
    training forward; :mod:`dflashpipe.training.heldout`), to set beside the measured
    ``tau_pooled``; and the per-position table gets its predicted acceptance as the
    rows of dataset ``simulated (training held-out)``. ``caveat``: what the figures are not (the tiny
    target on data off its domain, :func:`dflashpipe.config.tiny_target_caveat`), in column ``caveat``.
    """
    train = read_json(train_summary) if train_summary else {}
    rows, positions, histogram = [], [], []
    for dataset, path in eval_summaries.items():
        s = read_json(path)
        lossless = s.get("lossless", {})
        for method, m in s["methods"].items():
            rows.append(
                {
                    "dataset": dataset,
                    "method": method,
                    **{c: m.get(c, m.get(RENAMED.get(c))) for c in EVAL_COLUMNS},
                    "simulated_tau": train.get("heldout_sim_tau") if method == "dflash" else None,
                    "lossless_passed": lossless.get("passed") if method == "dflash" else None,
                    "device": s.get("device_name"),
                    "dtype": s.get("dtype"),
                    "caveat": caveat,
                }
            )
            if method == "dflash":
                for k, rate in enumerate(m.get("per_position_acceptance", []), start=1):
                    positions.append({"dataset": dataset, "position": k, "acceptance_rate": rate})
                counts = m.get("acceptance_histogram", [])
                total = sum(counts) or 1
                for a, n in enumerate(counts):
                    histogram.append({"dataset": dataset, "accepted": a, "steps": n, "fraction": n / total})
    for k, rate in enumerate(train.get("heldout_accept_by_position") or [], start=1):
        positions.append({"dataset": SIMULATED, "position": k, "acceptance_rate": rate})
    return pd.DataFrame(rows), pd.DataFrame(positions), pd.DataFrame(histogram)


#: the figures of a group of an eval set's samples (:func:`group_table`), as the summary's ``turns`` and
#: ``categories`` hold them per method
GROUP_FIGURES = ["n_prompts", "n_samples", "tau_mean", "tau_pooled", "tokens_per_s", "speedup_vs_ar",
                 "speedup_vs_ar_median_per_prompt", "speedup_vs_ar_ci_low", "speedup_vs_ar_ci_high", "matches_ar"]
#: the kinds of group, as ``group_kind`` names them, and the summary entry each comes from
GROUP_KINDS = {"turn": "turns", "category": "categories"}


def group_table(eval_summaries: dict[str, str], caveat: str | None = None) -> pd.DataFrame:
    """Per dataset, method and group: the figures of a multi-turn set per user turn (``group_kind`` turn, group
    1, 2, ...) and of a set with categories per category (MT-Bench's 8, every turn pooled). A set with neither
    has no rows; the columns are always there."""
    rows = []
    for dataset, path in eval_summaries.items():
        s = read_json(path)
        for kind, entry in GROUP_KINDS.items():
            for group, methods in (s.get(entry) or {}).items():
                for method, figures in methods.items():
                    rows.append({"dataset": dataset, "method": method, "group_kind": kind, "group": group,
                                 **{c: figures.get(c) for c in GROUP_FIGURES}, "caveat": caveat})
    return pd.DataFrame(rows, columns=["dataset", "method", "group_kind", "group", *GROUP_FIGURES, "caveat"])


#: the per-position rows predicted by training's held-out evaluation
SIMULATED = "simulated (training held-out)"


def training_table(metrics_csv: str) -> pd.DataFrame:
    return read_csv(metrics_csv)


def compile_table(stamps: list[str], train_summary: str) -> pd.DataFrame:
    """Per slot: the warm job's compile seconds and the training rank's priming seconds (warm cache)."""
    rows = []
    for path in stamps:
        s = read_json(path)
        rows.append({"slot": s["slot"], "phase": "warm job", "seconds": s["compile_seconds"],
                     "cache_misses": s["counters"]["fxgraph_cache_miss"] + s["counters"]["autograd_cache_miss"]})
    for r in read_json(train_summary)["ranks"]:
        hot = r.get("hot_start") or {}
        if hot.get("prime_seconds") is not None:
            c = hot.get("counters") or {}
            rows.append({"slot": r["rank"], "phase": "training shard (warm cache)", "seconds": hot["prime_seconds"],
                         "cache_misses": c.get("fxgraph_cache_miss", 0) + c.get("autograd_cache_miss", 0)})
    return pd.DataFrame(rows, columns=["slot", "phase", "seconds", "cache_misses"])


def write_tables(eval_summaries, metrics_csv, train_summary, stamps, out: dict, log=print,
                 caveat: str | None = None) -> None:
    ev, pos, hist = eval_tables(eval_summaries, train_summary, caveat)
    write_csv(ev, out["eval"])
    groups = group_table(eval_summaries, caveat)
    write_csv(groups, out["groups"])
    write_csv(pos, out["positions"])
    write_csv(hist, out["histogram"])
    write_csv(training_table(metrics_csv), out["training"])
    write_csv(compile_table(stamps, train_summary), out["compile"])
    cols = ["dataset", "method", "tau_mean", "tau_pooled", "simulated_tau", "tokens_per_s", "speedup_vs_ar",
            "tokens_per_target_forward"]
    log("\n" + ev[cols].to_string(index=False))
    if len(groups):
        shown = groups[groups["method"] == "dflash"]
        log("\nDFlash per turn and category:\n" + shown[["dataset", "group_kind", "group", "n_samples", "tau_pooled",
                                                          "speedup_vs_ar", "speedup_vs_ar_ci_low",
                                                          "speedup_vs_ar_ci_high"]].to_string(index=False))
    if caveat:
        log(f"NOTE: {caveat}")
