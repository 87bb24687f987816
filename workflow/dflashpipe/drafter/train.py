"""Train a DFlash drafter: one rank of a data-parallel run, read top to bottom.

A run with K ranks is K processes (started together by :mod:`.launch`, one
GPU each, on one node or several) that call :func:`train_rank` with ranks 0..K-1 and meet
through a rendezvous (torch.distributed; NCCL on GPU, gloo on CPU; also for K=1,
one code path). ``train.batch_size`` is the GLOBAL batch of a step: rank r
trains on its ``batch_size / K`` slice of it, so 1, 2 or 8 GPUs train the same
drafter (same samples per step, same order, same anchors; :mod:`.data`), only
sooner. Gradients are exchanged by DDP and the AdamW state is sharded (ZeRO-1;
:mod:`.distributed`); the step itself is in :mod:`.step`, checkpoints and the
metrics history in :mod:`.checkpoint`, the held-out figures in :mod:`.heldout`.

Optimiser: AdamW, fp32 master weights (bf16 autocast on CUDA), linear warm-up
then cosine, grad clip on the global norm.
"""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflashpipe.atomic import write_json
from dflashpipe.config import schema_settings
from dflashpipe.errors import UserError
from dflashpipe.faults import failpoint
from dflashpipe.runtime import Laps
from dflashpipe.tracking import Tracker, check_available

from .checkpoint import MetricsHistory, load_checkpoint, run_identity, save_checkpoint, save_final_state, start_run
from .data import TRAIN_SALT, epoch_batches, heldout_split, make_batch, rank_slice, sample_seed
from .distributed import (
    adamw,
    broadcast_int,
    check_same_on_all_ranks,
    data_parallel,
    full_optimizer_state,
    gather,
    init_dist,
)
from .features import trim_unused_layers
from .fp8 import check_fp8_device, quantize_decoder_linears
from .heldout import heldout_figures
from .model import ARCH_FIELDS, ARCH_KEYS, DFlashDrafter, DrafterConfig
from .step import (
    apply_compile_mode,
    compile_signature,
    lr_at,
    prime_buckets,
    resolve_setup,
    target_cache_off,
    train_step,
)

# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@schema_settings("drafter", "train")
class TrainConfig:
    """The ``drafter`` and ``train`` sections and ``seed``, as one rank takes them: built once by the job
    (:func:`dflashpipe.config.settings`), sent to the ranks as JSON. Defaults: the schema's."""

    JOB_KEYS = ("shards", "nodes", "threads")  # the job's rank processes and their threads (scripts/train.py)

    num_layers: int  # drafter layers
    block_size: int
    # the architecture keys (arch, layer_types, sliding_window, the dflash2 keys): declared once, as the
    # DrafterConfig fields of the same names (model.ARCH_FIELDS); handed to it as they are (build)
    __annotations__.update(ARCH_FIELDS)
    num_anchors: int  # N anchors per sequence, padded with keep=False
    target_layer_ids: list[int] | None  # None: default_target_layer_ids(L, num_layers)
    mask_token_id: int | None  # None: tokenizer.mask_token_id, else error
    batch_size: int  # sequences per step, over all ranks (the global batch)
    epochs: float
    max_steps: int | None  # cap (for tests / quick runs)
    lr: float
    warmup_ratio: float
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    loss_chunk_size: int
    checkpoint_every: int  # steps
    eval_every: int  # 0: only at the end
    heldout_samples: int  # deterministic held-out split of the tokenized data (by hash of id)
    seed: int
    loss: str  # kl (the target's distribution) | ce (the data's tokens)
    tv_weight: float  # + that multiple of the total variation to the target (or the label)
    position_weights: str  # decay (exp(-(k-1)/gamma), the paper) | dpace
    selector_weight: float  # dflash2: the candidate selector's loss, relative to the token loss
    cache_target_features: bool  # keep the frozen target's outputs per sample for later epochs (small targets)
    target_fp8: bool  # the target's decoder-layer linears in FP8 for its forward (.fp8)
    attention: str  # auto: flex on CUDA, sdpa (dense mask) on CPU
    compile: str  # flex path (CUDA): layers | flex (flex_attention alone) | none (guard stops it)
    activation_memory_budget: float  # < 1: the compiled backward recomputes instead of saving (less memory)
    dtype: str  # auto: bf16 autocast on CUDA with fp32 master weights; fp32 on CPU
    dist_timeout_s: float
    tensorboard: bool  # experiment tracking (dflashpipe.tracking; operational: not in the run identity)
    wandb: bool
    wandb_project: str


