"""The training loop of one rank, read top to bottom: batch, step, figures, checkpoint.

:mod:`.train` builds the rank (:class:`Rank`: the models, the optimiser, the data; resumed from the
run's newest checkpoint) and publishes its outputs; in between, :func:`train_loop` runs the steps
``start_step + 1 .. total_steps``. Step N (1-based: N optimiser steps done) takes this rank's slice of
the N-th global batch (:mod:`.data`), runs one optimiser step (:func:`.step.train_step`), writes a
metrics row, evaluates on the held-out split every ``train.eval_every`` steps and at the end
(:mod:`.heldout`), and saves a checkpoint every ``train.checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import functools
import resource
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from dflashpipe.jobs.faults import failpoint
from dflashpipe.jobs.tracking import Tracker

from .checkpoint import MetricsHistory, save_checkpoint
from .data import TRAIN_SALT, RunData, epoch_batches, make_batch, rank_slice, sample_seed
from .distributed import full_optimizer_state
from .heldout import heldout_figures
from .step import Setup, lr_at, train_step

if TYPE_CHECKING:
    from .model import DrafterConfig
    from .train import TrainRun


@dataclass
class Rank:
    """One rank of a run, built (:mod:`.train`): what the loop steps, and where it writes."""

    run: TrainRun
    rank: int
    setup: Setup  # the derived settings and the device; ``setup.cfg``: the run's TrainConfig
    dcfg: DrafterConfig
    target: torch.nn.Module  # frozen
    drafter: torch.nn.Module  # fp32 master weights
    model: torch.nn.Module  # the drafter in DistributedDataParallel
    opt: torch.optim.Optimizer
    data: RunData
    log: Callable = print


@dataclass
class Progress:
    """What the loop keeps: where it started, the latest figures (saved with each checkpoint), its steps' times."""

    start_step: int
    last: dict  # loss, acc and the held-out figures of the latest step
    t_start: float  # when the rank started (time.time())
    hot: dict | None = None  # the hot start's priming seconds and cache counters
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    first_step_seconds: float | None = None
    t_first_done: float | None = None


def train_loop(r: Rank, p: Progress) -> MetricsHistory:
    """The steps of this rank, from ``p.start_step + 1`` to the last; returns the metrics history (closed)."""
    from tqdm import tqdm

    run, cfg, data, setup = r.run, r.run.cfg, r.data, r.setup
    history = MetricsHistory(run.ckpt_dir, p.start_step, writer=r.rank == 0, log=r.log)
    tracker = Tracker(run.ckpt_dir, run.identity, p.start_step, enabled=r.rank == 0, tensorboard=cfg.tensorboard,
                      wandb=cfg.wandb, wandb_project=cfg.wandb_project, log=r.log)  # TensorBoard / W&B
    bar = tqdm(total=data.total_steps, initial=p.start_step, desc=f"train rank {r.rank}/{run.world_size}", mininterval=5)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    epoch_order = functools.lru_cache(maxsize=1)(
        lambda epoch: epoch_batches(data.buckets, data.train_idx, cfg.seed, epoch, cfg.batch_size))
    try:
        for step in range(p.start_step + 1, data.total_steps + 1):  # 1-based: "step N" = N optimiser steps done
            failpoint("train.step", step=step, rank=r.rank)
            t0 = time.time()
            batch = step_batch(r, step, epoch_order)
            lr = lr_at(step - 1, data.total_steps, cfg)

            out = train_step(r.model, r.target, r.opt, batch, lr, setup)

            dt = seconds_since(t0, setup.device)
            if p.first_step_seconds is None:
                p.first_step_seconds, p.t_first_done = dt, time.time()
                r.log(f"first step done in {dt:.2f}s (attention={setup.attention})")
                tracker.log_start(step, p.hot, dt, p.t_first_done - p.t_start)
            p.step_times.append(dt)
            p.step_tokens.append(out["tokens"])
            p.last.update(loss=out["loss"], acc=out["acc"])
            row = metrics_row(r, step, out, lr, dt)
            held = None
            if step == data.total_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                held = heldout_figures(r.drafter, r.target, data, setup, r.rank)
                record_heldout(p.last, held, row)
                r.log(f"step {step}: loss {out['loss']:.4f} acc {out['acc']:.4f} held-out loss {held['loss']} "
                      f"acc {held['acc']} simulated tau {held['sim_tau']}")
            history.write(row)
            tracker.log_step(row, held and held["acc_by_position"], held and held["accept_by_position"])
            if step % cfg.checkpoint_every == 0 or step == data.total_steps:
                checkpoint(r, p, step, history, tracker)
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.3f}", lr=f"{lr:.2e}", refresh=False)
    finally:
        bar.close()
        history.close()
        tracker.close()

    if p.first_step_seconds is None:  # resumed at the very end (e.g. the export failed): recompute the held-out figures
        record_heldout(p.last, heldout_figures(r.drafter, r.target, data, setup, r.rank))
    return history


def step_batch(r: Rank, step: int, epoch_order: Callable):
    """This rank's slice of step ``step``'s global batch; anchors seeded by (seed, epoch, step, sample)."""
    cfg, data = r.run.cfg, r.data
    epoch, pos = divmod(step - 1, data.steps_per_epoch)
    idx = rank_slice(epoch_order(epoch)[pos], r.rank, r.run.world_size)
    seeds = [sample_seed(cfg.seed, TRAIN_SALT, epoch, step, int(i)) for i in idx]
    return make_batch(data.ds[idx.tolist()], int(data.buckets[idx[0]]), seeds, data.pad_id, cfg, r.setup.device,
                      index=idx)


def seconds_since(t0: float, device: torch.device) -> float:
    """Seconds since ``t0``, once the device has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() - t0


def metrics_row(r: Rank, step: int, out: dict, lr: float, dt: float) -> dict:
    """The metrics history's row of a step (the held-out columns are added where it evaluates)."""
    world_size = r.run.world_size
    return {"step": step, "epoch": f"{step / r.data.steps_per_epoch:.4f}", "loss": f"{out['loss']:.6f}",
            "acc": f"{out['acc']:.6f}", "lr": f"{lr:.6g}", "grad_norm": f"{out['grad_norm']:.6g}",
            "tokens_per_s": f"{out['tokens'] / dt:.1f}", "tokens_per_s_per_gpu": f"{out['tokens'] / dt / world_size:.1f}",
            "step_seconds": f"{dt:.4f}", "peak_mem_mb": f"{peak_mem_mb(r.setup.device):.1f}"}


def record_heldout(last: dict, held: dict, row: dict | None = None) -> None:
    """The held-out figures into the latest figures (and the step's metrics row)."""
    last.update(heldout_loss=held["loss"], heldout_acc=held["acc"], heldout_sim_tau=held["sim_tau"],
                accept_by_position=held["accept_by_position"])
    if row is not None:
        row.update(heldout_loss=_fmt(held["loss"]), heldout_acc=_fmt(held["acc"]), heldout_sim_tau=_fmt(held["sim_tau"]))


def checkpoint(r: Rank, p: Progress, step: int, history: MetricsHistory, tracker: Tracker) -> None:
    """Every rank gathers the optimiser state; rank 0 saves it with the weights and the latest figures."""
    optimizer_state = full_optimizer_state(r.opt)  # a collective: every rank takes part
    history.sync()
    tracker.flush()
    if r.rank == 0:
        path = save_checkpoint(r.run.ckpt_dir, step, r.drafter.state_dict(), optimizer_state, r.run.identity, p.last)
        r.log(f"checkpoint step {step}: {path.name}")


def peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _fmt(x) -> str:
    return "" if x is None else f"{x:.6f}"
