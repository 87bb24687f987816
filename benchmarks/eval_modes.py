"""One drafter evaluated under each way the evaluation can run the target and the drafter: where acceptance
is lost, the mode that loses it shows (DFlash's output stays lossless either way; its tau does not).

    python benchmarks/eval_modes.py --results results [--dataset math_heldout] [--device cuda] [--prompts 12]

Each line: target_step (compiled / static / dynamic), attention (auto = flex when compiled / sdpa), dtype,
then DFlash's pooled tau, its speed-up over the same-harness AR, how many outputs equal AR's, the per-position
acceptance and the mode the summary records. Written for the batch-1 GPU evaluation's low tau on the tiny
target (benchmarks/results/h100_pipeline_bytecode/README.md): on the CPU every mode gives the same tau.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

# (target_step, attention, the drafter's attention where it differs from the target's: None = the same). The static
# drafter's flex runs flex's main kernel since 8c6e95e (its decoding kernel drafted wrong: results/h100_eval_modes/)
MODES = [("compiled", "auto", None), ("compiled", "auto", "sdpa"), ("compiled", "sdpa", "flex"), ("compiled", "sdpa", None),
         ("static", "flex", None), ("static", "sdpa", None), ("dynamic", "auto", None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="a finished run's results folder (its drafter, prompts)")
    ap.add_argument("--target", default="resources/tiny_target")
    ap.add_argument("--dataset", default="math_heldout")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated torch dtypes")
    ap.add_argument("--only", default=None, help="the modes whose name starts with this (e.g. compiled-auto-bfloat16)")
    a = ap.parse_args(argv)
    import torch

    import dflashpipe.decode.static_drafter as static_drafter
    from dflashpipe.evaluate.run import evaluate_dataset
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings

    flex_attention_for = static_drafter.flex_attention_for

    out_dir = Path(tempfile.mkdtemp(prefix="eval_modes_"))
    for dtype in [getattr(torch, d) for d in a.dtypes.split(",")]:
        for step, attention, drafter_attention in MODES:
            t0 = time.time()
            name = f"{step}-{attention}-{str(dtype).removeprefix('torch.')}"
            # the drafter's runner asks static_drafter.flex_attention_for: answer it alone
            static_drafter.flex_attention_for = (flex_attention_for if drafter_attention is None else
                                                 (lambda compiled, dtype, attention, a=drafter_attention: a == "flex"))
            if drafter_attention:
                name += f"-drafter_{drafter_attention}"
            if a.only and not name.startswith(a.only):
                continue
            s = EvalSettings(max_new_tokens=a.max_new_tokens, num_prompts=a.prompts, methods=["dflash", "ar"],
                             target_step=step, attention=attention, lossless="report")
            try:
                out = evaluate_dataset(EvalRun(s, a.target, str(Path(a.results) / "drafter"),
                                               str(Path(a.results) / "prompts" / f"{a.dataset}.parquet"),
                                               str(out_dir / f"{name}.parquet"), str(out_dir / f"{name}.json"),
                                               device=a.device, dtype=dtype), log=lambda msg: None)
            except Exception as err:  # a mode this device cannot run: say so and go on
                print(f"{name}: failed: {err!r}"[:300], flush=True)
                continue
            m = out["methods"]["dflash"]
            print(f"{name}: tau {m['tau_pooled']:.2f}, {m['speedup_vs_ar']:.2f}x AR, "
                  f"{out['lossless'].get('exact_matches')} of {out['n_prompts']} equal to AR, per position "
                  f"{[round(x, 2) for x in m['per_position_acceptance']]}, {out['target_step']} / "
                  f"{out['drafter_step']} ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
