"""The training loop of one rank, read top to bottom: batch, step, held-out figures, record and checkpoint.

:mod:`.train` builds the rank (:class:`Rank`: the models, the optimiser, the data; resumed from the
run's newest checkpoint) and publishes its outputs; in between, :func:`train_loop` runs the steps
``start_step + 1 .. total_steps``, one call per concern: step N (1-based: N optimiser steps done) takes
this rank's slice of the N-th global batch (:meth:`.data.RunData.batch`), runs one optimiser step
(:func:`.step.train_step`), evaluates on the held-out split every ``train.eval_every`` steps and at the
end (:func:`.heldout.heldout_figures`), and records its metrics row, with a checkpoint every
``train.checkpoint_every`` steps and at the end (:meth:`.checkpoint.MetricsHistory.record`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from dflashpipe.jobs.faults import failpoint

from dflashpipe.training.checkpoint import MetricsHistory
from dflashpipe.training.data import RunData
from dflashpipe.training.distributed import data_parallel_training, peak_mem_mb
from dflashpipe.training.heldout import heldout_figures
from dflashpipe.training.step import Setup, lr_at, train_step

if TYPE_CHECKING:
    from dflashpipe.drafter.model import DrafterConfig
    from dflashpipe.training.run import TrainRun

#: the latest figures (saved with each checkpoint), and where the held-out ones come from (heldout_figures)
FIGURES = ("loss", "acc", "heldout_loss", "heldout_acc", "heldout_sim_tau", "accept_by_position")
HELDOUT = {"heldout_loss": "loss", "heldout_acc": "acc", "heldout_sim_tau": "sim_tau",
           "accept_by_position": "accept_by_position"}
HELDOUT_COLUMNS = ("heldout_loss", "heldout_acc", "heldout_sim_tau")  # the metrics history's held-out columns


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

    @classmethod
    def ready(cls, run: TrainRun, rank: int, built: tuple, data: RunData, state: dict | None, log=print) -> Rank:
        """The rank ready to step: ``built`` (:func:`.train.build`'s target, drafter config, setup and drafter)
        with the drafter in DDP and its optimiser, from the checkpoint ``state`` it resumes (None: a fresh start)."""
        target, dcfg, setup, drafter = built
        model, opt = data_parallel_training(drafter, run.cfg, setup.device, run.world_size, state)
        return cls(run, rank, setup, dcfg, target, drafter, model, opt, data, log)


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
    """The steps of this rank, from ``p.start_step + 1`` to the last; returns the metrics history (closed).

    A run resumed at its very end (its outputs could not be written, or the held-out code changed since:
    :func:`.checkpoint.republish`) runs no step: it evaluates the held-out split again, for the summary."""
    from tqdm import tqdm

    run, cfg, data, setup, dev = r.run, r.run.cfg, r.data, r.setup, r.setup.device
    log = r.log  # a bare log(...): the code digest ignores its message (dflashpipe.jobs.codedeps)
    history = MetricsHistory(r, p.start_step)  # metrics.csv, TensorBoard / W&B, checkpoints
    bar = tqdm(total=data.total_steps, initial=p.start_step, desc=f"train rank {r.rank}/{run.world_size}", mininterval=5)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    try:
        if p.start_step >= data.total_steps:  # resumed at the very end: no step, the held-out figures again
            held = heldout_figures(r.drafter, r.target, data, setup, r.rank)
            p.last.update({k: held[v] for k, v in HELDOUT.items()})
        for step in range(p.start_step + 1, data.total_steps + 1):  # 1-based: "step N" = N optimiser steps done
            failpoint("train.step", step=step, rank=r.rank)
            t0 = time.time()
            batch = data.batch(step, r.rank, setup)
            lr = lr_at(step - 1, data.total_steps, cfg)

            out = train_step(r.model, r.target, r.opt, batch, lr, setup)

            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the step's queued work done
            dt = time.time() - t0
            start = None
            if p.first_step_seconds is None:
                p.first_step_seconds, p.t_first_done = dt, time.time()
                log(f"first step done in {dt:.2f}s (attention={setup.attention})")
                start = {"hot": p.hot, "first_step_seconds": dt, "time_to_first_step": p.t_first_done - p.t_start}
            p.step_times.append(dt)
            p.step_tokens.append(out["tokens"])
            p.last.update(loss=out["loss"], acc=out["acc"])
            tokens_per_s = out["tokens"] / dt
            row = {"step": step, "epoch": f"{step / data.steps_per_epoch:.4f}", "loss": f"{out['loss']:.6f}",
                   "acc": f"{out['acc']:.6f}", "lr": f"{lr:.6g}", "grad_norm": f"{out['grad_norm']:.6g}",
                   "tokens_per_s": f"{tokens_per_s:.1f}",
                   "tokens_per_s_per_gpu": f"{tokens_per_s / run.world_size:.1f}",
                   "step_seconds": f"{dt:.4f}", "peak_mem_mb": f"{peak_mem_mb(dev):.1f}"}
            held = None
            if step == data.total_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                held = heldout_figures(r.drafter, r.target, data, setup, r.rank)
                p.last.update({k: held[v] for k, v in HELDOUT.items()})
                row.update({k: "" if p.last[k] is None else f"{p.last[k]:.6f}" for k in HELDOUT_COLUMNS})
                log(f"step {step}: loss {out['loss']:.4f} acc {out['acc']:.4f} held-out loss {held['loss']} "
                    f"acc {held['acc']} simulated tau {held['sim_tau']}")
            save = step % cfg.checkpoint_every == 0 or step == data.total_steps
            history.record(row, held, start, p.last if save else None)  # the metrics; the checkpoint when due
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.3f}", lr=f"{lr:.2e}", refresh=False)
    finally:
        bar.close()
        history.close()
    return history
