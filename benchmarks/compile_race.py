"""Reproduce the torch.compile / flex_attention race that the pipeline's serial warm chain removes.

What it shows
    Several threads of ONE process call the same ``torch.compile``d ``flex_attention``
    (forward + backward on GPU) on a DFlash-shaped problem from a COLD compile cache at
    the same time. On torch 2.10-2.12 this can raise "nested FX tracing", silently run
    flex_attention uncompiled (the dense ``math_attention`` path, which materialises the
    whole score matrix), pile up duplicate Dynamo cache entries until ``recompile_limit``,
    or deadlock (H200, torch 2.11: 3 threads cold, fwd+bwd, 3 of 3 runs hung). Doing one
    warm-up call first, serially, avoids it. Two modes, each run R times, each run in a
    FRESH subprocess with its own empty TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR:

      threads  T threads call the compiled attention cold, released together by a barrier
      serial   one warm-up call in the main thread first, then the same T threads
      eager    (control, not run by default) the threads call flex_attention UNcompiled:
               shows that the dense-fallback counters fire

    Per run it counts: exceptions (by type and message), hangs (a run that outlives
    --timeout is killed; its Python stacks are dumped first via
    faulthandler.dump_traceback_later), dense fallback calls (real-tensor calls of
    ``math_attention`` / ``_math_attention_inner`` in ``torch._higher_order_ops.flex_attention``,
    and entries into the uncompiled flex_attention path), Dynamo graphs compiled
    (``counters["stats"]["unique_graphs"]``), cache entries on flex_attention's code object,
    ``recompile_limit`` hits, cache hit/miss counters, and wall seconds.

How to run
    python benchmarks/compile_race.py                       # CUDA if available, else a tiny CPU config
    python benchmarks/compile_race.py --device cuda --out results/compile_race.json
    python benchmarks/compile_race.py --device cpu --repeats 1   # quick check, forward only

    CPU: flex_attention has no backward there, so only the forward is compiled, and the
    defaults are tiny (each cold run still pays ~10-15 s of C++ compilation; the default
    2 modes x 3 repeats take ~1.5 min). torch 2.13 masks the FX-flag race (a global compile
    flag): expect 0 exceptions/dense calls/hangs there, but racing threads still leave
    duplicate Dynamo graphs (3 graphs for one shape vs 1 after a serial warm-up).
    ``--modes eager`` is a control run that calls flex_attention uncompiled, to show the
    dense-fallback counters work. GPU defaults:
    S=3072, 512 anchors, block 16, 32 q heads, 8 kv heads, head dim 128, bf16, fwd+bwd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPU_DEFAULTS = dict(seq_len=3072, anchors=512, block_size=16, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
CPU_DEFAULTS = dict(seq_len=128, anchors=8, block_size=8, heads=4, kv_heads=2, head_dim=16, dtype="float32")
MODES = ("threads", "serial", "eager")
DEFAULT_MODES = ("threads", "serial")


# =========================================================================== worker (fresh subprocess)


def _classify(exc: BaseException) -> str:
    msg = (str(exc).strip().splitlines() or [""])[0]
    low = str(exc).lower()
    tag = ""
    if "nested" in low and "fx" in low:
        tag = "[nested FX tracing] "
    elif "recompile" in low and "limit" in low:
        tag = "[recompile limit] "
    elif "out of memory" in low:
        tag = "[OOM] "
    return f"{tag}{type(exc).__name__}: {msg[:160]}"


def _worker(cfg_path: str) -> int:
    import faulthandler
    import threading

    cfg = json.loads(Path(cfg_path).read_text())
    stacks = open(cfg["stacks_path"], "w")
    faulthandler.dump_traceback_later(cfg["dump_after_s"], exit=False, file=stacks)
    progress = open(cfg["progress_path"], "a", buffering=1)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        progress.write(f"{time.perf_counter() - t_start:8.2f}s {threading.current_thread().name}: {msg}\n")

    import logging

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention import flex_attention as flex_mod
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    hop_mod = sys.modules["torch._higher_order_ops.flex_attention"]
    log(f"torch {torch.__version__} imported")
    if cfg["torch_threads"]:
        torch.set_num_threads(cfg["torch_threads"])

    # ---- instrumentation: dense fallback, uncompiled entries, recompile-limit hits
    stats = {"dense_fwd_calls": 0, "dense_bwd_calls": 0, "uncompiled_flex_calls": 0, "recompile_limit_hits": 0}
    lock = threading.Lock()
    tls = threading.local()
    hooks = []

    def bump(key: str) -> None:
        with lock:
            stats[key] += 1

    def is_real(x) -> bool:  # not a FakeTensor/FunctionalTensor seen while tracing
        return type(x) in (torch.Tensor, torch.nn.Parameter)

    if hasattr(hop_mod, "math_attention"):
        orig_math = hop_mod.math_attention

        def math_attention(*a, **k):
            if a and is_real(a[0]):
                bump("dense_fwd_calls")
            tls.in_math = True
            try:
                return orig_math(*a, **k)
            finally:
                tls.in_math = False

        hop_mod.math_attention = math_attention
        hooks.append("math_attention")
    if hasattr(hop_mod, "_math_attention_inner"):
        orig_inner = hop_mod._math_attention_inner

        def _math_attention_inner(*a, **k):
            if not getattr(tls, "in_math", False) and a and is_real(a[0]):
                bump("dense_bwd_calls")  # called by the dense backward (sdpa_dense_backward)
            return orig_inner(*a, **k)

        hop_mod._math_attention_inner = _math_attention_inner
        hooks.append("_math_attention_inner")
    if hasattr(flex_mod, "_warn_once"):
        orig_warn = flex_mod._warn_once

        def _warn_once(warning_id, *a, **k):
            if warning_id == "flex_attention_performance":
                bump("uncompiled_flex_calls")
            return orig_warn(warning_id, *a, **k)

        flex_mod._warn_once = _warn_once
        hooks.append("_warn_once")
    cf_mod = sys.modules.get("torch._dynamo.convert_frame")
    if cf_mod is not None and hasattr(cf_mod, "exceeds_recompile_limit"):
        orig_exceeds = cf_mod.exceeds_recompile_limit

        def exceeds_recompile_limit(*a, **k):
            res = orig_exceeds(*a, **k)
            if res and res[0]:
                bump("recompile_limit_hits")
            return res

        cf_mod.exceeds_recompile_limit = exceeds_recompile_limit
        hooks.append("exceeds_recompile_limit")
    else:

        class _LimitHandler(logging.Handler):
            def emit(self, record):
                if "hit config." in record.getMessage():
                    bump("recompile_limit_hits")

        logging.getLogger("torch._dynamo.convert_frame").addHandler(_LimitHandler())
        hooks.append("log:hit config.")

    # ---- the DFlash-shaped problem
    dev = torch.device(cfg["device"])
    dtype = getattr(torch, cfg["dtype"])
    S, N, bs = cfg["seq_len"], cfg["anchors"], cfg["block_size"]
    Hq, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q_len, kv_len = N * bs, S + N * bs
    gen = torch.Generator().manual_seed(0)
    anchors = torch.sort(torch.randperm(S - 1, generator=gen)[:N] + 1).values.to(dev)
    keep = torch.ones(N, dtype=torch.bool, device=dev)
    keep[-max(1, N // 8):] = False  # padded anchors see nothing

    def mask_mod(b, h, q_idx, kv_idx):
        blk = torch.clamp(q_idx // bs, max=N - 1)  # create_block_mask pads Q_LEN to 128
        ctx = (kv_idx < S) & (kv_idx < anchors[blk])  # strict: not the anchor's own feature
        same = (kv_idx >= S) & ((kv_idx - S) // bs == blk)  # bidirectional inside the block
        return (ctx | same) & keep[blk] & (q_idx < q_len)

    t0 = time.perf_counter()
    block_mask = create_block_mask(mask_mod, 1, None, q_len, kv_len, device=dev)
    log(f"block mask built in {time.perf_counter() - t0:.2f}s")
    compiled = flex_attention if cfg["mode"] == "eager" else torch.compile(flex_attention)
    backward = cfg["backward"]

    def one_call() -> None:
        q = torch.randn(1, Hq, q_len, D, device=dev, dtype=dtype, requires_grad=backward)
        k = torch.randn(1, Hkv, kv_len, D, device=dev, dtype=dtype, requires_grad=backward)
        v = torch.randn(1, Hkv, kv_len, D, device=dev, dtype=dtype, requires_grad=backward)
        out = compiled(q, k, v, block_mask=block_mask, enable_gqa=Hq != Hkv)
        if backward:
            out.float().sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    errors: dict[str, int] = {}
    calls = {"ok": 0, "failed": 0}
    call_s: list[float] = []

    def timed_call(label: str) -> None:
        log(f"{label} start")
        t = time.perf_counter()
        try:
            one_call()
        except Exception as exc:  # noqa: BLE001 - every failure is a data point here
            key = _classify(exc)
            with lock:
                errors[key] = errors.get(key, 0) + 1
                calls["failed"] += 1
            log(f"{label} FAILED: {key}")
            return
        dt = time.perf_counter() - t
        with lock:
            calls["ok"] += 1
            call_s.append(dt)
        log(f"{label} ok {dt:.2f}s")

    warmup_s = None
    if cfg["mode"] == "serial":
        t = time.perf_counter()
        timed_call("warm-up")
        warmup_s = time.perf_counter() - t

    barrier = threading.Barrier(cfg["threads"])

    def thread_main(i: int) -> None:
        barrier.wait()
        for j in range(cfg["calls"]):
            timed_call(f"call {j}")

    threads = [threading.Thread(target=thread_main, args=(i,), name=f"T{i}", daemon=True)
               for i in range(cfg["threads"])]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    threads_s = time.perf_counter() - t
    faulthandler.cancel_dump_traceback_later()

    cache_entries = None
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        cache_entries = len(_debug_get_cache_entry_list(flex_attention.__code__))
    except Exception:  # noqa: BLE001 - private API, best effort
        pass
    pick = {
        "stats": ("unique_graphs", "calls_captured"),
        "frames": ("total", "ok"),
        "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss"),
        "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss"),
    }
    ctr = {f"{g}.{k}": int(counters[g][k]) for g, ks in pick.items() for k in ks}
    result = {
        **stats,
        "errors": errors,
        "n_errors": sum(errors.values()),
        "calls_ok": calls["ok"],
        "calls_failed": calls["failed"],
        "unique_graphs": ctr["stats.unique_graphs"],
        # one shape is compiled, so every graph beyond the first is a duplicate made by racing compiles
        "duplicate_graphs": max(0, ctr["stats.unique_graphs"] - 1) if cfg["mode"] != "eager" else None,
        "cache_entries": cache_entries,
        "recompile_limit": getattr(torch._dynamo.config, "recompile_limit", None),
        "counters": ctr,
        "warmup_s": warmup_s,
        "threads_s": threads_s,
        "max_call_s": max(call_s) if call_s else None,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "hooks": hooks,
    }
    Path(cfg["result_path"]).write_text(json.dumps(result, indent=1))
    log("done")
    return 0


# =========================================================================== parent


def _run_one(mode: str, rep: int, cfg: dict, timeout: float, keep_caches: bool, stacks_dir: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"compile_race_{mode}{rep}_"))
    cache = work / "inductor"
    triton = work / "triton"
    cache.mkdir()
    triton.mkdir()
    paths = {k: str(work / f"{k}.txt") for k in ("stacks", "progress", "result")}
    wcfg = dict(cfg, mode=mode, stacks_path=paths["stacks"], progress_path=paths["progress"],
                result_path=paths["result"], dump_after_s=max(1.0, timeout - min(15.0, 0.2 * timeout)))
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(wcfg))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(triton), PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", str(cfg_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    hung = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and any compile subprocesses
        except ProcessLookupError:
            pass
        output, _ = proc.communicate()
    wall = time.perf_counter() - t
    run = {"mode": mode, "repeat": rep, "hung": hung, "rc": proc.returncode, "wall_s": round(wall, 2)}
    if Path(paths["result"]).exists():
        run.update(json.loads(Path(paths["result"]).read_text()))
        run["status"] = "ok" if run["n_errors"] == 0 else "errors"
    else:
        run["status"] = "hang" if hung else "crash"
        run["output_tail"] = output.decode(errors="replace")[-3000:]
    progress = Path(paths["progress"]).read_text() if Path(paths["progress"]).exists() else ""
    run["progress_tail"] = progress.splitlines()[-12:]
    stacks = Path(paths["stacks"]).read_text() if Path(paths["stacks"]).exists() else ""
    if hung or run["status"] == "crash":
        run["stacks"] = stacks[-20000:]
        if stacks_dir is not None and stacks:
            stacks_dir.mkdir(parents=True, exist_ok=True)
            out = stacks_dir / f"{mode}-{rep}.stacks.txt"
            out.write_text(stacks)
            run["stacks_file"] = str(out)
    if keep_caches:
        run["work_dir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return run


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _summarise(runs: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["mode"] == mode]
        done = [r for r in rs if r["status"] in ("ok", "errors")]
        errors: dict[str, int] = {}
        for r in done:
            for k, v in r.get("errors", {}).items():
                errors[k] = errors.get(k, 0) + v
        out[mode] = {
            "runs": len(rs),
            "clean_runs": sum(r["status"] == "ok" and r["dense_fwd_calls"] + r["dense_bwd_calls"]
                              + r["uncompiled_flex_calls"] + r["recompile_limit_hits"]
                              + (r["duplicate_graphs"] or 0) == 0 for r in done),
            "hangs": sum(r["status"] == "hang" for r in rs),
            "crashes": sum(r["status"] == "crash" for r in rs),
            "runs_with_errors": sum(r["status"] == "errors" for r in rs),
            "errors": errors,
            "dense_fwd_calls": sum(r["dense_fwd_calls"] for r in done),
            "dense_bwd_calls": sum(r["dense_bwd_calls"] for r in done),
            "uncompiled_flex_calls": sum(r["uncompiled_flex_calls"] for r in done),
            "recompile_limit_hits": sum(r["recompile_limit_hits"] for r in done),
            "duplicate_graphs": sum(r["duplicate_graphs"] or 0 for r in done),
            "max_unique_graphs": max((r["unique_graphs"] for r in done), default=None),
            "max_cache_entries": max((r["cache_entries"] or 0 for r in done), default=None),
            "median_wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
        }
    return out


def _print_table(runs: list[dict], summary: dict) -> None:
    cols = ["mode", "rep", "status", "wall_s", "warm_s", "thr_s", "errors", "dense f/b", "uncompiled",
            "graphs", "entries", "limit hits"]
    rows = []
    for r in runs:
        done = r["status"] in ("ok", "errors")
        rows.append([
            r["mode"], str(r["repeat"]), r["status"], _fmt(r["wall_s"]),
            _fmt(r.get("warmup_s")), _fmt(r.get("threads_s")),
            str(r.get("n_errors", "-")),
            f"{r['dense_fwd_calls']}/{r['dense_bwd_calls']}" if done else "-",
            str(r.get("uncompiled_flex_calls", "-")), str(r.get("unique_graphs", "-")),
            _fmt(r.get("cache_entries")), str(r.get("recompile_limit_hits", "-")),
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(cols))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    print()
    for mode, s in summary.items():
        print(f"{mode:8s} runs {s['runs']}: clean {s['clean_runs']}, hangs {s['hangs']}, crashes {s['crashes']}, "
              f"runs with exceptions {s['runs_with_errors']}, dense fwd/bwd calls "
              f"{s['dense_fwd_calls']}/{s['dense_bwd_calls']}, uncompiled flex calls {s['uncompiled_flex_calls']}, "
              f"duplicate graphs {s['duplicate_graphs']}, recompile-limit hits {s['recompile_limit_hits']}, median wall {s['median_wall_s']} s")
        for msg, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
            print(f"           {n} x {msg}")
    for r in runs:
        if r["status"] in ("hang", "crash"):
            where = r.get("stacks_file") or "the JSON (key 'stacks')"
            print(f"{r['mode']} #{r['repeat']} {r['status']}: stacks in {where}; last progress:")
            for ln in r["progress_tail"][-4:]:
                print(f"    {ln}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="comma list of: threads, serial, eager (uncompiled control)")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode (each a fresh process and cache)")
    p.add_argument("--threads", type=int, default=3, help="threads calling the compiled attention at once")
    p.add_argument("--calls", type=int, default=2, help="calls per thread (the first is the cold one)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per run before it counts as a hang")
    p.add_argument("--seq-len", type=int, help="context length S (GPU default 3072)")
    p.add_argument("--anchors", type=int, help="anchors (blocks) per sequence (GPU default 512)")
    p.add_argument("--block-size", type=int, help="block size (default 16 GPU, 8 CPU)")
    p.add_argument("--heads", type=int, help="query heads (GPU default 32)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GPU default 8)")
    p.add_argument("--head-dim", type=int, help="head dim (GPU default 128)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default bf16 GPU, fp32 CPU")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help="include backward (default: on for cuda; impossible on cpu)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default 1 on cpu)")
    p.add_argument("--out", type=Path, help="write JSON here (hung runs' stacks go beside it)")
    p.add_argument("--keep-caches", action="store_true", help="keep each run's temp cache dir")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        return _worker(args._worker)

    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    backward = (device == "cuda") if args.backward is None else args.backward
    if backward and device == "cpu":
        p.error("flex_attention has no backward on CPU; drop --backward")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes must be a comma list of {', '.join(MODES)}")
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in defaults.items()}
    cfg.update(device=device, backward=backward, threads=args.threads, calls=args.calls,
               torch_threads=args.torch_threads if args.torch_threads is not None else (1 if device == "cpu" else 0))
    if cfg["heads"] % cfg["kv_heads"]:
        p.error("--heads must be a multiple of --kv-heads")

    from importlib.metadata import version

    tv = version("torch")
    print(f"compile_race: torch {tv}, device {device}, {'forward+backward' if backward else 'forward only'}, "
          f"{args.threads} threads x {args.calls} calls, {args.repeats} repeat(s) per mode, timeout {args.timeout:g} s")
    print(f"  shape: S={cfg['seq_len']} anchors={cfg['anchors']} block={cfg['block_size']} heads={cfg['heads']} "
          f"kv_heads={cfg['kv_heads']} head_dim={cfg['head_dim']} {cfg['dtype']}; "
          f"q_len={cfg['anchors'] * cfg['block_size']} kv_len={cfg['seq_len'] + cfg['anchors'] * cfg['block_size']}")
    if not backward:
        print("  note: forward only; the deadlock seen on torch 2.11 needs backward (autograd engine)")
    if tv.startswith("2.13."):
        print("  note: torch 2.13 masks the FX-flag race (global compile flag), so exceptions, dense calls and hangs "
              "are expected to be 0;\n        racing cold compiles may still add duplicate Dynamo graphs "
              "(graphs > 1 for this single shape)")
    print("  columns: dense f/b = real-tensor math_attention fwd/bwd calls; uncompiled = entries into uncompiled "
          "flex_attention;\n           graphs = Dynamo graphs compiled (1 expected); entries = cache entries on "
          "flex_attention's code")
    print(flush=True)

    stacks_dir = args.out.with_suffix("").parent / (args.out.stem + "_stacks") if args.out else None
    runs = []
    for mode in modes:
        for rep in range(args.repeats):
            run = _run_one(mode, rep, cfg, args.timeout, args.keep_caches, stacks_dir)
            runs.append(run)
            print(f"  {mode} #{rep}: {run['status']} in {run['wall_s']} s", flush=True)
    print()
    summary = _summarise(runs)
    _print_table(runs, summary)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": tv, "device": device, "backward": backward, "config": cfg, "repeats": args.repeats,
                "timeout_s": args.timeout, "python": sys.version.split()[0]}
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
