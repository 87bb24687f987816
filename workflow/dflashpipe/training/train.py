"""Train a DFlash drafter: one rank of a data-parallel run.

A run is one :class:`TrainRun` (settings, inputs, outputs, identity, world). A run with K ranks
(``world_size``) is K processes (started together by :mod:`.launch`, one GPU each, on one node or
several) that call :func:`train_rank` with the run and ranks 0..K-1 and meet
through a rendezvous (torch.distributed; NCCL on GPU, gloo on CPU; also for K=1,
one code path). ``train.batch_size`` is the GLOBAL batch of a step: rank r
trains on its ``batch_size / K`` slice of it, so 1, 2 or 8 GPUs train the same
drafter (same samples per step, same order, same anchors; :mod:`.data`), only
sooner. Gradients are exchanged by DDP and the AdamW state is sharded (ZeRO-1;
:mod:`.distributed`); the step itself is in :mod:`.step`, the loop over the steps in
:mod:`.loop`, checkpoints and the metrics history in :mod:`.checkpoint`, the held-out figures in
:mod:`.heldout`, the run itself in :mod:`.run`. Here: building a rank's models (:func:`build`, which the
compile-warm job shares), and :func:`train_rank`, read top to bottom: build, data, resume, hot start,
loop, outputs.

Optimiser: AdamW, fp32 master weights (bf16 autocast on CUDA), linear warm-up
then cosine, grad clip on the global norm.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from dflashpipe.jobs.runtime import Laps
from dflashpipe.jobs.tracking import check_available

from dflashpipe.training.checkpoint import publish, resume
from dflashpipe.training.data import run_data
from dflashpipe.training.distributed import init_dist
from dflashpipe.drafter.features import prepare_target
from dflashpipe.drafter.fp8 import check_fp8_device
from dflashpipe.training.loop import FIGURES, Progress, Rank, train_loop
from dflashpipe.drafter.model import ARCH_KEYS, DFlashDrafter, DrafterConfig, apply_compile_mode
from dflashpipe.training.run import TrainConfig, TrainRun  # noqa: F401 (imported from here by the jobs and tests)
from dflashpipe.training.step import Setup, allow_bucket_graphs, compile_signature, prime_buckets, resolve_setup, target_cache_off


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda": the visible GPU (one process per GPU)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def build(cfg: TrainConfig, target_dir: str, setup: Setup, laps: Laps | None = None):
    """Target (frozen, trimmed to the tapped layers), drafter (fp32 master weights), step setup, pad id.
    ``setup``: :func:`.step.resolve_setup`'s, resolved by the caller before the slow load; the one returned
    bears the drafter's mask token and target layers. ``laps``: times the target's load and the drafter's
    build, for the job's log."""
    from dflashpipe.inputs.target import load_target, resolve_mask_token

    laps = laps or Laps()
    dev = setup.device
    mask_id, _ = resolve_mask_token(target_dir, cfg.mask_token_id)  # the rule the start-up check applied
    if cfg.target_fp8:
        check_fp8_device(dev)
    target, tokenizer = load_target(target_dir, str(dev), setup.target_dtype)
    laps.lap("target")
    dcfg = DrafterConfig.from_target_config(target.config, cfg.num_layers, cfg.block_size, mask_id, cfg.target_layer_ids,
                                            **{k: getattr(cfg, k) for k in ARCH_KEYS})
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg).to(dev).train()  # fp32 master weights
    setup = replace(setup, mask_token_id=int(dcfg.mask_token_id), layer_ids=list(dcfg.target_layer_ids))
    apply_compile_mode(setup, drafter)
    laps.lap("drafter")
    prepare_target(target, cfg, setup, dcfg.target_layer_ids)  # trimmed (and in FP8), as training runs it
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    laps.lap("target")  # its load and its preparation, in one figure
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    return target, dcfg, setup, drafter, pad_id


