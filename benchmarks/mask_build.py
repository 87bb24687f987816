"""The training BlockMask of one batch, built two ways at Qwen3-8B's training shapes (issue 69):
``masks.block_mask`` (tiles counted from the anchors) beside ``create_block_mask`` on the same mask function,
timed in one process, with a check that both give the same tiles.

    python benchmarks/mask_build.py                 # one CPU thread (OMP_NUM_THREADS=1 for the published figure)
    python benchmarks/mask_build.py --device cuda   # on a GPU
"""

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflashpipe.drafter.masks import block_mask, dflash_mask_mod, sample_anchors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=3072)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    S, N, bs, dev = a.seq_len, a.anchors, a.block_size, torch.device(a.device)
    lm = torch.zeros(1, S, dtype=torch.bool)
    lm[0, S // 8 :] = True  # the prompt unsupervised, as train_throughput.py's rows
    anchors, keep = (t.to(dev) for t in sample_anchors(lm, N, bs, torch.Generator().manual_seed(0)))
    ways = {"from_anchors": lambda: block_mask(anchors, keep, S, bs, device=dev),
            "create_block_mask": lambda: create_block_mask(dflash_mask_mod(anchors, keep, S, bs), 1, None, N * bs,
                                                           S + N * bs, device=dev)}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out, masks = {"device": str(dev), "threads": torch.get_num_threads(), "seq_len": S, "anchors": N, "block_size": bs}, {}
    for name, build in ways.items():
        masks[name] = build()  # once before timing
        sync()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            build()
        sync()
        out[f"{name}_ms"] = round(1000 * (time.perf_counter() - t0) / a.reps, 2)
    out["same_tiles"] = all(torch.equal(getattr(masks["from_anchors"], k), getattr(masks["create_block_mask"], k))
                            for k in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
