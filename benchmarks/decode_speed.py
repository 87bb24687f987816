"""Decoding speed at Qwen3-8B shapes on one GPU: the evaluation's batch-1 loops and batched regeneration.

A Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, vocab 151936; random
bf16 weights: speed does not depend on them) and the paper's 5-layer drafter; ``--shapes smollm2``:
SmolLM2-135M-Instruct's shapes instead (config/smollm2.yaml's target).

Batch 1 (the evaluation harness; 200-token prompt, ``--new`` new tokens):

* ``hf_generate``: HF ``generate`` (greedy, DynamicCache), ms per token;
* ``ar_dynamic`` / ``ar_static``: the harness's AR loop with the dynamic (eager,
  ``DynamicCache``) and the static target step (static KV cache, CUDA graphs:
  :mod:`dflashpipe.decode.static_target`), ms per token;
* ``verify_*``: one target forward of a 16-token block with context features;
  ``draft_*``: one drafter forward + LM head + argmax; ``dflash_block_*``: a whole DFlash step
  (draft + verify + accept + draft-cache update) from the DFlash loop with a
  random drafter (which accepts nothing, so every step is one block); the drafter's
  side runs eager with the dynamic target step and captured (CUDA graphs:
  :mod:`dflashpipe.decode.static_drafter`) with the static ones;
* the memory-bound limit: the target's weight bytes over the copy bandwidth
  measured on the same GPU.

Batched regeneration (``--prompts`` prompts of 160 tokens, reply lengths drawn
like chat replies: lognormal, median 300, capped at 1,024):

* ``static_generate``: today's embedded backend (static ``generate`` batches of
  ``--batch``, a batch runs to its longest member), useful tokens/s;
* ``batched``: the ``batched`` expansion backend (continuous batching over a
  static slotted KV cache, CUDA-graph decode step: :mod:`dflashpipe.decode.slots`),
  useful tokens/s, the steps taken by rows computed, and the decode step's time
  with every row busy (at the run's mean position and at the cache's end) with
  the bytes it reads and their fraction of the measured copy bandwidth, per
  ``--slots`` entry (rows[:attention[:compiled]]: flex, the GPU default, reads
  each row's live positions only; dense reads the whole capacity; compiled runs
  Inductor on the full step), each step size's time, on the same prompts and on more of them (``--batched-prompts``: a run of 256
  prompts lasts at least as many steps as its longest reply, 1,024, most of them
  with few rows busy; a corpus of many prompts keeps the rows full);
* ``continuous``: transformers' continuous batching (``init_continuous_batching``:
  paged KV cache, finished rows replaced by waiting prompts), useful tokens/s,
  in each configuration of ``--cb-configs``.

    python benchmarks/decode_speed.py --out $OUT/decode_speed.json
    python benchmarks/decode_speed.py --device cpu --tiny     # smoke run of the code path
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from train_throughput import QWEN3_8B, SMOLLM2, TINY, build_target  # noqa: E402

SHAPES = {"qwen3_8b": QWEN3_8B, "smollm2": SMOLLM2, "tiny": TINY}

GIB = 2**30


def set_inductor(spec: str) -> None:
    """``k=v,...``: integer-valued torch._inductor.config settings for every later compile (e.g. max_autotune=1)."""
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        setattr(torch._inductor.config, key, type(getattr(torch._inductor.config, key))(int(value)))


def sync(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev, gib: float = 4.0) -> float:
    """Achievable device memory bandwidth (bytes/s): read + write of a large copy."""
    a = torch.empty(int(gib * GIB), dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(dev)
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def timed(fn, dev, reps: int = 20, warm: int = 3) -> float:
    """Median seconds of fn()."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def reply_lengths(n: int, seed: int = 0, median: float = 300, sigma: float = 0.6, cap: int = 1024) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(min(cap, max(1, round(x)))) for x in rng.lognormal(np.log(median), sigma, n)]


