"""Data parallelism with torch's own machinery: process group, DDP, ZeRO-1 AdamW.

A run of K ranks is K processes (one per GPU, on one node or several, see :mod:`.launch`) that
meet in a rendezvous (NCCL on GPU, gloo on CPU; K=1 too, for the step's all-reduces of a few
scalars, but without DDP or ZeRO: the drafter and plain AdamW):

* gradients: :class:`~torch.nn.parallel.DistributedDataParallel`, bucketed
  all-reduces launched as the backward produces each bucket's gradients, so
  the exchange overlaps the backward (``gradient_as_bucket_view``: the
  gradients live in the buckets, no second copy);
* optimiser state: :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`
  (ZeRO-1): each rank keeps the AdamW moments of its own share of the
  parameters (1/K of them), updates that share and broadcasts it. A checkpoint
  holds the consolidated (full) state, so it loads at any K.
"""

from __future__ import annotations

import datetime
import resource

import torch
import torch.distributed as dist

from dflashpipe.jobs.errors import UserError


def init_dist(init_method: str, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """Join the rendezvous, or fail with one line saying why peers are missing.

    On CUDA the default group is "cpu:gloo,cuda:nccl": gloo connects every rank
    eagerly (so a missing peer is a clean timeout here, not an NCCL watchdog
    abort later), NCCL carries all tensors of the run.
    """
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise UserError(
            f"train rank {rank}: only some of the {world_size} ranks joined the rendezvous {init_method} "
            f"(timed out after {timeout_s:.0f} s: {detail}); the ranks of a run are started together by one "
            f"job, so a peer failed to start: see the other ranks' logs"
        ) from None


def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(t, op=op)
    return t


def check_same_on_all_ranks(**values: int) -> None:
    """Fail with one line if integer facts (e.g. steps per epoch) differ between ranks."""
    v = torch.tensor([float(x) for x in values.values()] + [-float(x) for x in values.values()], dtype=torch.float64)
    all_reduce_(v, dist.ReduceOp.MAX)
    n = len(values)
    bad = [k for i, k in enumerate(values) if v[i].item() != -v[n + i].item()]
    if bad:
        raise UserError(f"train: ranks disagree on {', '.join(bad)}; every rank must read the same tokenized data and config")


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (the others pass anything)."""
    t = torch.tensor([value if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def gather(obj) -> list:
    """``obj`` of every rank, in rank order (a small picklable object)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def peak_mem_mb(device: torch.device) -> float:
    """This rank's peak memory so far: on a GPU, its allocated memory; on the CPU, the process's."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def data_parallel_training(drafter: torch.nn.Module, cfg, device: torch.device, world_size: int, state: dict | None):
    """(the drafter in DDP, its optimiser) of a run (``cfg``: its TrainConfig's ``lr`` and
    ``weight_decay``), from the checkpoint ``state`` it resumes (None: a fresh start)."""
    if state is not None:
        drafter.load_state_dict(state["model"])
    model = data_parallel(drafter, world_size)  # DDP broadcasts rank 0's weights: identical start everywhere
    opt = adamw(model, cfg.lr, cfg.weight_decay, device, world_size)
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        _fused_steps_on_device(opt)
    return model, opt


def _fused_steps_on_device(opt) -> None:
    """ZeRO's load moves AdamW's 0-dim ``step`` to the CPU; fused AdamW wants it on the parameter's device."""
    if not hasattr(opt, "optim") or not opt.optim.defaults.get("fused"):  # plain AdamW (K = 1) loads it in place
        return
    for p, s in opt.optim.state.items():
        if torch.is_tensor(s.get("step")):
            s["step"] = s["step"].to(p.device)


def data_parallel(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """The drafter in DDP (K > 1; construction broadcasts rank 0's weights: every rank starts
    identical); at K = 1 the drafter itself: one rank exchanges nothing, and DDP's buckets would
    only cost memory and time."""
    if world_size == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=None,  # single-device module: inputs are already on its device (the drafter has no buffers)
        gradient_as_bucket_view=True,
    )


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device, world_size: int):
    """The run's optimiser: plain AdamW at K = 1 (nothing to shard), else :func:`sharded_adamw`.
    Both save and load the same consolidated state, so a run resumes at any K."""
    if world_size > 1:
        return sharded_adamw(model, lr, weight_decay, device)
    return torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr, **_kernel(device))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (projections, ``fc``), never on RMSNorm weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _kernel(device: torch.device) -> dict:
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def clip_and_step(opt, params: list, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_(params, max_norm)`` then ``opt.step()``; returns the pre-clip global gradient norm.

    A fused AdamW (CUDA, :func:`_kernel`) takes the clip as its ``grad_scale``: each gradient is divided
    by max(1, norm / max_norm) as the kernel reads it, instead of a pass that rescales every fp32 gradient
    in memory first (docs/training-throughput.md). The same update to rounding (x / (1 / c) for x * c);
    ``tests/test_train.py`` compares both. Without ``max_norm`` (0) only the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    local = getattr(opt, "optim", opt)  # ZeRO's local AdamW steps this rank's share
    if max_norm <= 0 or not local.defaults.get("fused"):
        norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm > 0
                else torch.nn.utils.get_total_norm(grads))
        opt.step()
        return norm
    norm = torch.nn.utils.get_total_norm(grads)
    # clip_grad_norm_'s coefficient max_norm / (norm + 1e-6), capped at 1, as the divisor it is the inverse of
    local.grad_scale = 1.0 / torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    try:
        opt.step()
    finally:
        del local.grad_scale
    return norm


def sharded_adamw(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    """AdamW with its state sharded over the ranks (ZeRO-1); fused on CUDA."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class ShardedAdamW(ZeroRedundancyOptimizer):  # torch's, loading a checkpoint without a second copy
        def load_state_dict(self, state_dict: dict) -> None:
            load_optimizer_state(self, state_dict)

    return ShardedAdamW(_param_groups(model, weight_decay), optimizer_class=torch.optim.AdamW, lr=lr, **_kernel(device))


def load_optimizer_state(opt, full_state: dict) -> None:
    """Load a consolidated optimiser state (a checkpoint's) into a ZeRO optimiser: one copy of its share.

    ``ZeroRedundancyOptimizer.load_state_dict`` (torch 2.13) copies this rank's entries onto the
    parameters' device into its local AdamW, then calls the base ``Optimizer.load_state_dict``, which
    casts every entry onto the device AGAIN into the wrapper's own ``state``: a second copy of the
    moments (8 GB for a 1B drafter at K=1) that ZeRO never reads (its step, consolidation and
    ``state_dict`` use the local optimiser's state). So this rank's entries are moved to their
    parameters' device first (both loads then keep that very tensor instead of copying), and the
    wrapper's state is emptied afterwards. The caller's dict is left as it was.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    state = dict(full_state["state"])
    for index, value in state.items():
        param = opt._index_to_param[index]
        if opt._param_to_rank[param] == opt.rank and isinstance(value, dict):
            state[index] = {k: v.to(param.device) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in value.items()}
    ZeroRedundancyOptimizer.load_state_dict(opt, {**full_state, "state": state})
    opt.state.clear()


def full_optimizer_state(opt) -> dict | None:
    """The consolidated optimiser state on rank 0 (None elsewhere); a collective: every rank calls it."""
    if not hasattr(opt, "consolidate_state_dict"):  # K = 1: plain AdamW holds it all
        return opt.state_dict()
    opt.consolidate_state_dict(to=0)
    return opt.state_dict() if dist.get_rank() == 0 else None