# ---------------------------------------------------------------------------
# Building: target, drafter, step setup
# ---------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda": the visible GPU (one process per GPU)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def build(cfg: TrainConfig, target_dir: str, dev: torch.device, world_size: int, laps: Laps | None = None):
    """Target (frozen, trimmed to the tapped layers), drafter (fp32 master weights), step setup, pad id.
    ``laps``: times the target's load and the drafter's build, for the job's log."""
    from dflashpipe.target import load_target, resolve_mask_token

    laps = laps or Laps()

    early = resolve_setup(cfg, str(dev), 0, [0], world_size)  # validates attention/dtype/batch before the slow load
    mask_id, _ = resolve_mask_token(target_dir, cfg.mask_token_id)  # the rule the start-up check applied
    if cfg.target_fp8:
        check_fp8_device(dev)
    target, tokenizer = load_target(target_dir, str(dev), early.target_dtype)
    dcfg = DrafterConfig.from_target_config(target.config, cfg.num_layers, cfg.block_size, mask_id, cfg.target_layer_ids,
                                            **{k: getattr(cfg, k) for k in ARCH_KEYS})
    setup = resolve_setup(cfg, str(dev), dcfg.mask_token_id, dcfg.target_layer_ids, world_size)
    prepare_target(target, cfg, setup, dcfg.target_layer_ids)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    laps.lap("target")
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg).to(dev).train()  # fp32 master weights
    apply_compile_mode(setup, drafter)
    laps.lap("drafter")
    return target, dcfg, setup, drafter, pad_id


def prepare_target(target, cfg: TrainConfig, setup, layer_ids) -> dict:
    """The loaded target as training runs it: trimmed to the tapped layers (unless distillation reads
    its last layer and LM head) and, with ``train.target_fp8``, its decoder linears in FP8."""
    done = {"layers_dropped": 0 if setup.objective.needs_teacher else trim_unused_layers(target, layer_ids)}
    if cfg.target_fp8:
        done["fp8"] = quantize_decoder_linears(target)
    return done