def hf_static_generate(target, ids, new: int, dev) -> dict:
    """HF ``generate`` with ``cache_implementation="static"``: on a GPU transformers compiles its decode step
    (``CompileConfig``'s default: mode reduce-overhead, i.e. CUDA graphs). ms per decoded token = the time of
    ``new`` tokens less the time of 1 (the prefill and the first token), over ``new - 1``; both calls share one
    cache size (transformers keeps the largest it has built), so neither recompiles."""

    def gen(n):
        target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                        top_k=None, pad_token_id=0, cache_implementation="static")

    t0 = time.perf_counter()
    gen(new)  # builds the cache, compiles and captures
    first = time.perf_counter() - t0
    t_new, t_one = timed(lambda: gen(new), dev, reps=5, warm=2), timed(lambda: gen(1), dev, reps=5, warm=2)
    return {"hf_static_ms_per_token": 1e3 * (t_new - t_one) / (new - 1), "hf_static_first_call_s": first,
            "hf_static_compiled": hasattr(target, "_compiled_call")}


def random_drafter(a, target, tcfg, arch: str, dev):
    """(drafter, its config): a seeded random ``arch`` drafter of ``--layers`` layers and ``--block-size`` for the
    target's shapes (mask token: the last id), drafting among the first ``--draft-vocab`` ids if given (they stand
    for the most frequent: the time does not depend on which)."""
    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig

    keys = {"selector_rank": a.selector_rank} if arch == "dflash2" else {}
    dcfg = DrafterConfig.from_target_config(tcfg, a.layers, a.block_size, tcfg.vocab_size - 1, arch=arch, **keys)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).to(dev, target.dtype).eval()
    if a.draft_vocab:
        drafter.use_draft_vocab(torch.arange(a.draft_vocab), target.get_output_embeddings().weight)
    return drafter, dcfg


def batch1(a, target, tcfg, dev) -> dict:
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, TargetRunner, drafter_runner
    from dflashpipe.decode.static_target import StaticTargetRunner

    bs, P, new = a.block_size, (32 if a.tiny else 200), a.new
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tcfg.vocab_size - 2, (P,), generator=g).tolist()
    drafter, dcfg = random_drafter(a, target, tcfg, a.arch, dev)
    res: dict = {"prompt_tokens": P, "new_tokens": new, "block_size": bs, "drafter_layers": a.layers, "drafter_arch": a.arch,
                 "draft_vocab": a.draft_vocab}

    ids = torch.tensor([prompt], device=dev)

    def hf():
        target.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, temperature=None, top_p=None,
                        top_k=None, pad_token_id=0)

    if a.hf_static:  # transformers' own fastest batch-1 path: a static cache, its decode step compiled (CUDA graphs)
        res |= hf_static_generate(target, ids, new, dev)
        print(json.dumps({k: v for k, v in res.items() if k.startswith("hf_static")}), flush=True)
    runners = []
    if a.eager:
        res["hf_generate_ms_per_token"] = 1e3 * timed(hf, dev, reps=3, warm=1) / new
        runners.append(("dynamic", TargetRunner(target, dcfg.target_layer_ids)))
    # static_compiled_hf_layers: HF's layer modules instead of the written-out layers with fused projections
    for name, comp, fused in (("static_compiled_hf_layers", True, False), ("static", False, True),
                              ("static_compiled", True, True)):
        if name in a.static_modes.split(","):
            runners.append((name, StaticTargetRunner(target, dcfg.target_layer_ids, capacity=P + new + 2 * bs,
                                                     graph_sizes=(1, bs), compile=comp, fused=fused)))
    for name, runner in runners:
        t0 = time.perf_counter()
        ar = ARDecoder(target, [], runner=runner)
        ar.generate(prompt, 8)  # captures the graphs of this runner
        r = [ar.generate(prompt, new) for _ in range(3)]
        res[f"ar_{name}_ms_per_token"] = 1e3 * float(np.median([x.decode_s / x.target_forwards for x in r]))
        cache = runner.new_cache()
        runner.forward(cache, ids, 0, features=True, last_only=True)
        block = torch.randint(0, tcfg.vocab_size - 2, (1, bs), device=dev)

        def verify(runner=runner, cache=cache, block=block):
            runner.forward(cache, block, P, features=True)
            if name == "dynamic":
                runner.keep(cache, P)

        res[f"verify_{name}_ms"] = 1e3 * timed(verify, dev)
        dec = DFlashDecoder(target, drafter, dcfg, [], runner=runner,
                            draft_runner=drafter_runner(drafter, runner, capacity=P + new + 2 * bs))
        dec.generate(prompt, 8)
        r = [dec.generate(prompt, new) for _ in range(3)]
        res[f"dflash_block_{name}_ms"] = 1e3 * float(np.median([x.decode_s / x.verify_steps for x in r]))
        res[f"dflash_mean_accepted_{name}"] = float(np.mean([np.mean(x.accepted) for x in r]))
        res[f"{name}_seconds_incl_capture"] = time.perf_counter() - t0
        res[f"drafter_step_{name}"] = dec.draft.mode
        dcache = dec.draft.new_cache()
        feats = torch.randn(1, P, len(dcfg.target_layer_ids) * tcfg.hidden_size, device=dev, dtype=target.dtype)
        dec.draft.extend(dcache, feats, 0, P)
        last = torch.tensor([[prompt[-1]]], device=dev)
        res[f"draft_{name}_ms"] = 1e3 * timed(lambda dec=dec, dcache=dcache, last=last: dec._propose(dcache, prompt, last), dev)
        print(json.dumps({k: v for k, v in res.items() if name in k}), flush=True)  # a run cut short keeps these

    static = [name for name, _ in runners if name != "dynamic"]
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    res["target_weight_gb"] = weight_bytes / 1e9
    if torch.device(dev).type == "cuda":
        bw = copy_bandwidth(dev)
        res["copy_bandwidth_gb_s"] = bw / 1e9
        res["memory_bound_ms_per_token"] = 1e3 * weight_bytes / bw
        for name in static:
            res[f"ar_{name}_fraction_of_limit"] = res["memory_bound_ms_per_token"] / res[f"ar_{name}_ms_per_token"]
    for name in static:
        res[f"dflash_block_over_ar_{name}"] = res[f"dflash_block_{name}_ms"] / res[f"ar_{name}_ms_per_token"]
    return res


