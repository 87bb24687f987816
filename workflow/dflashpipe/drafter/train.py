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
:mod:`.heldout`. Here: the run, building a rank, and the sections around the loop (data, resume,
hot start, outputs).

Optimiser: AdamW, fp32 master weights (bf16 autocast on CUDA), linear warm-up
then cosine, grad clip on the global norm.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflashpipe.jobs.atomic import write_json
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.faults import failpoint
from dflashpipe.jobs.runtime import Laps
from dflashpipe.jobs.settings import schema_settings
from dflashpipe.jobs.tracking import check_available

from .checkpoint import checkpoint_dir, load_checkpoint, run_identity, save_final_state, start_run
from .data import RunData, epoch_batches, heldout_split
from .distributed import adamw, broadcast_int, check_same_on_all_ranks, data_parallel, gather, init_dist
from .features import trim_unused_layers
from .fp8 import check_fp8_device, quantize_decoder_linears
from .loop import Progress, Rank, peak_mem_mb, train_loop
from .model import ARCH_FIELDS, ARCH_KEYS, DFlashDrafter, DrafterConfig
from .step import apply_compile_mode, compile_signature, prime_buckets, resolve_setup, target_cache_off

# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@schema_settings("drafter", "train")
class TrainConfig:
    """The ``drafter`` and ``train`` sections and ``seed``, as one rank takes them: built once by the job
    (:func:`dflashpipe.jobs.settings.settings`), sent to the ranks as JSON. Defaults: the schema's."""

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
    tensorboard: bool  # experiment tracking (dflashpipe.jobs.tracking; operational: not in the run identity)
    wandb: bool
    wandb_project: str