def warm_compile(cfg: TrainConfig, tokenized_dir: str, target_dir: str, device: str, world_size: int,
                 log=print) -> dict:
    """The compile-warm job's work: build exactly what a rank builds and prime every bucket.

    Runs in a fresh process on one GPU slot alone, with the slot's cache dirs
    set, at one rank's batch shape for a run of ``world_size`` ranks; returns
    the compile signature and seconds per bucket for the stamp.
    """
    from dflashpipe.inputs.tokenized import load_tokenized

    laps = Laps()
    dev = resolve_device(device)
    setup = resolve_setup(cfg, str(dev), 0, [0], world_size)  # a bad attention/dtype/batch: before the load
    laps.lap("device")
    target, dcfg, setup, drafter, pad_id = build(cfg, target_dir, setup, laps)
    ds = load_tokenized(tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    laps.lap("data")
    log(f"set up in {sum(laps.seconds.values()):.1f} s ({laps})")
    seconds = prime_buckets(drafter, target, ds, buckets, setup, pad_id, log)
    return {"signature": compile_signature(setup, dcfg.to_dict(), buckets), "bucket_seconds": seconds}


# ---------------------------------------------------------------------------
# One rank of a run
# ---------------------------------------------------------------------------


def train_rank(run: TrainRun, rank: int, device: str, *, log=print, hot_start=None) -> dict:
    """Run rank ``rank`` of ``run`` (of ``run.world_size`` ranks) on ``device``; returns the run's summary.

    Read top to bottom: the rank built (models, data, the resumed state and the optimiser), its start
    logged, the hot start, the steps (:func:`.loop.train_loop`), the outputs. Rank 0 publishes them
    (``run.metrics_csv``, ``run.summary_json``, ``run.final_state``) once every rank has finished.
    ``hot_start``: a callable ``(signature: dict) -> checker`` (see :mod:`dflashpipe.jobs.hotstart`): it
    validates the slot's warm stamp against this rank's compile signature before anything compiles, and
    the checker's ``after_first_step(log)`` proves, after every bucket has been primed, that nothing was
    compiled from scratch and forbids compiles from then on. The run's identity is the one the launcher
    computed (computed here, first, if ``run`` has none).
    """
    from dflashpipe.inputs.tokenized import load_tokenized

    laps = Laps()
    t_start = laps.t
    run = run.identified()
    laps.lap("run identity")
    cfg, world_size = run.cfg, run.world_size
    check_available(cfg.tensorboard, cfg.wandb)  # a tracker asked for but not installed: one line first
    dev = resolve_device(device)
    # the step's settings, resolved once here: a bad attention/dtype/batch is one line, before any rank waits
    setup = resolve_setup(cfg, str(dev), 0, [0], world_size)
    laps.lap("device")
    init_dist(run.init_method, rank, world_size, dev, cfg.dist_timeout_s)
    laps.lap("process group")
    try:
        # -- build: models, data, the newest intact checkpoint of this run (rank 0 chooses, at any K), optimiser
        target, dcfg, setup, drafter, pad_id = build(cfg, run.target_dir, setup, laps)
        data = run_data(load_tokenized(run.tokenized_dir), cfg, pad_id, run.tokenized_dir, log)
        allow_bucket_graphs(data.buckets)  # hot start or not: no bucket's step falls back to eager
        laps.lap("data")
        state = resume(run, rank, log)
        r = Rank.ready(run, rank, (target, dcfg, setup, drafter), data, state, log)
        laps.lap("checkpoint and optimizer")
        start_step = int(state["step"]) if state is not None else 0
        log(f"train rank {rank}/{world_size} on {setup.device}: {len(data.train_idx)} train / "
            f"{len(data.heldout_idx)} held-out samples, {data.steps_per_epoch} steps/epoch, {data.total_steps} steps "
            f"of {cfg.batch_size} sequences ({setup.rank_batch} on this rank), attention={setup.attention}, "
            f"dtype={'bf16 autocast' if setup.autocast_dtype else 'fp32'}"
            + (f", resumed from step {start_step}" if start_step else ""))
        log(f"set up in {time.time() - t_start:.1f} s ({laps})")
        cache_off = target_cache_off(cfg, world_size)
        if cache_off and rank == 0:
            log(cache_off)
        # -- hot start: every compile up front, from the slot's warm cache
        hot = None
        if hot_start is not None:
            checker = hot_start(compile_signature(setup, dcfg.to_dict(), data.buckets))
            t_prime = time.time()
            prime_buckets(r.model, target, data.ds, data.buckets, setup, pad_id, log)
            hot = {"prime_seconds": time.time() - t_prime, "counters": checker.after_first_step(log)}
        # -- the steps, then the outputs
        last = dict(state["last"]) if state is not None else dict.fromkeys(FIGURES)
        p = Progress(start_step, last, t_start, hot=hot)
        history = train_loop(r, p)
        return publish(r, p, history)
    finally:
        dist.destroy_process_group()