def static_generate(target, prompts, lengths, batch: int, dev) -> dict:
    """Today's embedded backend: a batch runs to its longest member (no EOS with random weights)."""
    t0 = time.perf_counter()
    useful = 0
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        ids = torch.tensor([prompts[i] for i in idx], device=dev)
        n = max(lengths[i] for i in idx)
        target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                        top_k=None, pad_token_id=0)
        useful += sum(lengths[i] for i in idx)
    sync(dev)
    secs = time.perf_counter() - t0
    return {"prompts": len(prompts), "useful_tokens": useful, "seconds": secs, "useful_tokens_per_s": useful / secs,
            "batch": batch}


def continuous(target, prompts, lengths, dev, cb_kwargs: dict, timeout: float) -> dict:
    """transformers' continuous batching, one request per prompt with its own reply length."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=None, pad_token_id=0)
    if torch.device(dev).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    manager = target.init_continuous_batching(generation_config=gc,
                                              continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs))
    manager.start()
    try:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        t1 = time.perf_counter()
        done, useful = 0, 0
        while done < len(prompts) and time.perf_counter() - t1 < timeout:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished():
                done += 1
                useful += len(out.generated_tokens)
    finally:
        manager.stop(block=True, timeout=30)
    secs = time.perf_counter() - t1
    res = {"config": cb_kwargs, "prompts_finished": done, "useful_tokens": useful, "seconds": secs,
           "useful_tokens_per_s": useful / secs, "start_s": t1 - t0, "timed_out": done < len(prompts)}
    if torch.device(dev).type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return res


def batched(target, prompts, lengths, dev, slots: int, attention: str, compile: bool, bandwidth: float | None,
            fused: bool = True) -> dict:
    """The ``batched`` expansion backend's decoder (:mod:`dflashpipe.decode.slots`), one limit per request."""
    from dflashpipe.decode.slots import SlotDecoder, kv_bytes_per_token

    if torch.device(dev).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    capacity = -(-(max(len(p) for p in prompts) + max(lengths)) // 256) * 256
    t0 = time.perf_counter()
    dec = SlotDecoder(target, slots, capacity, attention=attention, compile=compile, fused=fused)
    # compiles and captures every step the run will take: rows finish one after another (all row counts)
    warm_lengths = [2 + i * 64 // slots for i in range(min(slots, len(prompts)))]
    dec.generate(prompts[: len(warm_lengths)], warm_lengths, [])
    sync(dev)
    t1 = time.perf_counter()
    out = dec.generate(prompts, lengths, [])
    sync(dev)
    secs = time.perf_counter() - t1
    useful = sum(len(ids) for ids, _ in out)
    res = {"slots": slots, "capacity": dec.capacity, "mode": dec.mode, "useful_tokens": useful, "seconds": secs,
           "useful_tokens_per_s": useful / secs, "setup_compile_capture_s": t1 - t0,
           "steps_by_rows_computed": {str(k): v for k, v in sorted(dec.step_counts.items(), reverse=True)},
           "kv_cache_gib": sum(t.numel() * t.element_size() for t in dec.k + dec.v) / GIB}
    # the decode step alone, every row busy at one position: the run's mean position, and the cache's end
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    mean_pos = int(np.mean([len(p) for p in prompts]) + np.mean(lengths) / 2)
    saved = dec.pos.clone()
    for label, position in (("mean_position", mean_pos), ("full_capacity", dec.capacity - 1)):
        dec.pos.fill_(position)
        step_s = timed(lambda: dec._step(slots), dev, reps=20, warm=2)
        read = dec.capacity if dec.attention == "dense" else -(-(position + 1) // dec.kv_block) * dec.kv_block
        step_bytes = weight_bytes + slots * read * kv_bytes_per_token(target)
        res[f"decode_step_ms_at_{label}"] = 1e3 * step_s
        res[f"decode_step_position_{label}"] = position
        res[f"full_batch_tokens_per_s_at_{label}"] = slots / step_s
        res[f"decode_step_gb_read_at_{label}"] = step_bytes / 1e9
        if bandwidth:
            res[f"fraction_of_bandwidth_at_{label}"] = step_bytes / step_s / bandwidth
    # every step size the run took, at the mean position: where the run's time went
    dec.pos.fill_(mean_pos)
    res["decode_step_ms_by_rows_computed"] = {}
    for n in sorted(dec.step_counts, reverse=True):
        dec.active[:n] = torch.arange(n, device=dec.device)
        res["decode_step_ms_by_rows_computed"][str(n)] = 1e3 * timed(lambda n=n: dec._step(n), dev, reps=10, warm=1)
    res["decode_steps_s_estimated"] = sum(dec.step_counts[n] * ms / 1e3 for n, ms in
                                          ((int(k), v) for k, v in res["decode_step_ms_by_rows_computed"].items()))
    dec.pos.copy_(saved)
    if torch.device(dev).type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    del dec
    return res


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemv", "gemm", "nvjet", "cutlass", "sm90_xmma", "splitk", "matmul")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "softmax")):
        return "attention"
    if n.startswith("triton"):
        return "fused (Inductor)"
    return "other"


def gpu_kernels(fn, dev) -> list[dict]:
    """The GPU kernels ``fn()`` runs (also inside CUDA-graph replays), from a profiler trace:
    [{"name", "ts", "dur"}] in microseconds, in start order."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    return sorted(({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"])} for e in events
                   if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])


def profile_draft(a, target, tcfg, dev, archs=("dflash", "dflash2"), reps: int = 20) -> dict:
    """Where a draft's time goes (the evaluation's static drafter, compiled and captured on a GPU): per ``arch``
    (DFlash: argmax; DFlash 2: its selector over each position's top-k, ``--selector-rank``), the draft's time,
    its kernels per draft, their GPU time by kind, and the longest kernels."""
    from dflashpipe.decode.speculative import drafter_runner
    from dflashpipe.decode.static_target import StaticTargetRunner

    bs, P = a.block_size, (32 if a.tiny else 200)
    capacity = P + a.new + 2 * bs
    verify = StaticTargetRunner(target, None, capacity=capacity, graph_sizes=(bs,), compile=torch.device(dev).type == "cuda")
    g = torch.Generator().manual_seed(0)
    last = torch.tensor([[int(torch.randint(0, tcfg.vocab_size - 2, (1,), generator=g))]], device=dev)
    out = {}
    for arch in archs:
        drafter, dcfg = random_drafter(a, target, tcfg, arch, dev)
        draft = drafter_runner(drafter, verify, capacity=capacity)
        cache = draft.new_cache()
        feats = torch.randn(1, P, len(dcfg.target_layer_ids) * tcfg.hidden_size, device=dev, dtype=target.dtype)
        draft.extend(cache, feats, 0, P)

        def drafts(n=reps, draft=draft, cache=cache):
            for _ in range(n):
                draft.propose(cache, P + 1, last)

        ms = 1e3 * timed(lambda: drafts(1), dev)
        kernels = gpu_kernels(drafts, dev)
        by_kind: dict[str, float] = {}
        for k in kernels:
            by_kind[kernel_kind(k["name"])] = by_kind.get(kernel_kind(k["name"]), 0.0) + k["dur"] / reps
        longest: dict[str, float] = {}
        for k in kernels:
            longest[k["name"][:90]] = longest.get(k["name"][:90], 0.0) + k["dur"] / reps
        out[arch] = {"mode": draft.mode, "draft_ms": ms, "kernels_per_draft": len(kernels) / reps,
                     "gpu_busy_us": sum(k["dur"] for k in kernels) / reps,
                     "us_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                     "longest_us": dict(sorted(((k, round(v, 1)) for k, v in longest.items()), key=lambda kv: -kv[1])[:12])}
        print(json.dumps({arch: out[arch]}), flush=True)
    return out


def profile_ar(target, tcfg, dev, capacity: int, new: int = 32, P: int = 200) -> dict:
    """:func:`profile_ar_step` with HF's layer modules (the baseline), then with the layers written out
    and their projections fused (the evaluation's default), in this one process. ``capacity``: the
    static cache's (batch1's: its compiled steps are then loaded, not compiled again)."""
    out = {"hf_layers": profile_ar_step(target, tcfg, dev, capacity, new, P, fused=False)}
    out["fused"] = profile_ar_step(target, tcfg, dev, capacity, new, P, fused=True)
    out["matmul_alone_at_batch1"] = out["hf_layers"].pop("matmul_alone_at_batch1", None)
    out["fused"].pop("matmul_alone_at_batch1", None)
    return out


def profile_ar_step(target, tcfg, dev, capacity: int, new: int, P: int, fused: bool) -> dict:
    """Where a batch-1 AR token's time goes with the compiled, captured target step: the GPU kernels
    per token (count, busy time, idle time between them, by kind, the heaviest), and how close
    the step's matmuls alone come to the memory bandwidth (each at batch 1, in a CUDA graph)."""
    from dflashpipe.decode.cuda_graph import capture
    from dflashpipe.decode.speculative import ARDecoder
    from dflashpipe.decode.static_target import StaticTargetRunner

    prompt = torch.randint(0, tcfg.vocab_size - 2, (P,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = StaticTargetRunner(target, None, capacity=capacity, graph_sizes=(1,), compile=True, fused=fused)
    ar = ARDecoder(target, [], runner=runner)
    ar.generate(prompt, 8)  # compiles and captures
    t = time.perf_counter()
    r = ar.generate(prompt, new)
    wall_ms = 1e3 * r.decode_s / r.target_forwards

    # the AR loop's body (ARDecoder.generate after its prefill), new times; the prefill before the profiler
    cache = runner.new_cache()
    logits, _ = runner.forward(cache, torch.tensor([prompt], device=dev), 0, last_only=True)
    first = int(logits[-1].argmax())
    marks: list[float] = []

    def decode_steps(tok=first):
        marks.append(time.perf_counter())
        for n in range(P, P + new):
            logits, _ = runner.forward(cache, torch.tensor([[tok]], device=dev), n)
            tok = int(logits[-1].argmax())
        marks.append(time.perf_counter())

    body = gpu_kernels(decode_steps, dev)
    steps = new
    busy = sum(k["dur"] for k in body)
    span = (body[-1]["ts"] + body[-1]["dur"] - body[0]["ts"]) if body else 0.0
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for k in body:
        by_kind[kernel_kind(k["name"])] = by_kind.get(kernel_kind(k["name"]), 0.0) + k["dur"]
        by_name.setdefault(k["name"], [0, 0.0])
        by_name[k["name"]][0] += 1
        by_name[k["name"]][1] += k["dur"]
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    # idle GPU time between consecutive kernels: short gaps are a graph's kernel-to-kernel latency;
    # long ones (>= 20 us) the host's turn between steps (the token's copy out, the next launch)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(body, body[1:])]
    short = sum(g for g in gaps if 0 < g < 20)
    long_ = sum(g for g in gaps if g >= 20)
    out = {
        "mode": runner.mode,
        "ar_ms_per_token_wall": wall_ms,
        "ar_ms_per_token_wall_under_profiler": 1e3 * (marks[1] - marks[0]) / steps,
        "kernels_per_token": len(body) / steps if steps else None,
        "gpu_busy_ms_per_token": busy / 1e3 / steps if steps else None,
        "gpu_span_ms_per_token": span / 1e3 / steps if steps else None,
        "gpu_idle_between_kernels_ms_per_token": (span - busy) / 1e3 / steps if steps else None,
        "gpu_idle_short_gaps_ms_per_token": short / 1e3 / steps if steps else None,
        "gpu_idle_long_gaps_ms_per_token": long_ / 1e3 / steps if steps else None,
        "busy_ms_per_token_by_kind": {k: v / 1e3 / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "heaviest_kernels": [{"name": n[:90], "calls_per_token": c / steps, "us_per_call": d / c}
                             for n, (c, d) in heaviest],
        "seconds": time.perf_counter() - t,
    }
    if torch.device(dev).type != "cuda":  # the smoke run on a CPU stops here
        return out
    # each projection of one layer (and the LM head) alone at batch 1, captured: its weight bytes / time
    H, I, V = tcfg.hidden_size, tcfg.intermediate_size, tcfg.vocab_size
    kv = tcfg.num_key_value_heads * tcfg.head_dim
    q = tcfg.num_attention_heads * tcfg.head_dim
    shapes = {"q": (q, H), "k": (kv, H), "o": (H, q), "gate": (I, H), "down": (H, I), "lm_head": (V, H),
              "qkv fused": (q + 2 * kv, H), "gate+up fused": (2 * I, H)}
    gemv = {}
    x = torch.randn(1, 1, H, device=dev, dtype=torch.bfloat16)
    xi = torch.randn(1, 1, max(I, q), device=dev, dtype=torch.bfloat16)
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16)
        inp = x if n_in == H else xi[..., :n_in]
        graph, _ = capture(lambda w=w, inp=inp: torch.nn.functional.linear(inp, w), dev)
        reps = 50
        s = timed(lambda graph=graph: [graph.replay() for _ in range(reps)], dev, reps=5) / reps
        gemv[name] = {"us": 1e6 * s, "gb_s": w.numel() * 2 / s / 1e9}
        del w, graph
    out["matmul_alone_at_batch1"] = gemv
    return out


def explain_step(target, dev) -> dict:
    """How Dynamo splits the static target step (one token, no features): graphs, breaks and their reasons."""
    from dflashpipe.decode.static_target import StaticTargetRunner

    runner = StaticTargetRunner(target, None, capacity=256, graph_sizes=(1,), cuda_graphs=False)
    ids, pos = torch.tensor([[1]], device=dev), torch.tensor([5], device=dev)
    ex = torch._dynamo.explain(runner._step)(ids, pos, False, False)
    reasons = {}
    for b in ex.break_reasons:
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in b.user_stack[-3:][::-1])
        key = f"{b.reason.splitlines()[0][:300]} at {where}"
        reasons[key] = reasons.get(key, 0) + 1
    torch._dynamo.reset()
    return {"graphs": ex.graph_count, "graph_breaks": ex.graph_break_count, "break_reasons": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the same as --shapes tiny")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3_8b",
                    help="the target's shapes (random weights): smollm2 is config/smollm2.yaml's target (use --block-size 8)")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft among this many tokens (evaluate.draft_vocab; 0: all)")
    ap.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                    help="batch1's drafter: DFlash (the paper's, the figures so far) or DFlash 2 (the configs' recipe)")
    ap.add_argument("--selector-rank", type=int, default=256,
                    help="DFlash 2's selector rank (config/smollm2.yaml's), for --arch dflash2 and profile_draft")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--baseline-prompts", type=int, default=64, help="prompts for the static-generate baseline")
    ap.add_argument("--slots", default="256,512,256:dense",
                    help="batched backend runs: rows of its KV cache[:attention[:compiled[:unfused]]] (flex reads live "
                         "positions only, dense the whole capacity; default: the GPU default; compiled: Inductor on "
                         "the step; unfused: q/k/v and gate/up as separate matmuls)")
    ap.add_argument("--batched-prompts", default="256,1024",
                    help="prompt counts for the batched backend (more prompts: the tail of the longest replies weighs less)")
    ap.add_argument("--cb-configs", default='[{}]', help="JSON list of ContinuousBatchingConfig kwargs")
    ap.add_argument("--cb-timeout", type=float, default=150)
    ap.add_argument("--parts", default="batch1,expand",
                    help="comma-separated: batch1, expand, profile_ar (the AR step's GPU kernels: needs CUDA), "
                         "profile_draft (the draft's kernels, DFlash and DFlash 2), explain "
                         "(the static step's Dynamo graph breaks)")
    ap.add_argument("--static-modes", default="static,static_compiled",
                    help="batch1: static, static_compiled (layers written out, projections fused), "
                         "static_compiled_hf_layers (HF's layer modules)")
    ap.add_argument("--hf-static", action="store_true",
                    help="batch1: also transformers' static-cache generate (compiled on a GPU), the AR to beat")
    ap.add_argument("--no-eager", dest="eager", action="store_false",
                    help="batch1: skip HF generate and the dynamic (eager) loops: only the static modes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--inductor", default="",
                    help="comma-separated torch._inductor.config settings for every compile, e.g. max_autotune=1")
    a = ap.parse_args()
    dev = a.device
    set_inductor(a.inductor)
    if a.tiny:
        a.shapes = "tiny"
    a.tiny = a.shapes == "tiny"
    shapes = SHAPES[a.shapes]
    target, tcfg = build_target(shapes, 2048, a.block_size, dev)
    import transformers

    out = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "shapes": shapes}
    def save():  # after each part: a run cut short keeps what it measured
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1))

    for part in a.parts.split(","):
        if part == "batch1":
            out["batch1"] = batch1(a, target, tcfg, dev)
            print(json.dumps(out["batch1"], indent=1), flush=True)
        elif part == "expand":
            expand(a, target, tcfg, dev, out, save)
        elif part == "explain":  # the static step's Dynamo graphs and why it breaks
            out["explain"] = explain_step(target, dev)
            print(json.dumps(out["explain"], indent=1), flush=True)
        elif part == "profile_draft":
            out["profile_draft"] = profile_draft(a, target, tcfg, dev)
        elif part == "profile_ar":
            P = 32 if a.tiny else 200  # batch1's prompt and cache
            out["profile_ar"] = profile_ar(target, tcfg, dev, P + a.new + 2 * a.block_size, P=P)
            print(json.dumps(out["profile_ar"], indent=1), flush=True)
        save()