@dataclass(frozen=True)
class TrainRun:
    """One training run, whole: its settings, inputs, outputs, identity and world.

    Built once by the job (``workflow/scripts/train.py``); the launcher adds the identity (computed
    once: every rank keys the same run) and the rendezvous, and sends it to the node launchers and the
    ranks as ONE JSON file (:meth:`to_json`). :func:`~dflashpipe.drafter.launch.run_training`, its rank
    processes and :func:`train_rank` take it whole (a rank adds its rank and device).
    """

    cfg: TrainConfig  # the drafter and train sections and seed: every setting of the run
    # inputs
    tokenized_dir: str
    target_dir: str
    # outputs
    run_dir: str  # the run's checkpoints (checkpoints/<identity key>/: ckpt_dir) and launch files
    metrics_csv: str
    summary_json: str
    final_state: str | None = None  # the final weights (the export rule writes the drafter from them)
    identity: dict | None = None  # what the weights depend on (checkpoint.run_identity); None: not computed yet
    # world: ranks, their threads and logs, where they meet; the same for every rank
    nodes: int = 1
    shards: int = 1  # ranks per node, one GPU each
    threads: int = 1  # CPU threads per rank
    init_method: str = "env://"  # how the ranks meet (torch.distributed; the launcher's agent sets env://)
    cache_root: str | None = None  # the GPU slots' warm compile caches
    stamps: tuple[str, ...] = ()  # slot k's warm stamp (the hot start of local rank k); empty: none
    rank_logs: tuple[str, ...] = ()
    node_logs: tuple[str, ...] = ()  # the node launchers' (several nodes)
    hosts: tuple[str, ...] = ()  # the allocation's nodes (several nodes)
    master: str | None = None  # the first node's address:port, where the agents meet (several nodes)
    run_id: str | None = None  # one launch: a killed launch's files are never reused

    @property
    def world_size(self) -> int:
        return self.nodes * self.shards

    @property
    def ckpt_dir(self) -> Path:
        if self.identity is None:
            raise ValueError("TrainRun.ckpt_dir: the run has no identity yet (TrainRun.identified)")
        return checkpoint_dir(self.run_dir, self.identity)

    def identified(self) -> TrainRun:
        """This run with its identity (computed here, once, if it has none)."""
        if self.identity is not None:
            return self
        return replace(self, identity=run_identity(self.cfg, self.tokenized_dir, self.target_dir))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainRun:
        values = json.loads(text)
        values["cfg"] = TrainConfig(**values["cfg"])
        tuples = {f.name for f in fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in values.items()})


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
    from dflashpipe.inputs.target import load_target, resolve_mask_token

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
    from dflashpipe.inputs.tokenize import load_tokenized

    laps = Laps()
    dev = resolve_device(device)
    laps.lap("device")
    target, dcfg, setup, drafter, pad_id = build(cfg, target_dir, dev, world_size, laps)
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

    Rank 0 publishes the outputs (``run.metrics_csv``, ``run.summary_json``, ``run.final_state``) once
    every rank has finished. ``hot_start``: a callable ``(signature: dict) -> checker`` (see
    :mod:`dflashpipe.jobs.hotstart`): it validates the slot's warm stamp against this rank's compile signature
    before anything compiles, and the checker's ``after_first_step(log)`` proves, after every bucket has
    been primed, that nothing was compiled from scratch and forbids compiles from then on. The run's
    identity is the one the launcher computed (computed here if ``run`` has none).
    """
    check_available(run.cfg.tensorboard, run.cfg.wandb)  # a tracker asked for but not installed: one line first
    laps = Laps()
    t_start = laps.t
    dev = resolve_device(device)
    laps.lap("device")
    init_dist(run.init_method, rank, run.world_size, dev, run.cfg.dist_timeout_s)
    laps.lap("process group")
    try:
        run = run.identified()
        laps.lap("run identity")
        r, start_step, last = _build_rank(run, rank, dev, log, laps)
        _log_start(r, start_step, t_start, laps)
        p = Progress(start_step, last, t_start, hot=_hot_start(r, hot_start) if hot_start is not None else None)
        history = train_loop(r, p)
        return _publish(r, p, history)
    finally:
        dist.destroy_process_group()


def _build_rank(run: TrainRun, rank: int, dev: torch.device, log, laps: Laps) -> tuple[Rank, int, dict]:
    """The rank built: models, data, resumed state and optimiser; with the step it resumes at and its figures."""
    target, dcfg, setup, drafter, pad_id = build(run.cfg, run.target_dir, dev, run.world_size, laps)
    data = load_data(run, pad_id)
    laps.lap("data")
    model, opt, start_step, last = _resume(run, rank, drafter, dev, log)
    laps.lap("checkpoint and optimizer")
    return Rank(run, rank, setup, dcfg, target, drafter, model, opt, data, log), start_step, last


# -- data ------------------------------------------------------------------------


def load_data(run: TrainRun, pad_id: int) -> RunData:
    """The run's tokenized data, its held-out split and the number of steps (the same on every rank)."""
    from dflashpipe.inputs.tokenize import load_tokenized

    cfg = run.cfg
    ds = load_tokenized(run.tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    train_idx, heldout_idx = heldout_split(list(ds["dataset"]), list(ds["id"]), cfg.heldout_samples)
    steps_per_epoch = len(epoch_batches(buckets, train_idx, cfg.seed, 0, cfg.batch_size))
    if steps_per_epoch == 0:
        raise UserError(
            f"train: {len(train_idx)} training samples (after holding out {len(heldout_idx)}) give no complete "
            f"batch of train.batch_size {cfg.batch_size} samples in any length bucket of {run.tokenized_dir}; lower "
            f"train.batch_size or train.heldout_samples, or add data"
        )
    total_steps = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps <= 0:
        raise UserError(f"train: epochs={cfg.epochs} and max_steps={cfg.max_steps} leave no step to run")
    check_same_on_all_ranks(samples=len(ds), steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    return RunData(ds, buckets, train_idx, heldout_idx, pad_id, steps_per_epoch, total_steps)


# -- resume: the newest intact checkpoint of this run (rank 0 chooses), at any K ------


def _resume(run: TrainRun, rank: int, drafter, dev: torch.device, log) -> tuple:
    """(model in DDP, optimiser, start step, latest figures), from the run's newest checkpoint if any."""
    state = None
    if rank == 0:
        start_run(run.ckpt_dir, run.identity, log)
        state = load_checkpoint(run.ckpt_dir, run.identity, log)
    chosen = broadcast_int(state["step"] if state is not None else 0)
    if rank != 0 and chosen:
        state = load_checkpoint(run.ckpt_dir, run.identity, log, step=chosen)
    start_step, last = 0, {"loss": None, "acc": None, "heldout_loss": None, "heldout_acc": None,
                           "heldout_sim_tau": None, "accept_by_position": None}
    if state is not None:
        drafter.load_state_dict(state["model"])
        start_step, last = int(state["step"]), dict(state["last"])
    model = data_parallel(drafter, run.world_size)  # DDP broadcasts rank 0's weights: identical start everywhere
    opt = adamw(model, run.cfg.lr, run.cfg.weight_decay, dev, run.world_size)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        _fused_steps_on_device(opt)
    return model, opt, start_step, last


def _log_start(r: Rank, start_step: int, t_start: float, laps: Laps) -> None:
    cfg, setup, data, world_size = r.run.cfg, r.setup, r.data, r.run.world_size
    r.log(
        f"train rank {r.rank}/{world_size} on {setup.device}: {len(data.train_idx)} train / {len(data.heldout_idx)} held-out "
        f"samples, {data.steps_per_epoch} steps/epoch, {data.total_steps} steps of {cfg.batch_size} sequences "
        f"({setup.rank_batch} on this rank), attention={setup.attention}, "
        f"dtype={'bf16 autocast' if setup.autocast_dtype else 'fp32'}"
        + (f", resumed from step {start_step}" if start_step else "")
    )
    r.log(f"set up in {time.time() - t_start:.1f} s ({laps})")
    cache_off = target_cache_off(cfg, world_size)
    if cache_off and r.rank == 0:
        r.log(cache_off)


# -- hot start: every compile up front, from the slot's warm cache -----------------


def _hot_start(r: Rank, hot_start) -> dict:
    """Validate the slot's warm stamp, prime every bucket, prove nothing compiled from scratch."""
    checker = hot_start(compile_signature(r.setup, r.dcfg.to_dict(), r.data.buckets))
    t_prime = time.time()
    prime_buckets(r.model, r.target, r.data.ds, r.data.buckets, r.setup, r.data.pad_id, r.log)
    return {"prime_seconds": time.time() - t_prime, "counters": checker.after_first_step(r.log)}


# -- outputs: published by rank 0 once every rank got here ----------------------------


def _publish(r: Rank, p: Progress, history) -> dict:
    """The run's summary; rank 0 writes the outputs, and no rank returns before they exist."""
    run = r.run
    summary = _summary(r, p)
    if r.rank == 0:
        try:
            failpoint("train.export", rank=r.rank)
            history.publish(run.metrics_csv)
            if run.final_state:  # the final weights, for the export rule (drafter/export.py: export_final)
                save_final_state(run.final_state, r.drafter, r.dcfg, r.data.total_steps, r.setup.autocast_dtype)
                r.log(f"final weights (step {r.data.total_steps}) in {run.final_state}")
            write_json(run.summary_json, summary)
        except OSError as err:
            raise UserError(
                f"train: cannot write the run's outputs ({err}); fix that and rerun: the run resumes at its final "
                f"checkpoint in {run.ckpt_dir} and only writes them"
            ) from None
    dist.barrier()  # no rank reports success before the outputs exist
    return summary


def _summary(r: Rank, p: Progress) -> dict:
    cfg, setup, data, dev, world_size, last = r.run.cfg, r.setup, r.data, r.setup.device, r.run.world_size, p.last
    steady = p.step_times[1:] or p.step_times  # the first step includes any compile
    steady_tokens = p.step_tokens[1:] or p.step_tokens
    tokens_per_s = (sum(steady_tokens) / sum(steady)) if steady else None
    ranks = gather({
        "rank": r.rank,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "hot_start": p.hot,
        "first_step_seconds": p.first_step_seconds,
        "time_to_first_step_s": (p.t_first_done - p.t_start) if p.t_first_done else None,
        "peak_mem_mb": peak_mem_mb(dev),
        "started_at": p.t_start,
        "finished_at": time.time(),
    })
    return {
        "steps": data.total_steps,
        "epochs": data.total_steps / data.steps_per_epoch,
        "steps_per_epoch": data.steps_per_epoch,
        "global_batch": cfg.batch_size,
        "rank_batch": setup.rank_batch,
        "train_samples": len(data.train_idx),
        "heldout_samples": len(data.heldout_idx),
        "final_loss": last["loss"],
        "final_acc": last["acc"],
        "heldout_loss": last["heldout_loss"],
        "heldout_acc": last["heldout_acc"],
        # expected tau of greedy decoding on the held-out blocks (heldout.py), to set beside the measured one
        "heldout_sim_tau": last.get("heldout_sim_tau"),
        "heldout_accept_by_position": last.get("accept_by_position"),
        "arch": r.dcfg.arch,
        "loss": cfg.loss,
        "position_weights": cfg.position_weights,
        "tokens_per_s": tokens_per_s,  # context tokens of all ranks per second
        "tokens_per_s_per_gpu": tokens_per_s / world_size if tokens_per_s else None,
        "total_seconds": time.time() - p.t_start,
        "world_size": world_size,
        "attention": setup.attention,
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "resumed_from_step": p.start_step or None,
        "checkpoint_dir": str(r.run.ckpt_dir),
        "ranks": ranks,
    }


def _fused_steps_on_device(opt) -> None:
    """ZeRO's load moves AdamW's 0-dim ``step`` to the CPU; fused AdamW wants it on the parameter's device."""
    if not hasattr(opt, "optim") or not opt.optim.defaults.get("fused"):  # plain AdamW (K = 1) loads it in place
        return
    for p, s in opt.optim.state.items():
        if torch.is_tensor(s.get("step")):
            s["step"] = s["step"].to(p.device)
