"""Time to a shard's first training step: cold compile cache vs. a cache filled by a warm job.

What the pipeline promises: a training shard that starts after its slot's
compile-warm job finds every graph in the slot's cache, compiles nothing from
scratch (cache misses = 0), and reaches its first step quickly. This script
measures it with the pipeline's own functions, each phase in a FRESH process:

1. ``cold``:  a shard with an empty cache dir (no warm job): compiles in step 1.
2. ``warm``:  the warm job (``warm_compile``) fills a new cache dir; writes the stamp.
3. ``hot``:   a shard on that cache, with the hot-start guard (stamp check, zero
              misses after priming every bucket, then fail_on_recompile).
4. ``seeded``: the NEXT slot's warm job: its cache is seeded from the ``warm``
              phase's (slot 0's) with the pipeline's ``seed_slot_cache``, as the warm
              chain does, so it should load every graph (hits) instead of compiling.
5. ``dense``: (GPU) the same shard with flex_attention NOT compiled: the guard must
              stop the dense path with an error instead of materialising scores.

The setup is synthetic but real: a randomly initialised Qwen3 target saved as an
HF directory with a ChatML tokenizer, a tokenized dataset with two length
buckets, and the pipeline's drafter (5 layers) and training step.

    python benchmarks/hot_start.py --out hot_start.json                 # GPU defaults
    python benchmarks/hot_start.py --device cpu --hidden 64 --layers 4 \
        --buckets 128,256 --anchors 16 --steps 2                          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))


def build_inputs(work: Path, a) -> None:
    """Random Qwen3 target + ChatML tokenizer + a tokenized dataset with two buckets."""
    import datasets
    import torch

    from dflashpipe.inputs.tiny_target import TinyTargetConfig, build_model, train_tokenizer

    words = [f"w{i}" for i in range(3000)]
    texts = [" ".join(words[j : j + 50]) for j in range(0, 3000, 50)]
    tok = train_tokenizer(texts, a.vocab)
    cfg = TinyTargetConfig(hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                           head_dim=a.hidden // a.heads, intermediate_size=a.hidden * 3)
    model = build_model(cfg, tok)
    model.save_pretrained(work / "target")
    tok.save_pretrained(work / "target")
    g = torch.Generator().manual_seed(0)
    rows = []
    buckets = [int(b) for b in a.buckets.split(",")]
    for i in range(a.samples):
        b = buckets[i % len(buckets)]
        n = b - int(torch.randint(0, b // 4, (1,), generator=g))
        ids = torch.randint(10, len(tok), (n,), generator=g).tolist()
        mask = [0] * (n // 4) + [1] * (n - n // 4)
        rows.append({"dataset": "synthetic", "id": str(i), "sample": 0, "input_ids": ids, "loss_mask": mask,
                     "length": n, "num_loss_tokens": sum(mask), "bucket": b})
    datasets.Dataset.from_list(rows).save_to_disk(str(work / "tokenized"))


def train_config(a, compile=None):
    from dflashpipe.training.train import TrainConfig

    return TrainConfig(num_layers=5, block_size=16, num_anchors=a.anchors, batch_size=a.batch_size,
                       max_steps=a.steps, heldout_samples=a.batch_size, checkpoint_every=10_000,
                       compile=compile or a.compile, dist_timeout_s=120)


def phase(name: str, work: Path, a) -> dict:
    """Run one phase in THIS (fresh) process."""
    from dflashpipe.jobs.compile_cache import seed_slot_cache
    from dflashpipe.jobs.hotstart import hot_start, write_stamp  # no torch import yet
    from dflashpipe.jobs.compile_cache import use_slot_cache

    t0 = time.time()
    slot = 1 if name == "seeded" else 0
    cache_root = work / f"cache_{'hot' if name in ('warm', 'hot', 'seeded') else name}"
    seeded = seed_slot_cache(cache_root, slot)  # the warm chain's step; nothing for slot 0
    cache = use_slot_cache(cache_root, slot)
    from dflashpipe.training.train import TrainRun, train_rank, warm_compile

    if name in ("warm", "seeded"):
        out = warm_compile(train_config(a), str(work / "tokenized"), str(work / "target"), a.device, 1, log=lambda m: None)
        stamp = write_stamp(str(work / f"stamp{slot}.json"), out["signature"], a.device, cache, out["bucket_seconds"], slot)
        return {"phase": name, "wall_s": time.time() - t0, "compile_seconds": stamp["compile_seconds"],
                "files_seeded": seeded, "counters": stamp["counters"]}
    guard = hot_start(str(work / "stamp0.json"), a.device) if name == "hot" else None
    try:
        run = TrainRun(train_config(a, compile="none" if name == "dense" else None), str(work / "tokenized"),
                       str(work / "target"), str(work / f"run_{name}"), str(work / f"metrics_{name}.csv"),
                       str(work / f"summary_{name}.json"), init_method=f"file://{work}/rdzv_{name}_{time.time_ns()}")
        s = train_rank(run, 0, a.device, log=lambda m: None, hot_start=guard)
        s = {**s, **s["ranks"][0]}  # one rank: its own figures
    except Exception as err:  # the dense phase is expected to end here
        return {"phase": name, "wall_s": time.time() - t0, "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    return {"phase": name, "wall_s": time.time() - t0, "time_to_first_step_s": s["time_to_first_step_s"],
            "first_step_seconds": s["first_step_seconds"], "steady_tokens_per_s": s["tokens_per_s"],
            "hot_start": s["hot_start"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--buckets", default="1024,2048")
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--phases", default="cold,warm,hot,seeded,dense")
    p.add_argument("--compile", default="layers", choices=["layers", "flex"], help="train.compile of the shards")
    p.add_argument("--out", default=None)
    p.add_argument("--work", default=None, help="working directory (default: a temp dir)")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="hot_start_"))
    if a.phase:
        print("RESULT " + json.dumps(phase(a.phase, work, a)), flush=True)
        return 0
    work.mkdir(parents=True, exist_ok=True)
    build_inputs(work, a)
    results = []
    for name in a.phases.split(","):
        if name == "dense" and a.device == "cpu":
            continue  # flex has no backward on CPU: the dense path cannot even start there
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--work", str(work), "--phase", name]
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"phase": name, "error": f"rc {res.returncode}: {res.stderr[-800:]}"}
        results.append(r)
        print(json.dumps(r), flush=True)
    by = {r["phase"]: r for r in results}
    cold, hot = by.get("cold", {}).get("time_to_first_step_s"), by.get("hot", {}).get("time_to_first_step_s")
    import torch

    summary = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
        "shapes": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "buckets", "anchors", "batch_size", "compile")},
        "phases": results,
        "hot_over_cold": (hot / cold) if cold and hot else None,
    }
    print(f"time to first step: cold {cold} s, hot {hot} s, hot/cold {summary['hot_over_cold']}")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
