"""Does the evaluation's speed-up interval hold on a busy machine? (issue 71)

Runs the evaluation of a finished pipeline run (its target, drafter and one eval set's prompts) twice with
the same settings: once on the idle machine, once under a synthetic background load (``--load-procs``
processes spinning on the cores, bounded by the run's length). Both runs decode interleaved, prompt by
prompt in a rotated method order (:mod:`dflashpipe.evaluate.run`), and give each speed-up with its median
over prompts and its 95% bootstrap interval. Prints both and whether the loaded run's interval covers the
idle run's figure (the pooled speed-up: the statistic the interval is of; and, for reference, whether it
covers the idle run's median over prompts), and writes ``eval_under_load.json``.

    snakemake --cores 2                                        # the Quickstart: results/ with a drafter
    python benchmarks/eval_under_load.py --results results --dataset math_heldout --out /tmp/load

Judge on an otherwise idle machine: the idle half is the reference.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))


def _spin(until: float) -> None:
    x = 0
    while time.time() < until:
        x += 1


def evaluate_once(a, label: str, out_dir: Path) -> dict:
    import torch
    import yaml

    from dflashpipe.evaluate.run import evaluate_dataset
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings
    from dflashpipe.jobs.settings import settings

    torch.set_num_threads(a.threads)
    cfg = yaml.safe_load((Path(a.results) / "effective_config.yaml").read_text())
    ev = {**cfg["evaluate"], "methods": a.methods.split(","), "lossless": "report"}
    if a.prompts:
        ev["num_prompts"] = a.prompts
    s = settings(EvalSettings, ev, seed=cfg["seed"], chat_template_kwargs=cfg["expand"]["chat_template_kwargs"])
    target = a.target or (cfg["target"]["path"] or str(Path(a.results) / "target" / "model"))
    run = EvalRun(s, target_dir=target, drafter_dir=str(Path(a.results) / "drafter"),
                  prompts_parquet=str(Path(a.results) / "prompts" / f"{a.dataset}.parquet"),
                  samples_out=str(out_dir / f"{label}.samples.parquet"), summary_out=str(out_dir / f"{label}.summary.json"))
    t0 = time.time()
    summary = evaluate_dataset(run, log=lambda msg: print(f"[{label}] {msg}", flush=True))
    m = summary["methods"]["dflash"]
    return {"wall_s": time.time() - t0, "tau_pooled": m["tau_pooled"], "speedup_vs_ar": m["speedup_vs_ar"],
            "median_per_prompt": m["speedup_vs_ar_median_per_prompt"], "ci_low": m["speedup_vs_ar_ci_low"],
            "ci_high": m["speedup_vs_ar_ci_high"], "ar_tok_s": summary["methods"]["ar"]["tokens_per_s"],
            "load_average": m.get("load_average"), "other_busy_cores": m.get("other_busy_cores")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="a finished run's results folder")
    ap.add_argument("--target", default=None, help="the target directory (default: the run's)")
    ap.add_argument("--dataset", default="math_heldout")
    ap.add_argument("--methods", default="dflash,ar")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default: the run's evaluate.num_prompts)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load-procs", type=int, default=os.cpu_count() or 1, help="busy processes of the loaded run")
    ap.add_argument("--load-seconds", type=float, default=900, help="the busy loop's bound")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="eval_under_load_"))
    out.mkdir(parents=True, exist_ok=True)
    idle = evaluate_once(a, "idle", out)
    until = time.time() + a.load_seconds
    procs = [mp.Process(target=_spin, args=(until,), daemon=True) for _ in range(a.load_procs)]
    for p in procs:
        p.start()
    try:
        loaded = evaluate_once(a, "loaded", out)
    finally:
        for p in procs:
            p.terminate()
    covers = loaded["ci_low"] <= idle["speedup_vs_ar"] <= loaded["ci_high"]
    covers_median = loaded["ci_low"] <= idle["median_per_prompt"] <= loaded["ci_high"]
    report = {"dataset": a.dataset, "cpu_count": os.cpu_count(), "load_procs": a.load_procs, "idle": idle,
              "loaded": loaded, "loaded_interval_covers_idle_pooled": covers,
              "loaded_interval_covers_idle_median": covers_median}
    (out / "eval_under_load.json").write_text(json.dumps(report, indent=1))
    print(f"| run | tau pooled | AR tok/s | speed-up pooled | median per prompt | 95% interval |")
    print(f"| --- | ---: | ---: | ---: | ---: | --- |")
    for label, r in (("idle", idle), (f"{a.load_procs} busy processes", loaded)):
        print(f"| {label} | {r['tau_pooled']:.2f} | {r['ar_tok_s']:.0f} | {r['speedup_vs_ar']:.2f}x | "
              f"{r['median_per_prompt']:.2f}x | {r['ci_low']:.2f}-{r['ci_high']:.2f}x |")
    print(f"the loaded run's interval {'covers' if covers else 'does NOT cover'} the idle run's pooled speed-up "
          f"({'and' if covers_median else 'but not'} its median over prompts); wrote {out / 'eval_under_load.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
