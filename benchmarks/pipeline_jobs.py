"""Per-job spans of one Snakemake run, from its log: when each job started and how long it ran.

Snakemake prints a timestamp before each job's block (``rule NAME:`` / ``localrule NAME:``, then
``jobid: N`` and ``wildcards: ...``) and before each ``Finished jobid: N``. This reads those lines
only, so it works on any run's log (the benchmark TSVs cover only the rules that declare one).

    python benchmarks/pipeline_jobs.py results/snakemake.log            # a Markdown table
    python benchmarks/pipeline_jobs.py LOG --csv jobs.csv               # and the rows as CSV
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from datetime import datetime

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
RULE = re.compile(r"^(?:local)?rule (\S+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")
FINISHED = re.compile(r"^Finished jobid: (\d+)")


def job_spans(lines) -> list[dict]:
    """One row per job that finished: rule, wildcards, start and end (seconds from the first job's start)."""
    stamp, rule, jobs = None, None, {}
    for line in lines:
        line = line.rstrip("\n")
        if m := STAMP.match(line):
            stamp = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y")
        elif m := RULE.match(line):
            rule = m.group(1)
        elif (m := JOBID.match(line)) and rule is not None:
            jobs[m.group(1)] = {"rule": rule, "wildcards": "", "start": stamp, "end": None}
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
             "seconds": (j["end"] - j["start"]).total_seconds()} for j in done]
    return sorted(rows, key=lambda r: (r["start_s"], r["rule"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a Snakemake run's console log")
    p.add_argument("--csv", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    with open(a.log) as f:
        rows = job_spans(f)
    if not rows:
        print(f"{a.log}: no finished job found", file=sys.stderr)
        return 1
    wall = max(r["start_s"] + r["seconds"] for r in rows)
    print(f"{len(rows)} jobs, {wall:.0f} s from the first job's start to the last one's end\n")
    print("| job | wildcards | starts at (s) | seconds |\n| --- | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['rule']} | {r['wildcards']} | {r['start_s']:.0f} | {r['seconds']:.0f} |")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
