"""One drafter recipe trained and evaluated on the CPU at the first run's budget: tau and speed-up.

Trains with the pipeline's training (one rank, 2 threads) on the tokenized data of a default run
(``results/tokenized/train``, after ``snakemake --cores 2 results/tokenized/stats.json``), exports,
and evaluates DFlash against same-harness AR on ``math_heldout`` and ``code_heldout`` (20 prompts
each) with the pipeline's evaluation; prints one line. ``key.sub=value`` arguments override
config/config.yaml, e.g. the first run's choices in benchmarks/results/cpu_first_run/README.md:

    python benchmarks/cpu_trials.py b4bs8 train.batch_size=4 train.epochs=20 train.max_steps=600 drafter.block_size=8

``--steps-only``: train 8 steps and print the mean step time of steps 2-8 (no export, no evaluation):

    OMP_WAIT_POLICY=ACTIVE python benchmarks/cpu_trials.py --steps-only spin train.batch_size=8
"""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

import recipes as R  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    steps_only = "--steps-only" in sys.argv
    name, *sets = [a for a in sys.argv[1:] if a != "--steps-only"]
    fixed = ["train.eval_every=0", "train.checkpoint_every=1000", "evaluate.num_prompts=20"]
    cfg = R.merged_config([], fixed + sets + (["train.max_steps=8", "train.heldout_samples=8"] if steps_only else []))
    prompts = {n: Path(f"results/prompts/{n}.parquet") for n in ("math_heldout", "code_heldout")}
    run = Path(f"results/trials/{name}")
    shutil.rmtree(run, ignore_errors=True)
    target = cfg["target"]["path"]
    if steps_only:
        import pandas as pd
        from dflashpipe.config import settings
        from dflashpipe.drafter.train import TrainConfig, train_rank

        tc = settings(TrainConfig, cfg["drafter"], cfg["train"], seed=cfg["seed"], tensorboard=False)
        run.mkdir(parents=True)
        train_rank(tc, "results/tokenized/train", target, str(run / "ck"), 0, 1, f"file://{run.resolve()}/rdzv", "cpu",
                   str(run / "metrics.csv"), str(run / "summary.json"), log=lambda m: None)
        s = pd.read_csv(run / "metrics.csv")["step_seconds"][1:]
        print(f"{name}: step {s.mean():.3f} s (min {s.min():.3f}) over steps 2-{len(s) + 1}", flush=True)
        return
    tr = R.train_one(cfg, target, "results/tokenized/train", run, "cpu", lambda m: None)
    ev = R.evaluate_one(cfg, target, run / "drafter", prompts, run, "cpu", lambda m: None)
    out = [f"{name}: steps {tr['steps']} train {tr['wall_s']:.0f}s acc {tr['heldout_acc']:.3f} sim {tr['heldout_sim_tau']:.2f}"]
    for ds, e in ev.items():
        d, a = e["methods"]["dflash"], e["methods"]["ar"]
        out.append(f"{ds} tau {d['tau_pooled']:.2f} x{d['speedup_vs_ar']:.2f} ({d['tokens_per_s']:.0f} vs {a['tokens_per_s']:.0f} tok/s)")
    print(" | ".join(out), flush=True)


if __name__ == "__main__":
    main()
