"""Drafter recipes of the CPU default, trained and evaluated at the first run's scale: tau and speed-up.

Trains with the pipeline's training (one rank) on the tokenized data of a default run
(``results/tokenized/train``, after ``snakemake --cores 2 results/tokenized/stats.json``), exports,
and evaluates DFlash against same-harness AR on ``math_heldout`` and ``code_heldout`` with the
pipeline's evaluation; prints one line per trial and, with ``--out FILE``, appends one JSON row
per trial. ``key.sub=value`` arguments override config/config.yaml, e.g.:

    python benchmarks/cpu_trials.py l1a32 drafter.num_layers=1 train.num_anchors=32 train.max_steps=900

``--device cuda``: the same trials on a GPU, to learn quickly what steps buy (the drafter's quality does
not depend on where it trained). There the trials train in fp32 with SDPA and nothing compiled (as on
the CPU) and evaluate with the captured steps; on the CPU with 20 prompts per set, on a GPU with the
config's. ``--trials FILE.json`` (name -> settings string) runs several trials in one process:

    python benchmarks/cpu_trials.py --device cuda --trials trials.json --out $OUT/trials.jsonl

``--steps-only``: train 8 steps and print the mean step time of steps 2-8 (no export, no evaluation):

    OMP_WAIT_POLICY=ACTIVE python benchmarks/cpu_trials.py --steps-only spin train.batch_size=8
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

import recipes as R  # noqa: E402
import torch  # noqa: E402

FIXED = ["train.eval_every=0", "train.checkpoint_every=1000"]
ON = {"cpu": ["evaluate.num_prompts=20"],
      "cuda": ["train.attention=sdpa", "train.compile=none", "train.dtype=fp32", "evaluate.target_step=static"]}


def steps_only(name: str, cfg: dict, run: Path) -> None:
    import pandas as pd
    from dflashpipe.training.train import TrainConfig, TrainRun, train_rank
    from dflashpipe.jobs.settings import settings

    tc = settings(TrainConfig, cfg["drafter"], cfg["train"], seed=cfg["seed"], tensorboard=False)
    run.mkdir(parents=True)
    train_rank(TrainRun(tc, "results/tokenized/train", cfg["target"]["path"], str(run), str(run / "metrics.csv"),
                        str(run / "summary.json"), init_method=f"file://{run.resolve()}/rdzv"), 0, "cpu", log=lambda m: None)
    s = pd.read_csv(run / "metrics.csv")["step_seconds"][1:]
    print(f"{name}: step {s.mean():.3f} s (min {s.min():.3f}) over steps 2-{len(s) + 1}", flush=True)


def trial(name: str, cfg: dict, run: Path, device: str) -> dict:
    target = cfg["target"]["path"]
    prompts = {n: Path(f"results/prompts/{n}.parquet") for n in ("math_heldout", "code_heldout")}
    tr = R.train_one(cfg, target, "results/tokenized/train", run, device, lambda m: None)
    ev = R.evaluate_one(cfg, target, run / "drafter", prompts, run, device, lambda m: None)
    row = {"name": name, "device": device, "steps": tr["steps"], "train_s": round(tr["wall_s"], 1),
           "heldout_acc": round(tr["heldout_acc"], 4), "sim_tau": round(tr["heldout_sim_tau"], 3)}
    for ds, e in ev.items():
        d, a = e["methods"]["dflash"], e["methods"]["ar"]
        row[ds] = {"tau": round(d["tau_pooled"], 2), "speedup": round(d["speedup_vs_ar"], 2),
                   "dflash_tok_s": round(d["tokens_per_s"]), "ar_tok_s": round(a["tokens_per_s"])}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps-only", action="store_true")
    ap.add_argument("--trials", help="JSON file: trial name -> settings (space-separated key=value)")
    ap.add_argument("--out", help="append one JSON row per trial to this file")
    ap.add_argument("name", nargs="?")
    ap.add_argument("settings", nargs="*")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    trials = json.loads(Path(args.trials).read_text()) if args.trials else {args.name: " ".join(args.settings)}
    for name, sets in trials.items():
        fixed = FIXED + ON[torch.device(args.device).type]
        if args.steps_only:
            fixed += ["train.max_steps=8", "train.heldout_samples=8"]
        cfg = R.merged_config([], fixed + sets.split())
        run = Path(f"results/trials/{name}")
        shutil.rmtree(run, ignore_errors=True)
        if args.steps_only:
            steps_only(name, cfg, run)
            continue
        row = trial(name, cfg, run, args.device)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**row, "settings": sets}) + "\n")


if __name__ == "__main__":
    main()