def warm_compile(cfg: TrainConfig, tokenized_dir: str, target_dir: str, device: str, world_size: int,
                 log=print) -> dict:
    """The compile-warm job's work: build exactly what a rank builds and prime every bucket.

    Runs in a fresh process on one GPU slot alone, with the slot's cache dirs
    set, at one rank's batch shape for a run of ``world_size`` ranks; returns
    the compile signature and seconds per bucket for the stamp.
    """
    from dflashpipe.tokenize import load_tokenized

    laps = Laps()
    dev = resolve_device(device)
    laps.lap("device")
    target, dcfg, setup, drafter, pad_id = build(cfg, target_dir, dev, world_size, laps)
    ds = load_tokenized(tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    laps.lap("data")
    log(f"set up in {sum(laps.seconds.values()):.1f} s ({laps})")
    seconds = prime_buckets(drafter, target, ds, buckets, setup, cfg.seed, pad_id, log)
    return {"signature": compile_signature(setup, dcfg.to_dict(), buckets), "bucket_seconds": seconds}


def peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------
# One rank of a run
# ---------------------------------------------------------------------------


def train_rank(cfg: TrainConfig, tokenized_dir: str, target_dir: str, ckpt_dir: str, rank: int, world_size: int,
               init_method: str, device: str, metrics_csv: str, summary_json: str, final_state: str | None = None,
               log=print, hot_start=None, identity: dict | None = None) -> dict:
    """Run rank ``rank`` of a ``world_size``-rank training run; returns the run's summary.

    Rank 0 publishes the outputs (``metrics_csv``, ``summary_json``,
    ``final_state``) once every rank has finished. ``hot_start``: a callable
    ``(signature: dict) -> checker`` (see :mod:`dflashpipe.hotstart`): it
    validates the slot's warm stamp against this rank's compile signature before
    anything compiles, and the checker's ``after_first_step(log)`` proves, after
    every bucket has been primed, that nothing was compiled from scratch and
    forbids compiles from then on. ``identity``: the run identity the launcher keyed
    ``ckpt_dir`` with (computed here if not given).
    """
    check_available(cfg.tensorboard, cfg.wandb)  # a tracker asked for but not installed: one line before anything starts
    laps = Laps()
    t_start = laps.t
    dev = resolve_device(device)
    laps.lap("device")
    init_dist(init_method, rank, world_size, dev, cfg.dist_timeout_s)
    laps.lap("process group")
    try:
        identity = identity or run_identity(cfg, tokenized_dir, target_dir)
        laps.lap("run identity")
        return _train(cfg, tokenized_dir, target_dir, Path(ckpt_dir), identity, rank, world_size, dev, metrics_csv,
                      summary_json, final_state, log, t_start, hot_start, laps)
    finally:
        dist.destroy_process_group()


def _train(cfg, tokenized_dir, target_dir, ckpt_dir, identity, rank, K, dev, metrics_csv, summary_json, final_state, log,
           t_start, hot_start, laps):
    from tqdm import tqdm

    from dflashpipe.tokenize import load_tokenized

    target, dcfg, setup, drafter, pad_id = build(cfg, target_dir, dev, K, laps)

    # -- data ------------------------------------------------------------------
    ds = load_tokenized(tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    train_idx, heldout_idx = heldout_split(list(ds["dataset"]), list(ds["id"]), cfg.heldout_samples)
    steps_per_epoch = len(epoch_batches(buckets, train_idx, cfg.seed, 0, cfg.batch_size))
    if steps_per_epoch == 0:
        raise UserError(
            f"train: {len(train_idx)} training samples (after holding out {len(heldout_idx)}) give no complete "
            f"batch of train.batch_size {cfg.batch_size} samples in any length bucket of {tokenized_dir}; lower "
            f"train.batch_size or train.heldout_samples, or add data"
        )
    total_steps = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps <= 0:
        raise UserError(f"train: epochs={cfg.epochs} and max_steps={cfg.max_steps} leave no step to run")
    check_same_on_all_ranks(samples=len(ds), steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    laps.lap("data")

    # -- resume: the newest intact checkpoint of this run (rank 0 chooses), at any K ----
    state = None
    if rank == 0:
        start_run(ckpt_dir, identity, log)
        state = load_checkpoint(ckpt_dir, identity, log)
    chosen = broadcast_int(state["step"] if state is not None else 0)
    if rank != 0 and chosen:
        state = load_checkpoint(ckpt_dir, identity, log, step=chosen)
    start_step, last = 0, {"loss": None, "acc": None, "heldout_loss": None, "heldout_acc": None,
                           "heldout_sim_tau": None, "accept_by_position": None}
    if state is not None:
        drafter.load_state_dict(state["model"])
        start_step, last = int(state["step"]), dict(state["last"])
    model = data_parallel(drafter, K)  # DDP broadcasts rank 0's weights: identical start everywhere
    opt = adamw(model, cfg.lr, cfg.weight_decay, dev, K)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        _fused_steps_on_device(opt)
        del state
    laps.lap("checkpoint and optimizer")
    log(
        f"train rank {rank}/{K} on {dev}: {len(train_idx)} train / {len(heldout_idx)} held-out samples, "
        f"{steps_per_epoch} steps/epoch, {total_steps} steps of {cfg.batch_size} sequences ({setup.rank_batch} on "
        f"this rank), attention={setup.attention}, dtype={'bf16 autocast' if setup.autocast_dtype else 'fp32'}"
        + (f", resumed from step {start_step}" if start_step else "")
    )
    log(f"set up in {time.time() - t_start:.1f} s ({laps})")
    cache_off = target_cache_off(cfg, K)
    if cache_off and rank == 0:
        log(cache_off)

    # -- hot start: every compile up front, from the slot's warm cache ---------------
    hot = None
    if hot_start is not None:
        checker = hot_start(compile_signature(setup, dcfg.to_dict(), buckets))
        t_prime = time.time()
        prime_buckets(model, target, ds, buckets, setup, cfg.seed, pad_id, log)
        hot = {"prime_seconds": time.time() - t_prime, "counters": checker.after_first_step(log)}

    # -- the loop ------------------------------------------------------------------
    history = MetricsHistory(ckpt_dir, start_step, writer=rank == 0, log=log)
    tracker = Tracker(ckpt_dir, identity, start_step, enabled=rank == 0, tensorboard=cfg.tensorboard, wandb=cfg.wandb,
                      wandb_project=cfg.wandb_project, log=log)  # TensorBoard / W&B
    bar = tqdm(total=total_steps, initial=start_step, desc=f"train rank {rank}/{K}", mininterval=5)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    epoch_cache: dict[int, list[np.ndarray]] = {}
    step_times, step_tokens, first_step_seconds, t_first_done = [], [], None, None
    try:
        for step in range(start_step + 1, total_steps + 1):  # 1-based: "step N" = N optimiser steps done
            failpoint("train.step", step=step, rank=rank)
            t0 = time.time()
            epoch, pos = divmod(step - 1, steps_per_epoch)
            if epoch not in epoch_cache:
                epoch_cache = {epoch: epoch_batches(buckets, train_idx, cfg.seed, epoch, cfg.batch_size)}
            idx = rank_slice(epoch_cache[epoch][pos], rank, K)
            seeds = [sample_seed(cfg.seed, TRAIN_SALT, epoch, step, int(i)) for i in idx]
            batch = make_batch(ds[idx.tolist()], int(buckets[idx[0]]), seeds, pad_id, setup.num_anchors,
                               setup.block_size, dev, index=idx)
            lr = lr_at(step - 1, total_steps, cfg)

            out = train_step(model, target, opt, batch, lr, setup)

            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.time() - t0
            if first_step_seconds is None:
                first_step_seconds, t_first_done = dt, time.time()
                log(f"first step done in {dt:.2f}s (attention={setup.attention})")
                tracker.log_start(step, hot, dt, t_first_done - t_start)
            step_times.append(dt)
            step_tokens.append(out["tokens"])
            last.update(loss=out["loss"], acc=out["acc"])
            row = {"step": step, "epoch": f"{step / steps_per_epoch:.4f}", "loss": f"{out['loss']:.6f}",
                   "acc": f"{out['acc']:.6f}", "lr": f"{lr:.6g}", "grad_norm": f"{out['grad_norm']:.6g}",
                   "tokens_per_s": f"{out['tokens'] / dt:.1f}", "tokens_per_s_per_gpu": f"{out['tokens'] / dt / K:.1f}",
                   "step_seconds": f"{dt:.4f}", "peak_mem_mb": f"{peak_mem_mb(dev):.1f}"}
            held = None
            if step == total_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                held = heldout_figures(drafter, target, ds, heldout_idx, buckets, setup, cfg.seed, pad_id, rank, K)
                hl, ha, st = held["loss"], held["acc"], held["sim_tau"]
                last.update(heldout_loss=hl, heldout_acc=ha, heldout_sim_tau=st,
                            accept_by_position=held["accept_by_position"])
                row.update(heldout_loss=_fmt(hl), heldout_acc=_fmt(ha), heldout_sim_tau=_fmt(st))
                log(f"step {step}: loss {out['loss']:.4f} acc {out['acc']:.4f} held-out loss {hl} acc {ha} "
                    f"simulated tau {st}")
            history.write(row)
            tracker.log_step(row, held and held["acc_by_position"], held and held["accept_by_position"])
            if step % cfg.checkpoint_every == 0 or step == total_steps:
                optimizer_state = full_optimizer_state(opt)  # a collective: every rank takes part
                history.sync()
                tracker.flush()
                if rank == 0:
                    path = save_checkpoint(ckpt_dir, step, drafter.state_dict(), optimizer_state, identity, last)
                    log(f"checkpoint step {step}: {path.name}")
                del optimizer_state
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.3f}", lr=f"{lr:.2e}", refresh=False)
    finally:
        bar.close()
        history.close()
        tracker.close()

    if first_step_seconds is None:  # resumed at the very end (e.g. the export failed): recompute the held-out figures
        held = heldout_figures(drafter, target, ds, heldout_idx, buckets, setup, cfg.seed, pad_id, rank, K)
        last.update(heldout_loss=held["loss"], heldout_acc=held["acc"], heldout_sim_tau=held["sim_tau"],
                    accept_by_position=held["accept_by_position"])

    # -- outputs: published by rank 0 once every rank got here -----------------------
    steady = step_times[1:] or step_times  # the first step includes any compile
    steady_tokens = step_tokens[1:] or step_tokens
    tokens_per_s = (sum(steady_tokens) / sum(steady)) if steady else None
    ranks = gather({
        "rank": rank,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "hot_start": hot,
        "first_step_seconds": first_step_seconds,
        "time_to_first_step_s": (t_first_done - t_start) if t_first_done else None,
        "peak_mem_mb": peak_mem_mb(dev),
        "started_at": t_start,
        "finished_at": time.time(),
    })
    summary = {
        "steps": total_steps,
        "epochs": total_steps / steps_per_epoch,
        "steps_per_epoch": steps_per_epoch,
        "global_batch": cfg.batch_size,
        "rank_batch": setup.rank_batch,
        "train_samples": len(train_idx),
        "heldout_samples": len(heldout_idx),
        "final_loss": last["loss"],
        "final_acc": last["acc"],
        "heldout_loss": last["heldout_loss"],
        "heldout_acc": last["heldout_acc"],
        # expected tau of greedy decoding on the held-out blocks (heldout.py), to set beside the measured one
        "heldout_sim_tau": last.get("heldout_sim_tau"),
        "heldout_accept_by_position": last.get("accept_by_position"),
        "arch": dcfg.arch,
        "loss": cfg.loss,
        "position_weights": cfg.position_weights,
        "tokens_per_s": tokens_per_s,  # context tokens of all ranks per second
        "tokens_per_s_per_gpu": tokens_per_s / K if tokens_per_s else None,
        "total_seconds": time.time() - t_start,
        "world_size": K,
        "attention": setup.attention,
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "resumed_from_step": start_step or None,
        "checkpoint_dir": str(ckpt_dir),
        "ranks": ranks,
    }
    if rank == 0:
        try:
            failpoint("train.export", rank=rank)
            history.publish(metrics_csv)
            if final_state:  # the final weights, for the export rule (drafter/export.py: export_final)
                save_final_state(final_state, drafter, dcfg, total_steps, setup.autocast_dtype)
                log(f"final weights (step {total_steps}) in {final_state}")
            write_json(summary_json, summary)
        except OSError as err:
            raise UserError(
                f"train: cannot write the run's outputs ({err}); fix that and rerun: the run resumes at its final "
                f"checkpoint in {ckpt_dir} and only writes them"
            ) from None
    dist.barrier()  # no rank reports success before the outputs exist
    return summary


def _fmt(x) -> str:
    return "" if x is None else f"{x:.6f}"


def _fused_steps_on_device(opt) -> None:
    """ZeRO's load moves AdamW's 0-dim ``step`` to the CPU; fused AdamW wants it on the parameter's device."""
    if not hasattr(opt, "optim") or not opt.optim.defaults.get("fused"):  # plain AdamW (K = 1) loads it in place
        return
    for p, s in opt.optim.state.items():
        if torch.is_tensor(s.get("step")):
            s["step"] = s["step"].to(p.device)
