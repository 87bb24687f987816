"""Per-job spans of one Snakemake run, from its log: when each job started and how long it ran.

Snakemake prints a timestamp before each job's block (``rule NAME:`` / ``localrule NAME:``, then
``jobid: N`` and ``wildcards: ...``) and before each ``Finished jobid: N``. This reads those lines
only, so it works on any run's log (the benchmark TSVs cover only the rules that declare one).

    python benchmarks/pipeline_jobs.py results/snakemake.log            # a Markdown table
    python benchmarks/pipeline_jobs.py LOG --csv jobs.csv               # and the rows as CSV
    python benchmarks/pipeline_jobs.py LOG --root DIR                   # and each job's cost split

With ``--root`` (the folder the run's relative paths start from: its working directory) each job's own
logs (the block's ``log:`` line) split its span into start-up, compiling and the rest. Every job's log
says how long its process ran before the job began (``... s after the process began``: Python, the
script's preamble, the imports) and how much of the job compiled (``done in ...s, compiling ...s of it``:
``torch.compile``'s own count, cache loads included); a job whose processes start more processes (the
training ranks) adds the slowest of theirs. ``work`` is the span less both: the job's own work, and
Snakemake's start of its process.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\S+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")
FINISHED = re.compile(r"^Finished jobid: (\d+)")
LOGS = re.compile(r"^\s+log: (.*)$")
# a job's own log (dflashpipe.jobs.runtime.job): its start and its end
BEGAN = re.compile(r": start \(pid \d+, .*, ([\d.]+) s after the process began\)$")
COMPILED = re.compile(r": done in [\d.]+s, compiling ([\d.]+)s of it$")


def job_spans(lines) -> list[dict]:
    """One row per job that finished: rule, wildcards, start and end (seconds from the first job's start)."""
    stamp, rule, jobs = None, None, {}
    for line in lines:
        line = line.rstrip("\n")
        if m := STAMP.match(line):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif m := RULE.match(line):
            rule, logs = m.group(1), []
        elif (m := LOGS.match(line)) and rule is not None:  # before the jobid line
            logs = [p.strip() for p in m.group(1).split(",")]
        elif (m := JOBID.match(line)) and rule is not None:
            jobs[m.group(1)] = {"rule": rule, "wildcards": "", "start": stamp, "end": None, "logs": logs}
            last = m.group(1)
        elif (m := WILDCARDS.match(line)) and rule is not None:
            jobs[last]["wildcards"] = m.group(1)
            rule = None
        elif m := FINISHED.match(line):
            if m.group(1) in jobs:
                jobs[m.group(1)]["end"] = stamp
            rule = None
    done = [j for j in jobs.values() if j["start"] and j["end"]]
    if not done:
        return []
    t0 = min(j["start"] for j in done)
    rows = [{"rule": j["rule"], "wildcards": j["wildcards"], "start_s": (j["start"] - t0).total_seconds(),
             "seconds": (j["end"] - j["start"]).total_seconds(), "logs": j["logs"]} for j in done]
    return sorted(rows, key=lambda r: (r["start_s"], r["rule"]))


def log_costs(path) -> tuple[float, float] | None:
    """(seconds before the job began in its process, seconds it compiled) from one job log; None if it has neither."""
    began = compiled = None
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in lines:
        if m := BEGAN.search(line):
            began = float(m.group(1))  # the last start: a log appended to by an earlier, failed attempt
        elif m := COMPILED.search(line):
            compiled = float(m.group(1))
    return None if began is None and compiled is None else (began or 0.0, compiled or 0.0)


def cost_split(row: dict, root) -> dict:
    """The row's start-up, compile and work seconds from its logs under ``root`` (nothing where none says)."""
    costs = [c for c in (log_costs(Path(root) / p) for p in row["logs"]) if c is not None]
    if not costs:
        return {}
    main, others = costs[0], costs[1:]  # the job's own log first, then its child processes' (ranks, nodes)
    start = main[0] + max((c[0] for c in others), default=0.0)
    compiled = max([main[1], *(c[1] for c in others)])
    return {"startup_s": start, "compile_s": compiled, "work_s": max(0.0, row["seconds"] - start - compiled)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a Snakemake run's console log")
    p.add_argument("--csv", default=None, help="also write the rows here")
    p.add_argument("--root", default=None, help="the run's working directory: split each job's span by its logs")
    a = p.parse_args(argv)
    with open(a.log) as f:
        rows = job_spans(f)
    if not rows:
        print(f"{a.log}: no finished job found", file=sys.stderr)
        return 1
    for r in rows:
        split = cost_split(r, a.root) if a.root else {}
        r.pop("logs")
        if a.root:
            r |= {"startup_s": None, "compile_s": None, "work_s": None} | split
    wall = max(r["start_s"] + r["seconds"] for r in rows)
    print(f"{len(rows)} jobs, {wall:.0f} s from the first job's start to the last one's end\n")
    split = ["startup_s", "compile_s", "work_s"] if a.root else []
    print("| job | wildcards | starts at (s) | seconds |" + "".join(f" {c.removesuffix('_s')} (s) |" for c in split))
    print("| --- | --- | ---: | ---: |" + " ---: |" * len(split))
    for r in rows:
        cells = "".join(" - |" if r[c] is None else f" {r[c]:.1f} |" for c in split)
        print(f"| {r['rule']} | {r['wildcards']} | {r['start_s']:.0f} | {r['seconds']:.0f} |{cells}")
    if split:
        known = [r for r in rows if r["startup_s"] is not None]
        print(f"\nsummed over the {len(known)} jobs with logs: " + ", ".join(
            f"{c.removesuffix('_s')} {sum(r[c] for r in known):.0f} s" for c in split))
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
