"""Compile caches of the GPU slots: one Inductor/Triton cache folder per slot, used by the job that
holds the slot, and seeded from the previous slot along the warm chain."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dflashpipe.jobs.lease import DeviceLease, lease_for_job


#: the folder under ``results`` of the GPU slots' compile caches (one ``slot{i}`` inside each)
COMPILE_CACHE = "compile_cache"


def slot_cache_dirs(cache_root: str | os.PathLike, slot: int) -> dict[str, str]:
    """Per-slot compile caches (Inductor FX graph / AOTAutograd caches, Triton kernels)."""
    root = Path(cache_root).resolve() / f"slot{slot}"
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}


def use_slot_cache(cache_root: str | os.PathLike, slot: int) -> dict[str, str]:
    """Point this process's compile caches at the slot's directories (call before compiling)."""
    env = slot_cache_dirs(cache_root, slot)
    for key, value in env.items():
        Path(value).mkdir(parents=True, exist_ok=True)
        os.environ[key] = value
    return env


def use_leased_slot_cache(config: dict, lease: DeviceLease, log=print) -> dict[str, str] | None:
    """A GPU job outside the warm chain (regeneration, evaluation) compiles into its leased slot's cache.

    One job holds a slot at a time, so no two processes compile into one cache at once; the
    first job on a slot compiles its steps, and every later one with the same shapes (the next
    dataset, a rerun after an edit) loads them. None (the process's default cache) without a slot.
    """
    if lease.slot is None or not str(lease.device).startswith("cuda"):
        return None
    env = use_slot_cache(Path(config["results"]) / COMPILE_CACHE, lease.slot)
    log(f"compile cache: slot {lease.slot}'s (a later job with these shapes loads what this one compiles)")
    return env


def lease_gpu_slot(config: dict, log=print) -> DeviceLease:
    """A GPU job outside the warm chain: any free slot leased (held until the process ends), and its
    compile cache used (:func:`use_leased_slot_cache`)."""
    lease = lease_for_job(config)
    log(f"leased slot {lease.slot}: device {lease.device}")
    use_leased_slot_cache(config, lease, log)
    return lease


def seed_slot_cache(cache_root: str | os.PathLike, slot: int) -> int:
    """Copy what slot ``slot - 1``'s warm job compiled into slot ``slot``'s cache (call before compiling).

    The warm chain runs slot after slot, so the previous slot's cache is
    complete and nobody writes to it any more. Compiled artefacts are keyed by
    the code, the shapes, the versions and the GPU model, not by the GPU index
    (every job sees its GPU as cuda:0): on a node of identical GPUs warm job i
    then LOADS every graph (cache hits) instead of compiling it again, and still
    proves it on its own GPU; a different GPU model misses and compiles. Files
    already there are kept (cache entries are content-addressed). Returns the
    number of files copied; 0 for slot 0.
    """
    if slot <= 0:
        return 0
    copied = 0
    src_dirs, dst_dirs = slot_cache_dirs(cache_root, slot - 1), slot_cache_dirs(cache_root, slot)
    for key, src in src_dirs.items():
        src, dst = Path(src), Path(dst_dirs[key])
        for f in sorted(src.rglob("*")) if src.is_dir() else []:
            target = dst / f.relative_to(src)
            if f.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
                copied += 1
    return copied
