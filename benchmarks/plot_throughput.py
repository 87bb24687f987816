"""Stacked step-time split of the throughput runs next to the SpecForge peer, with tokens/s and memory.

    python benchmarks/plot_throughput.py benchmarks/results/throughput_h200
writes step_split.png into that directory (reads throughput_flex.json, throughput_layers.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = [("target_forward", "target forward"), ("drafter_forward", "drafter forward (+ fused LM head/CE)"),
          ("backward", "backward"), ("optimizer", "optimiser")]
# SpecForge's DFlash trainer on the same H200, torch 2.11, same shapes (the GPU-scale issue)
PEER = {"label": "SpecForge", "split_ms": {"target_forward": 104, "drafter_forward": 64, "backward": 104, "optimizer": 30},
        "tok_s": 10178, "peak_gib": 46.9}


def main(folder: str) -> None:
    d = Path(folder)
    runs = [PEER]
    for mode, label in (("flex", "this pipeline\ncompile: flex"), ("layers", "this pipeline\ncompile: layers")):
        r = json.loads((d / f"throughput_{mode}.json").read_text())
        runs.append({"label": label, "split_ms": r["split_ms"], "tok_s": r["context_tokens_per_s"],
                     "peak_gib": r["memory"]["peak_gib"]})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    x = range(len(runs))
    bottom = [0.0] * len(runs)
    for key, name in PHASES:
        vals = [r["split_ms"][key] for r in runs]
        ax.bar(x, vals, bottom=bottom, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        ax.text(i, bottom[i] + 4, f"{r['tok_s']:,.0f} tok/s\npeak {r['peak_gib']:.1f} GiB", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), [r["label"] for r in runs])
    ax.set_ylabel("ms per step (phases synced)")
    ax.set_ylim(0, max(bottom) * 1.25)
    ax.set_title("Drafter training step, Qwen3-8B shapes, S=3072, 512 anchors, bs 16 (one H200)")
    ax.title.set_fontsize(10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(d / "step_split.png", dpi=120)


if __name__ == "__main__":
    main(sys.argv[1])
