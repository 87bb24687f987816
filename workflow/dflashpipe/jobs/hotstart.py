"""Compile-warm stamps and the hot-start proof of training shards.

Why: several workers compiling flex_attention cold at once can deadlock, raise
"nested FX tracing", or silently run flex_attention UNCOMPILED (a dense
B*H*Q*KV score matrix that OOMs at real sizes). The pipeline therefore compiles
everything a shard will run ONCE per GPU slot, serially (warm_slot0 ->
warm_slot1 -> ...), into that slot's own cache directory, and records a stamp.
A shard then starts from the warm cache and must prove it: zero cache misses
during its first step, then ``fail_on_recompile`` from there on, and any dense
flex_attention call is an error.

The stamp is a small JSON (versions, device, cache dir, buckets, compile
seconds, cache counters) plus a fingerprint of everything that changes the
compiled code: the training-step source files, the drafter/training config
that sets shapes, the buckets, dtype, torch/triton/CUDA versions and device.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path

from dflashpipe.jobs.errors import UserError

# The source that decides the compiled training step and the trained weights: these modules with
# everything they import, plus the training loop itself (training/train.py, not its imports:
# checkpointing, export and held-out figures change no weight). Also the code part of a
# training run's identity (training/checkpoint.py).
#: the step, its data and exchange, the drafter it runs and the target's FP8 linears (the step receives
#: the models; it does not import them)
TRAIN_STEP_MODULES = ["training.step", "training.data", "training.distributed", "drafter.model", "drafter.fp8"]
#: the rank that runs the step (its loop in a file of its own) and the run it reads its settings from;
#: files alone, not their imports
TRAIN_LOOP_FILES = ("training/train.py", "training/loop.py", "training/run.py")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_info(device: str) -> dict:
    """Versions and device identity that compiled artefacts depend on."""
    import torch

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(0)
        capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        name, capability = f"cpu ({platform.machine()})", None
    return {
        "torch": torch.__version__,
        "triton": _version("triton") or _version("pytorch-triton"),
        "cuda": torch.version.cuda,
        "device": device,
        "device_name": name,
        "capability": capability,
    }


def code_digest(files: list[str]) -> str:
    """What the library files mean (comments, docstrings, log messages and where the files sit do not
    count: see :func:`dflashpipe.jobs.codedeps.meaning_digest`)."""
    from dflashpipe.jobs.codedeps import meaning_digest

    return meaning_digest(files, Path(__file__).resolve().parents[1])


def train_step_code_files() -> list[str]:
    from dflashpipe.jobs.codedeps import module_closure

    package = Path(__file__).resolve().parents[1]
    return sorted({*module_closure(package, TRAIN_STEP_MODULES), *(str(package / f) for f in TRAIN_LOOP_FILES)})


def fingerprint_parts(compile_config: dict, device: str) -> dict:
    """Everything that changes compiled code, as a dict (kept readable in the stamp)."""
    return {
        "code": code_digest(train_step_code_files()),
        "config": compile_config,
        **runtime_info(device),
    }


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_counters() -> dict:
    """Inductor FX-graph and AOTAutograd cache hits/misses of this process so far."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        # graphs the caches refused to store or load (compiled afresh every time)
        "fxgraph_cache_bypass": int(counters["inductor"]["fxgraph_cache_bypass"]),
        "autograd_cache_bypass": int(counters["aot_autograd"]["autograd_cache_bypass"]),
    }


