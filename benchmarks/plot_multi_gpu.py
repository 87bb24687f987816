"""Figures of the 2-GPU runs: the step split at K=1 and K=2, and the pipeline's training at K=1 vs K=2.

    python benchmarks/plot_multi_gpu.py benchmarks/results

reads multi_gpu_h200x2/throughput_*.json and h200x2_shards/k{1,2}/, writes
multi_gpu_h200x2/step_split_k.png and h200x2_shards/training_k1_vs_k2.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

PHASES = [("target_forward", "target forward"), ("drafter_forward", "drafter forward (+ fused LM head/CE)"),
          ("backward_compute", "backward (compute)"), ("exposed_exchange", "gradient exchange not hidden by the backward"),
          ("optimizer", "optimiser (+ ZeRO parameter broadcast)")]


def step_split(results: Path) -> None:
    d = results / "multi_gpu_h200x2"
    runs = json.loads((d / "throughput_k1_k2_zero.json").read_text())["runs"]
    runs.append(json.loads((d / "throughput_k2_replicated_set_to_none.json").read_text()))
    labels = ["K=1\n(DDP + ZeRO-1)", "K=2\n(DDP + ZeRO-1)", "K=2, replicated AdamW\n(earlier run*)"]
    fig, ax = plt.subplots(figsize=(8.5, 5))
    bottom = [0.0] * len(runs)
    for key, name in PHASES:
        vals = []
        for r in runs:
            s = r["split_ms"]
            vals.append({"backward_compute": r["backward_without_exchange_ms"], "exposed_exchange": r["exposed_exchange_ms"]}.get(key, s.get(key, 0.0)))
        ax.bar(range(len(runs)), vals, bottom=bottom, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        peak = max(m["peak_gib"] for m in r["memory_per_rank"])
        ax.text(i, bottom[i] + 4, f"{r['context_tokens_per_s_per_gpu']:,.0f} tok/s per GPU\npeak {peak:.1f} GiB per GPU",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(runs)), labels)
    ax.set_ylabel("ms per step (phases synced)")
    ax.set_ylim(0, max(bottom) * 1.3)
    ax.set_title("Drafter training step on H200s, Qwen3-8B shapes, one sequence (S=3072) per GPU\n"
                 "* zero_grad(set_to_none=True) in that run", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(d / "step_split_k.png", dpi=120)


def training(results: Path) -> None:
    d = results / "h200x2_shards"
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for k, style in ((1, "-"), (2, "--")):
        m = pd.read_csv(d / f"k{k}" / "training.csv")
        tau = json.loads((d / f"k{k}" / "math_heldout.summary.json").read_text())["methods"]["dflash"]["tau_pooled"]
        label = f"{k} GPU{'s' if k > 1 else ''} (held-out math tau {tau:.2f})"
        smooth = m[["loss", "acc"]].rolling(15, min_periods=1).mean()
        line = ax_loss.plot(m["step"], smooth["loss"], style, label=label)[0]
        ax_acc.plot(m["step"], smooth["acc"], style, color=line.get_color(), label=label)
        held = m.dropna(subset=["heldout_loss"])
        ax_loss.plot(held["step"], held["heldout_loss"], "o", color=line.get_color(), ms=4)
        ax_acc.plot(held["step"], held["heldout_acc"], "o", color=line.get_color(), ms=4)
    ax_loss.set(xlabel="optimiser step", ylabel="decayed CE (15-step mean; dots: held-out)", title="Same recipe, 1 vs 2 GPUs")
    ax_acc.set(xlabel="optimiser step", ylabel="weighted top-1 accuracy", ylim=(0, 1), title="global batch 8 in both")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / "training_k1_vs_k2.png", dpi=120)


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    step_split(root)
    training(root)
