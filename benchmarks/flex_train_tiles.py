"""flex_attention's kernel options for the drafter's TRAINING attention, forward and backward, one GPU (issue 69).

The default recipe's profile at Qwen3-8B shapes (benchmarks/results/h100_train_masks/) spends 14.6 ms a step in
flex's backward and 4.5 ms in its forward over the drafter's 5 layers: about 170 and 220 TFLOP/s of the useful
work, far under the card's matmul rate. This times one layer's attention alone (compiled, the step's mask:
512 anchors, blocks of 16, S = 3,072, 32 query and 8 key/value heads of 128) under flex's default options and
the ones in ``OPTIONS``, and compares each one's output and gradients with the default's.

    python benchmarks/flex_train_tiles.py --out OUT.json
    python benchmarks/flex_train_tiles.py --device cpu --quick     # smoke run: the mask and the shapes only
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from dflashpipe.drafter.masks import block_mask  # noqa: E402

#: name -> flex kernel_options ("fwd_"/"bwd_" prefixes: one direction only); "autotune": Inductor's own search
OPTIONS = {
    "default": {},
    "tma": {"USE_TMA": True},
    "fwd_128x128_w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd_64x128_w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                      "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd_32x128_w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                      "bwd_num_warps": 4, "bwd_num_stages": 3},
    "autotune": None,
}


def inputs(device, dtype, S=3072, N=512, bs=16, heads=32, kv_heads=8, head_dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randperm(S - bs - 1, generator=g)[:N] + 1).values[None]  # as training samples them
    keep = torch.ones_like(anchors, dtype=torch.bool)
    mask = block_mask(anchors.to(device), keep.to(device), S, bs, device=device)
    Q, KV = N * bs, S + N * bs
    q = torch.randn(1, heads, Q, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, KV, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, KV, head_dim, generator=g).to(device, dtype)
    go = torch.randn(1, heads, Q, head_dim, generator=g).to(device, dtype)
    visible = (mask.to_dense().sum().item() * mask.BLOCK_SIZE[0] * mask.BLOCK_SIZE[1])  # upper bound: live tiles
    return mask, q, k, v, go, visible


def run(name, opts, mask, q, k, v, go, reps, device):
    if opts is None:
        fn = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    else:
        fn = torch.compile(functools.partial(flex_attention, kernel_options=opts or None), dynamic=False)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves, block_mask=mask, enable_gqa=True)
        out.backward(go)
        return out

    t0 = time.perf_counter()
    out = step()
    first = time.perf_counter() - t0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device != "cuda":
        return {"name": name, "compile_s": first}, out.detach(), [t.grad for t in leaves]
    fwd_ms, both_ms = [], []
    for _ in range(reps):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        for t in leaves:
            t.grad = None
        e[0].record()
        o = fn(*leaves, block_mask=mask, enable_gqa=True)
        e[1].record()
        o.backward(go)
        e[2].record()
        sync()
        fwd_ms.append(e[0].elapsed_time(e[1]))
        both_ms.append(e[0].elapsed_time(e[2]))
    fwd, both = sorted(fwd_ms)[reps // 2], sorted(both_ms)[reps // 2]
    return {"name": name, "options": opts, "compile_s": round(first, 1), "fwd_ms": round(fwd, 3),
            "bwd_ms": round(both - fwd, 3)}, out.detach(), [t.grad for t in leaves]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the mask and shapes only (no flex call)")
    ap.add_argument("--only", default="", help="comma-separated names of OPTIONS (default: all)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=240, help="stop starting new options after this long")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    mask, q, k, v, go, visible = inputs(a.device, dtype)
    res = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "q": list(q.shape), "kv": list(k.shape), "live_tiles_keys_x_queries": visible, "runs": []}
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    if a.quick:
        return
    t_start, ref = time.perf_counter(), None
    names = [n for n in OPTIONS if not a.only or n in a.only.split(",")]
    for name in names:
        if time.perf_counter() - t_start > a.budget_s:
            print(json.dumps({"name": name, "skipped": "budget"}), flush=True)
            continue
        try:
            row, out, grads = run(name, OPTIONS[name], mask, q, k, v, go, a.reps, a.device)
        except Exception as e:  # noqa: BLE001 - an option a kernel refuses is a result too
            row, out = {"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}, None
        if out is not None:
            if ref is None:
                ref = (out, grads)
            else:
                row["max_abs_diff"] = {n: float((x.float() - y.float()).abs().max())
                                       for n, x, y in zip(("out", "dq", "dk", "dv"), [out, *grads], [ref[0], *ref[1]])}
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