def check_stamp(stamp_path: str, parts: dict) -> dict:
    """Refuse to train from a stale stamp: say which part differs and what to rerun."""
    p = Path(stamp_path)
    if not p.exists():
        raise UserError(f"{p}: compile-warm stamp missing; run its warm job first (snakemake reruns it)")
    try:
        stamp = json.loads(p.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{p}: compile-warm stamp is not valid JSON; delete it so the warm job reruns") from None
    recorded = dict(stamp.get("parts", {}))
    for key in ("torch", "triton", "cuda", "device_name"):  # readable copies at the top level count too
        if key in stamp and stamp[key] != recorded.get(key):
            recorded[key] = stamp[key]
    diffs = [k for k in sorted(set(recorded) | set(parts)) if recorded.get(k) != parts.get(k)]
    if not diffs and stamp.get("fingerprint") == fingerprint(parts):
        return stamp
    detail = "; ".join(f"{k}: stamp has {recorded.get(k)!r}, this shard has {parts.get(k)!r}" for k in diffs[:3])
    raise UserError(
        f"{p} is stale ({detail or 'fingerprint differs'}); rerun the warm chain: "
        f"snakemake --forcerun warm_slot (or delete {p.parent}/slot*.json)"
    )


def forbid_dense_flex() -> None:
    """Make any uncompiled (dense) flex_attention call an error instead of a silent OOM risk.

    Uncompiled flex_attention runs ``math_attention`` in
    ``torch._higher_order_ops.flex_attention``, which materialises the full
    B*H*Q*KV score matrix. Compiled code never calls it with real tensors
    (only fake ones while tracing), so a call with real tensors means the
    compiled path was lost.
    """
    import importlib

    import torch

    # import_module, not `import ... as`: the package attribute of that name is the HOP object
    hop = importlib.import_module("torch._higher_order_ops.flex_attention")
    if getattr(hop.math_attention, "_dflash_guard", False):
        return
    original = hop.math_attention

    def guarded(*args, **kwargs):
        if args and type(args[0]) in (torch.Tensor, torch.nn.Parameter):
            raise RuntimeError(
                "uncompiled (dense) flex_attention call: the compiled path was lost (recompile limit, "
                "nested FX tracing or a cold cache); refusing to materialise the full score matrix"
            )
        return original(*args, **kwargs)

    guarded._dflash_guard = True
    hop.math_attention = guarded


class HotStartGuard:
    """Proves a shard started hot: no cache misses while priming, no compile afterwards."""

    def __init__(self, stamp_path: str, enforce: bool):
        self.stamp_path = stamp_path
        self.enforce = enforce

    def after_first_step(self, log=print) -> dict:
        import torch

        counters = cache_counters()
        misses = counters["fxgraph_cache_miss"] + counters["autograd_cache_miss"]
        log(f"hot-start check after priming every bucket: {counters}")
        if not self.enforce:
            return counters
        bypass = counters["fxgraph_cache_bypass"] + counters["autograd_cache_bypass"]
        if bypass:  # not a stale cache, but compile work the warm job could not take over
            log(f"WARNING: {bypass} graph(s) bypassed the compile caches and were compiled in this shard")
        if misses:
            raise UserError(
                f"shard was not hot: {misses} compile cache miss(es) while priming; {self.stamp_path} does not "
                "match what this shard compiles (stale stamp or cleared cache); rerun the warm chain: "
                "snakemake --forcerun warm_slot"
            )
        torch.compiler.set_stance("fail_on_recompile")
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        return counters


def hot_start(stamp_path: str, device: str):
    """The ``hot_start`` callable for :func:`dflashpipe.training.train.train_rank`.

    Given the shard's compile signature it checks the slot's stamp (one line
    naming the stale part otherwise) and returns the guard that checks the
    counters after priming. (Dense flex_attention is forbidden earlier, by
    ``apply_compile_mode``, for every flex user: shards, warm jobs, benchmarks.)
    Compile-free runs (CPU SDPA) are checked against the stamp too, but have no
    counters to prove.
    """

    def start(signature: dict) -> HotStartGuard:
        check_stamp(stamp_path, fingerprint_parts(signature, device))
        return HotStartGuard(stamp_path, enforce=bool(signature.get("compiled_flex")))

    return start


def write_stamp(path: str, signature: dict, device: str, cache_dirs: dict, bucket_seconds: dict, slot: int,
                interval: tuple[float, float] | None = None) -> dict:
    """The warm job's output: what was compiled, where, how long it took, and its fingerprint."""
    from dflashpipe.jobs.atomic import write_json

    parts = fingerprint_parts(signature, device)
    stamp = {
        "slot": slot,
        "fingerprint": fingerprint(parts),
        "parts": parts,
        **{k: parts[k] for k in ("torch", "triton", "cuda", "device_name")},
        "cache_dirs": cache_dirs,
        "buckets": signature["buckets"],
        "compile_seconds": sum(bucket_seconds.values()),
        "bucket_seconds": bucket_seconds,
        "counters": cache_counters(),
        "started_at": interval[0] if interval else None,  # epoch seconds, for the no-overlap check
        "finished_at": interval[1] if interval else None,
    }
    write_json(path, stamp)
    return stamp
