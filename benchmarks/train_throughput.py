"""Drafter training throughput at Qwen3-8B shapes on K GPUs: tokens/s, step split, exchange, memory, MFU.

Builds a Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, head dim
128, vocab 151936; random bf16 weights: throughput does not depend on them) and
the paper's 5-layer DFlash drafter, then runs the PIPELINE'S OWN training step
(:func:`dflashpipe.training.step.train_step`: DDP, ZeRO-1 AdamW) on S=3072
context tokens per GPU with 512 anchors and block size 16, one sequence per GPU
per step (``--shapes``/``--batch``: SmolLM2-135M's shapes, B sequences). Numerics as in the pipeline: frozen bf16 target, fp32 master weights
and AdamW state, bf16 autocast.

``--ranks 1,2`` runs K=1, then K=2 (one process per GPU, NCCL, the pipeline's
file rendezvous) in one call; the compile cache is shared, so later runs load
the graphs the first one compiled. Per K (rank 0's view, memory of every rank):

* context tokens/s per GPU from steps run back to back (no extra syncs),
* the step split, from separate steps with a CUDA sync at each phase boundary
  (``mark`` hooks of ``train_step``): target forward (the layers up to the
  deepest tapped one; no LM head), drafter forward (+ chunked LM head, decayed
  CE and the LM head's input-gradient matmul, fused in its forward), backward
  (+ the tail of DDP's overlapped all-reduce), optimiser (clip + fused AdamW on
  this rank's share + ZeRO's parameter broadcast),
* ``exposed_exchange_ms``: the backward with gradient exchange minus the same
  backward under ``no_sync()`` (no exchange), i.e. the communication the
  backward does not hide,
* all-reduce bus bandwidth on a 1 GiB fp32 buffer (NCCL's busbw convention),
* peak memory per GPU, MFU (model matmul FLOPs / step time / the bf16 matmul
  peak measured on the same GPU, 8192^3).

``--optimizer replicated`` keeps the whole AdamW state on every rank (plain
fused AdamW) instead of ZeRO-1, to compare. ``--compile`` is the pipeline's
``train.compile``: ``layers`` (default), ``flex`` or ``none`` (uncompiled
flex_attention: the dense-flex guard must stop the step with an error).

    python benchmarks/train_throughput.py --ranks 1,2 --out $OUT/throughput.json
    python benchmarks/train_throughput.py --compile none        # the guard, same shapes
    python benchmarks/train_throughput.py --device cpu --tiny --ranks 1,2   # smoke run of the code path
    python benchmarks/train_throughput.py --set arch=dflash loss=ce         # another recipe's step
    python benchmarks/train_throughput.py --ddp                             # K=1 through DDP + ZeRO-1 (baseline)
    python benchmarks/train_throughput.py --shapes smollm2-135m --batch 16 --seq-len 512 --anchors 128 \
        --block-size 8 --profile $OUT/p.txt    # config/smollm2.yaml's step: a small target, many sequences

The peer at the same shapes, SpecForge's DFlash trainer: ``benchmarks/specforge_step.py``; the
figures of both: docs/training-throughput.md.
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

import torch  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0)
# SmolLM2-135M-Instruct's shapes (config/smollm2.yaml's target; a Llama: no q/k norm, tied embeddings)
SMOLLM2 = dict(llama=True, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100_000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=10_000.0)
PHASES = ("target_forward", "drafter_forward", "backward", "optimizer")
GIB = 2**30


def matmul_peak_tflops(device: str, n: int = 8192, reps: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def model_flops(tcfg, dcfg, S: int, queries: int, deepest: int, keys_per_query: float) -> dict:
    """Useful matmul FLOPs of one step: projections, MLPs, LM head, and attention over the
    keys each query may see (causal half for the target; context before the anchor plus
    its own block for the drafter, ``keys_per_query`` on average)."""
    H, I, hd = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    q, kv = tcfg.num_attention_heads * hd, tcfg.num_key_value_heads * hd
    layer_params = H * (q + 2 * kv) + q * H + 3 * H * I
    target = 2 * (deepest + 1) * (layer_params * S + 2 * S * S * q / 2)  # causal: half the scores
    n_ctx = len(dcfg.target_layer_ids)
    drafter_fwd = dcfg.num_hidden_layers * (2 * layer_params * queries + 2 * 2 * queries * keys_per_query * q)
    drafter_fwd += 2 * n_ctx * H * H * S + 2 * dcfg.num_hidden_layers * 2 * kv * H * S  # fc + context K/V
    lm_head = 2 * H * tcfg.vocab_size * queries
    # backward: 2x forward for the trained drafter; the frozen LM head needs input grads only (1x)
    return {"target_fwd": target, "drafter_fwd": drafter_fwd + lm_head, "backward": 2 * drafter_fwd + lm_head}


def build_target(shapes: dict, S: int, bs: int, device: str):
    """A randomly initialised Qwen3 of the given shapes (a Llama with tied embeddings where they say
    ``llama=True``), frozen, bf16 on CUDA (fp32 on CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shapes = dict(shapes)
    llama = shapes.pop("llama", False)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if llama else (Qwen3Config, Qwen3ForCausalLM)
    tcfg = config_cls(**shapes, max_position_embeddings=max(4096, S + bs), tie_word_embeddings=llama)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            target = model_cls(tcfg).eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(torch.float32)
    return target, tcfg


def worker(a, rank: int, world: int, rdzv: str) -> dict | None:
    """One rank of a K-rank run (its own process, its GPU as cuda:0). Rank 0 returns the figures."""
    import contextlib

    import torch.distributed as dist

    from dflashpipe.training.data import make_batch
    from dflashpipe.training.distributed import data_parallel, gather, init_dist, adamw
    from dflashpipe.drafter.features import prepare_target
    from dflashpipe.drafter.model import ARCH_KEYS, DFlashDrafter, DrafterConfig, apply_compile_mode
    from dflashpipe.training.step import resolve_setup, train_step
    from dflashpipe.training.train import TrainConfig, resolve_device

    cuda = a.device.startswith("cuda")
    shapes = TINY if a.tiny else {"qwen3-8b": QWEN3_8B, "smollm2-135m": SMOLLM2}[a.shapes]
    S = 256 if a.tiny else a.seq_len
    B = a.batch  # sequences per GPU per step
    N = 16 if a.tiny else a.anchors
    bs = a.block_size
    dev = resolve_device(a.device)
    init_dist(rdzv, rank, world, dev, 600)

    target, tcfg = build_target(shapes, S, bs, str(dev))
    mask_id = tcfg.vocab_size - 1
    cfg = TrainConfig(num_layers=a.layers, block_size=bs, num_anchors=N, batch_size=world * B, compile=a.compile,
                      **overrides(a.set))
    # the architecture keys (arch, layer_types, dflash2's) from the same settings, as training builds it
    dcfg = DrafterConfig.from_target_config(tcfg, a.layers, bs, mask_id, **{k: getattr(cfg, k) for k in ARCH_KEYS})
    setup = resolve_setup(cfg, str(dev), mask_id, dcfg.target_layer_ids, world)  # B sequences per GPU
    prepared = prepare_target(target, cfg, setup, dcfg.target_layer_ids)  # trimmed (and in FP8) as training runs it
    mem = {}
    if cuda:
        torch.cuda.empty_cache()
        mem["target_gib"] = torch.cuda.memory_allocated() / GIB
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).to(dev).train()  # fp32 master weights, as the pipeline
    apply_compile_mode(setup, drafter)  # on the flex path: dense flex_attention calls raise
    if a.ddp and world == 1:  # the one-rank path before it went plain: DDP's buckets and ZeRO-1 over one rank
        from dflashpipe.training.distributed import sharded_adamw

        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=None, gradient_as_bucket_view=True)
        opt = sharded_adamw(model, 6e-4, 0.0, dev)
    elif a.optimizer == "zero":  # the pipeline's: ZeRO-1 over K > 1 ranks, plain AdamW at K = 1
        model = data_parallel(drafter, world)
        opt = adamw(model, 6e-4, 0.0, dev, world)
    else:
        model = data_parallel(drafter, world)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, **({"fused": True} if cuda else {"foreach": True}))

    g = torch.Generator().manual_seed(rank)
    rows = {"input_ids": [torch.randint(0, tcfg.vocab_size - 2, (S,), generator=g).tolist() for _ in range(B)],
            "loss_mask": [[0] * (S // 8) + [1] * (S - S // 8)] * B}

    def batch(step: int):  # anchors re-sampled per step, as in training
        seeds = [(step * world + rank) * B + i for i in range(B)]
        return make_batch(rows, S, seeds, 0, cfg, dev)  # cfg: N anchors, blocks of bs

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed_split(batches, no_sync: bool) -> dict:
        split = {k: 0.0 for k in PHASES}
        for b in batches:
            sync()
            last = [time.perf_counter()]

            def mark(phase, last=last):
                sync()
                now = time.perf_counter()
                split[phase] += now - last[0]
                last[0] = now

            with model.no_sync() if no_sync else contextlib.nullcontext():
                train_step(model, target, opt, b, 6e-4, setup, mark=mark)
        return {k: 1000 * v / len(batches) for k, v in split.items()}

    result = {"ranks": world, "optimizer": a.optimizer, "ddp_at_one_rank": bool(a.ddp and world == 1),
              "activation_memory_budget": cfg.activation_memory_budget,
              "recipe": {"arch": cfg.arch, "loss": cfg.loss, **overrides(a.set)}, "shapes": shapes, "seq_len": S, "batch_per_gpu": B, "anchors": N, "block_size": bs,
              "drafter_layers": a.layers, "target_layers_run": max(dcfg.target_layer_ids) + 1,
              "target_layers_dropped": prepared["layers_dropped"], "target_fp8": prepared.get("fp8"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "compile": setup.compile if setup.attention == "flex" else "none (sdpa)"}
    try:
        t0 = time.perf_counter()
        first = train_step(model, target, opt, batch(0), 6e-4, setup)  # compile + first step (allocates AdamW state)
        sync()
        result["first_step_s"] = time.perf_counter() - t0
        second = train_step(model, target, opt, batch(1), 6e-4, setup)
        # the first two steps' losses: two trees (gpu_train_ab.sh) that compute the same step give the same figures
        result["first_losses"] = [first["loss"], second["loss"]]
        if cuda:
            sync()
            mem["after_step_gib"] = torch.cuda.memory_allocated() / GIB  # target + drafter + grads + AdamW share
            torch.cuda.reset_peak_memory_stats()
        batches = [batch(2 + i) for i in range(a.steps)]
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for b in batches:  # throughput: back to back, only the step's own host syncs
            train_step(model, target, opt, b, 6e-4, setup)
        sync()
        step_s = (time.perf_counter() - t0) / a.steps
        if cuda:
            mem["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            mem["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        split = timed_split(batches, no_sync=False)
        split_local = timed_split(batches, no_sync=True) if world > 1 else split
        bus = allreduce_busbw(dev, world, elements=(2**18 if a.tiny else 2**28))
        if a.memory and rank == 0 and cuda:
            write_memory_peak(a.memory, lambda: train_step(model, target, opt, batches[0], 6e-4, setup))
        if a.profile and rank == 0:
            write_profile(a.profile, lambda: [train_step(model, target, opt, b, 6e-4, setup) for b in batches[:3]], cuda)
        if a.syncs and rank == 0 and cuda:
            write_syncs(a.syncs, lambda: [train_step(model, target, opt, b, 6e-4, setup) for b in batches[:3]])
    except RuntimeError as err:
        result["error"] = str(err).strip().splitlines()[0]
        result["memory"] = mem
        return result if rank == 0 else None
    per_rank_mem = gather(mem)
    if rank != 0:
        return None
    kept = [b.anchors[b.keep].float() for b in batches]
    keys_per_query = float(torch.cat(kept).mean()) + bs  # context before the anchor + the block
    flops = {k: B * v for k, v in model_flops(tcfg, dcfg, S, N * bs, max(dcfg.target_layer_ids), keys_per_query).items()}
    from torch._dynamo.utils import counters

    result["compiled_graphs"] = counters["stats"].get("unique_graphs", 0)
    result.update(
        step_s=step_s,
        context_tokens_per_s_per_gpu=B * S / step_s,
        context_tokens_per_s=world * B * S / step_s,
        split_ms=split,
        split_sum_ms=sum(split.values()),
        backward_without_exchange_ms=split_local["backward"],
        exposed_exchange_ms=split["backward"] - split_local["backward"],
        allreduce=bus,
        memory=mem,
        memory_per_rank=per_rank_mem,
        drafter_keys_per_query=keys_per_query,
        model_tflop_per_step_per_gpu=sum(flops.values()) / 1e12,
        tflop_per_phase={k: v / 1e12 for k, v in flops.items()},
    )
    if cuda:
        peak = matmul_peak_tflops(str(dev))
        result.update(matmul_peak_tflops=peak, mfu=sum(flops.values()) / step_s / 1e12 / peak)
    return result


def overrides(pairs: list[str]) -> dict:
    """``["loss=ce", "selector_weight=0.5"]`` -> ``{"loss": "ce", "selector_weight": 0.5}`` (values as YAML)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE")
        out[key] = yaml.safe_load(value)
    return out


def allreduce_busbw(dev, world: int, elements: int, reps: int = 5) -> dict | None:
    """Time an all-reduce of ``elements`` fp32 values: algorithm and bus bandwidth (NCCL's conventions)."""
    import torch.distributed as dist

    if world == 1:
        return None
    x = torch.ones(elements, dtype=torch.float32, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(2):
        dist.all_reduce(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    sync()
    sec = (time.perf_counter() - t0) / reps
    size = x.numel() * 4
    return {"bytes": size, "seconds": sec, "algbw_gb_s": size / sec / 1e9, "busbw_gb_s": size / sec / 1e9 * 2 * (world - 1) / world}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--shapes", default="qwen3-8b", choices=["qwen3-8b", "smollm2-135m"], help="the target's shapes")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ranks", default="1", help="comma-separated K values, run one after another (e.g. 1,2)")
    p.add_argument("--optimizer", default="zero", choices=["zero", "replicated"], help="ZeRO-1 (the pipeline) or replicated AdamW")
    p.add_argument("--compile", default="layers", choices=["layers", "flex", "none"], help="the pipeline's train.compile")
    p.add_argument("--no-compile", action="store_true", help="same as --compile none")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="train/drafter settings of the step (e.g. arch=dflash loss=ce); default: the schema's")
    p.add_argument("--ddp", action="store_true", help="K = 1 through DDP + ZeRO-1 anyway (the path before it went plain)")
    p.add_argument("--cache", default=None, help="compile cache dir to share between calls (default: a fresh one)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="write a torch.profiler table of 3 steps (rank 0) to this file")
    p.add_argument("--syncs", default=None, help="write the host syncs of 3 steps, by calling line (rank 0, CUDA), to this file")
    p.add_argument("--memory", default=None, help="write what is allocated at one step's memory peak (rank 0, CUDA) to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: "rank,world,rendezvous"
    a = p.parse_args(argv)
    if a.no_compile:
        a.compile = "none"
    if a.worker:
        rank, world, rdzv = a.worker.split(",", 2)
        out = worker(a, int(rank), int(world), rdzv)
        if out is not None:
            print("RESULT " + json.dumps(out), flush=True)
        return 0

    # one shared compile cache: the first K compiles, the later ones load (as the pipeline's warm chain)
    cache = a.cache or tempfile.mkdtemp(prefix="throughput_cache_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor", TRITON_CACHE_DIR=f"{cache}/triton", PYTHONUNBUFFERED="1")
    own = [x for x in (argv if argv is not None else sys.argv[1:])]
    results = []
    for world in [int(k) for k in a.ranks.split(",")]:
        rdzv = f"file://{tempfile.mkdtemp(prefix='rdzv_')}/rdzv"
        procs = []
        for rank in range(world):
            e = dict(env, CUDA_VISIBLE_DEVICES=str(rank)) if a.device.startswith("cuda") else env
            cmd = [sys.executable, __file__, *own, "--worker", f"{rank},{world},{rdzv}"]
            procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate()[0] for p in procs]
        line = next((x for x in outs[0].splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"ranks": world, "error": f"rc {[p.returncode for p in procs]}: {outs[0][-1500:]}"}
        results.append(r)
        keys = ("ranks", "context_tokens_per_s_per_gpu", "step_s", "exposed_exchange_ms", "error")
        print(json.dumps({k: r.get(k) for k in keys} | {"peak_gib": [m.get("peak_gib") for m in r.get("memory_per_rank", [])]}), flush=True)
    base = next((r for r in results if r.get("ranks") == 1 and "error" not in r), None)
    for r in results:
        if base and "error" not in r:
            r["per_gpu_vs_one_gpu"] = r["context_tokens_per_s_per_gpu"] / base["context_tokens_per_s_per_gpu"]
    return finish(results[0] if len(results) == 1 else {"runs": results}, a.out)


def write_memory_peak(path: str, run, top: int = 25) -> None:
    """What is allocated at the peak of one step: the blocks alive then, by the line of this repo that made them.

    Records the allocator's history over ``run()`` (``torch.cuda.memory._record_memory_history``),
    replays it from the bytes allocated before the step to the moment of the most bytes allocated,
    and writes the largest groups of the step's blocks then alive (bytes, count, the innermost
    frames of this repo, else the innermost frames).
    """
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    run()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed")]

    def replay(stop: int):
        total, peak, peak_at, live = start, start, -1, {}
        for i, e in enumerate(events[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
            else:  # a block of the step, or one from before it (e.g. last step's gradients)
                live.pop(e["addr"], None)
                total -= e["size"]
            if total > peak:
                peak, peak_at = total, i
        return peak, peak_at, live

    peak, peak_at, _ = replay(len(events))
    _, _, live = replay(peak_at + 1)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        frames = e.get("frames") or []
        ours = [f for f in frames if "/dflashpipe/" in f["filename"] or "train_throughput" in f["filename"]]
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in (ours or frames)[:3]) or "?"
        g = groups.setdefault(where, [0, 0])
        g[0] += e["size"]
        g[1] += 1
    step_blocks = sum(e["size"] for e in live.values())
    lines = [f"allocated before the step: {start / GIB:.2f} GiB; peak: {peak / GIB:.2f} GiB, of which blocks the step "
             f"allocated and still held then: {step_blocks / GIB:.2f} GiB (event {peak_at} of {len(events)})", ""]
    for where, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / GIB:8.3f} GiB  {n:5d} blocks  {where}")
    Path(path).write_text("\n".join(lines) + "\n")


def write_profile(path: str, run, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        steps = len(run())
        if cuda:
            torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t0) / steps
    avgs = prof.key_averages()
    ops = sum(e.count for e in avgs if e.key.startswith("aten::")) / steps  # nested calls included
    head = f"per step (profiled, {steps} steps): wall {wall_ms:.1f} ms; aten calls {ops:.0f} (nested included)"
    if cuda:  # how much of the step the GPU spends in kernels, and how many it launches
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels)
        head += f"; GPU kernels {len(kernels) / steps:.0f}, busy {busy / 1000 / steps:.1f} ms"
        head += "\n" + idle_gaps(prof.events(), steps)
    key = "cuda_time_total" if cuda else "cpu_time_total"
    tables = [head, prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=90)]
    if cuda:  # the same ops by their own GPU time: the kernels that fill the step
        tables.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45,
                                                max_name_column_width=90))
    Path(path).write_text("\n\n".join(tables) + "\n")


def idle_gaps(events, steps: int, min_us: float = 20.0, top: int = 15) -> str:
    """Where the GPU waits inside the profiled steps: the gaps of at least ``min_us`` between its kernels (all
    streams merged), their sum per step, and the longest with the CPU op that was running when each ended
    (the one that launched the next kernel, or the sync the host was blocked in before it)."""
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    gaps, end = [], None
    for start, stop in gpu:
        if end is not None and start - end >= min_us:
            gaps.append((start - end, end, start))
        end = stop if end is None else max(end, stop)

    def cpu_op_at(t):  # the innermost op open at time t (the shortest that spans it), and the CUDA runtime call
        spans = sorted((e for e in cpu if e.time_range.start <= t <= e.time_range.end),
                       key=lambda e: e.time_range.end - e.time_range.start)
        op = next((e.name for e in spans if not e.name.startswith("cuda")), "-")
        call = next((e.name for e in spans if e.name.startswith("cuda")), "")
        return f"{op} {call}".strip()

    lines = [f"GPU idle inside the steps: {sum(g for g, _, _ in gaps) / 1000 / steps:.1f} ms a step in "
             f"{len(gaps) / steps:.0f} gaps of >= {min_us:.0f} us; the longest (us, the CPU op open as it ended):"]
    for g, _, stop in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {g:8.0f}  {cpu_op_at(stop - 1)}")
    return "\n".join(lines)


def write_syncs(path: str, run) -> None:
    """The operations that make the host wait for the GPU in ``run()``, as torch's sync debug mode reports them
    (not every sync: not collectives, not the allocator's), counted by the line of the repo's code that called it."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):  # other warnings are not syncs
            return
        frames = [f for f in traceback.extract_stack()[:-1]  # less this function's own frame
                  if "/workflow/" in f.filename or "/benchmarks/" in f.filename]
        where = next((f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(frames)), "?")
        found[where] = found.get(where, 0) + 1

    mode = torch.cuda.get_sync_debug_mode()
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            steps = len(run())
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    lines = [f"host syncs per step ({steps} steps) that torch's sync debug mode reports, by the calling line (those "
             "of the autograd engine's threads are replayed after the backward: its line)"]
    lines += [f"{n / steps:6.1f}  {k}" for k, n in sorted(found.items(), key=lambda kv: -kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


def finish(result: dict, out: str | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
