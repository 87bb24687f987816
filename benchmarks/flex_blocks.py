"""flex_attention's tile sizes for the decoders' few-query steps, one GPU (issues 70 and 68).

A verify (8 or 16 queries over the target's static cache) and a draft (a block over the drafter's
context and its own slots) run flex's main kernel (``static_target.FLEX_MAIN_KERNEL`` says why),
whose tiles on an H100/H200 are 128 queries by 128 keys (bf16, head_dim 64) or by 64 (head_dim 128): at
8-16 queries most of each tile is padding. This
times the attention alone, compiled and captured in a CUDA graph (launches excluded), for the
evaluation's masks at SmolLM2's and Qwen3-8B's shapes, with the main kernel's default tiles, smaller
ones, and flex's decoding kernel (for reference only: it decoded wrong in some of these shapes), and
compares each output with the default's.

    python benchmarks/flex_blocks.py --out OUT.json
    python benchmarks/flex_blocks.py --device cpu --quick     # smoke run (uncompiled, no timing)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from dflashpipe.decode.layer import live_block_mask  # noqa: E402
from dflashpipe.decode.static_target import FLEX_MAIN_KERNEL, KV_BLOCK  # noqa: E402

#: (query heads, key/value heads, head dim, queries) of each step
SHAPES = {
    "verify_smollm2": (9, 3, 64, 8),
    "draft_smollm2": (9, 3, 64, 8),
    "verify_qwen3_8b": (32, 8, 128, 16),
    "draft_qwen3_8b": (32, 8, 128, 16),
}
#: the main kernel's tiles tried beside its default (BLOCK_M queries x BLOCK_N keys, num_warps)
TILES = ((16, 32, 4), (16, 64, 4), (16, 128, 4), (32, 64, 4), (64, 64, 4))


def masks(step: str, Q: int, capacity: int, valid: int, device):
    """(total keys, BlockMask) of a verify (queries at positions valid..valid+Q-1 of the cache, causal) or a
    draft (keys: the context [capacity] then the block's Q slots; positions < valid and the block seen)."""
    live = torch.ones((1, 1, 1), dtype=torch.int32, device=device)
    if step.startswith("verify"):
        pos = valid + torch.arange(Q, device=device)

        def up_to_own(b, h, q_idx, kv_idx):
            return kv_idx <= pos[q_idx]

        live.fill_(-(-(valid + Q) // KV_BLOCK))
        order = torch.arange(capacity // KV_BLOCK, dtype=torch.int32, device=device)
        return capacity, live_block_mask(live, order, up_to_own, Q, capacity, KV_BLOCK)
    C = capacity

    def seen(b, h, q_idx, kv_idx):
        return (kv_idx < valid) | (kv_idx >= C)

    blocks = C // KV_BLOCK
    order = torch.cat([torch.tensor([blocks]), torch.arange(blocks)]).to(device, torch.int32)
    live.fill_(1 + -(-valid // KV_BLOCK))
    return C + Q, live_block_mask(live, order, seen, Q, C + Q, KV_BLOCK)


def timed_graph(fn, reps: int) -> float:
    """Microseconds per call of fn, replayed from a CUDA graph ``reps`` times per graph launch."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


#: the first variant whose CUDA graph capture failed in this process (None: none has)
_CAPTURE_BROKEN: str | None = None


def run(step: str, device, capacity: int, valid: int, reps: int, compile: bool, tiles=TILES) -> dict:
    global _CAPTURE_BROKEN
    Hq, Hkv, D, Q = SHAPES[step]
    keys, mask = masks(step, Q, capacity, valid, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, Hq, Q, D, generator=g).to(device, dtype)
    k = torch.randn(1, Hkv, keys, D, generator=g).to(device, dtype)
    v = torch.randn(1, Hkv, keys, D, generator=g).to(device, dtype)
    variants = {"main_default": FLEX_MAIN_KERNEL}
    variants |= {f"main_m{m}_n{n}_w{w}": FLEX_MAIN_KERNEL | {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w}
                 for m, n, w in tiles}
    variants["decoding_kernel"] = None
    out = {"shape": {"query_heads": Hq, "kv_heads": Hkv, "head_dim": D, "queries": Q, "keys": keys, "live": valid}}
    ref = None
    for name, opts in variants.items():
        fn = functools.partial(flex_attention, block_mask=mask, enable_gqa=Hq != Hkv, kernel_options=opts)
        if compile:
            fn = torch.compile(fn, dynamic=False)
        try:
            o = fn(q, k, v)
        except Exception as err:  # a tile the kernel refuses: say so, go on
            out[name] = r = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            print(json.dumps({step: {name: r}}), flush=True)
            continue
        ref = o if ref is None else ref
        r = {"max_abs_diff_vs_default": float((o.float() - ref.float()).abs().max())}
        if device.type == "cuda" and _CAPTURE_BROKEN:
            r["us"] = None
            r["not_timed"] = f"a capture failed earlier in this process ({_CAPTURE_BROKEN}): time this tile alone"
        elif device.type == "cuda":
            try:
                r["us"] = round(timed_graph(lambda fn=fn: fn(q, k, v), reps), 2)
            except Exception as err:  # after a failed capture every later one in the process fails (an H100)
                r["error"] = f"capture: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                _CAPTURE_BROKEN = f"{step} {name}"
        out[name] = r
        print(json.dumps({step: {name: r}}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--capacity", type=int, default=384, help="the static cache's positions (a multiple of 128)")
    ap.add_argument("--valid", type=int, default=300, help="context positions before the step")
    ap.add_argument("--reps", type=int, default=200, help="calls per graph replay")
    ap.add_argument("--steps", default=",".join(SHAPES), help="which of " + ", ".join(SHAPES))
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES),
                    help="BLOCK_MxBLOCK_NxNUM_WARPS tiles besides the default")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: uncompiled, the first two variants")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    tiles = tuple(tuple(int(x) for x in t.split("x")) for t in a.tiles.split(","))[: 1 if a.quick else None]
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    for step in a.steps.split(","):
        res[step] = run(step, device, a.capacity, a.valid, a.reps, compile=device.type == "cuda", tiles=tiles)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
