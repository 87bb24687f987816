"""The speed-up under load as rows of a table, and where DFlash stops paying: pure functions on the
measurement :mod:`.concurrency` writes (no torch: the report job, in the light environment, reads them)."""

from __future__ import annotations

import math

#: the table's columns, per eval set and concurrency
COLUMNS = ["dataset", "concurrency", "requests", "ar_total_tok_s", "dflash_total_tok_s", "speedup_total",
           "ar_per_user_tok_s", "dflash_per_user_tok_s", "speedup_per_user", "tau", "lossless_rows"]


def crossover(rows: list[dict], key: str) -> int | None:
    """The first measured concurrency (ascending) whose ``key`` speed-up is at most 1: where DFlash stops
    paying. None when it pays at every measured concurrency."""
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        value = row.get(key)
        if value is not None and not math.isnan(value) and value <= 1.0:
            return int(row["concurrency"])
    return None


def crossover_line(dataset: str, rows: list[dict]) -> str:
    """One line for the console and the logs."""
    levels = sorted(r["concurrency"] for r in rows)
    parts = []
    for key, what in (("speedup_total", "total throughput"), ("speedup_per_user", "per user")):
        c = crossover(rows, key)
        parts.append(f"{what}: pays at every concurrency up to {levels[-1]}" if c is None
                     else f"{what}: no gain at any concurrency measured" if c == levels[0]
                     else f"{what}: stops paying at {c} requests")
    speedups = ", ".join(f"{r['concurrency']}: {r['speedup_total']:.2f}x" for r in sorted(rows, key=lambda r: r["concurrency"]))
    return f"{dataset}: DFlash under load ({speedups} total); {'; '.join(parts)}"


def table_rows(measured: dict) -> list[dict]:
    """A set's measurement as the table's rows (none when it was skipped)."""
    return [{"dataset": measured["dataset"], "concurrency": r["concurrency"], "requests": r["ar"]["requests"],
             "ar_total_tok_s": r["ar"]["total_tok_s"], "dflash_total_tok_s": r["dflash"]["total_tok_s"],
             "speedup_total": r["speedup_total"], "ar_per_user_tok_s": r["ar"]["per_user_tok_s"],
             "dflash_per_user_tok_s": r["dflash"]["per_user_tok_s"], "speedup_per_user": r["speedup_per_user"],
             "tau": r["dflash"]["tau"], "lossless_rows": r["lossless_rows"]} for r in measured.get("rows", [])]