def expand(a, target, tcfg, dev, out: dict, save) -> None:
    g = torch.Generator().manual_seed(1)
    plen = 16 if a.tiny else 160
    counts = sorted({a.prompts, *(int(x) for x in a.batched_prompts.split(",") if x)})
    all_prompts = [torch.randint(0, tcfg.vocab_size - 2, (plen,), generator=g).tolist() for _ in range(counts[-1])]
    all_lengths = reply_lengths(counts[-1])
    if a.tiny:
        all_lengths = [max(1, n // 20) for n in all_lengths]
    prompts, lengths = all_prompts[: a.prompts], all_lengths[: a.prompts]
    out["reply_lengths"] = {"mean": float(np.mean(lengths)), "median": float(np.median(lengths)), "max": max(lengths)}
    nb = min(a.baseline_prompts, a.prompts)
    if nb:
        out["static_generate"] = static_generate(target, prompts[:nb], lengths[:nb], a.batch, dev)
        print(json.dumps(out["static_generate"]), flush=True)
        save()
    out["batched"] = []
    bandwidth = copy_bandwidth(dev) if torch.device(dev).type == "cuda" else None
    out["copy_bandwidth_gb_s"] = bandwidth / 1e9 if bandwidth else None
    for run in [x for x in a.slots.split(",") if x]:
        slots, attention, compiled, variant = (run.split(":") + ["", "", ""])[:4]
        for count in counts:
            try:
                r = batched(target, all_prompts[:count], all_lengths[:count], dev, int(slots), attention or "auto",
                            compiled == "compiled", bandwidth, fused=variant != "unfused")
            except Exception as err:  # noqa: BLE001
                r = {"slots": int(slots), "attention": attention, "error": f"{type(err).__name__}: {err}",
                     "traceback": traceback.format_exc()[-3000:]}
            r["prompts"] = count
            out["batched"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
            save()
            gc.collect()  # a decoder holding its compiled step is a reference cycle: free its cache now
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
    out["continuous"] = []
    for kw in json.loads(a.cb_configs):
        try:
            r = continuous(target, prompts, lengths, dev, kw, a.cb_timeout)
        except Exception as err:  # noqa: BLE001 - record and go on to the next configuration
            r = {"config": kw, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        out["continuous"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
        save()


if __name__ == "__main__":
    main()
