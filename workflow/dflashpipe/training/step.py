"""One training step of the drafter, and the setup it runs with.

The target is frozen: it supplies the context features (:mod:`.features`), the
embedding of the block tokens and the LM head. Per step, every rank computes
sum(w*CE), sum(w*correct) and sum(w) over its slice of the global batch; the
sums are all-reduced, and each rank back-propagates
``K * sum_local(w*CE) / sum_global(w)``. DistributedDataParallel averages the
gradients over the K ranks (bucketed all-reduces overlapped with the backward),
so every rank holds the gradient of the weighted mean over the GLOBAL batch:
what one process computes on the whole batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from dflashpipe.jobs.errors import UserError

from dflashpipe.training.data import PRIME_SALT, make_batch, sample_seed
from dflashpipe.training.distributed import all_reduce_, clip_and_step
from dflashpipe.drafter.features import TargetCache, compiled_target_layer, context_features
from dflashpipe.drafter.loss import (DSPARK_CONFIDENCE, EAGER_CE, ChunkCE, Objective, RowPlan, block_loss, compiled_chunk_ce,
                                     confidence_loss, selector_loss)
from dflashpipe.drafter.masks import attention_masks, block_position_ids, build_block_inputs, default_gamma, dpace_weights
from dflashpipe.drafter.model import apply_compile_mode, resolve_layer_types  # noqa: F401 - apply_compile_mode: the step's too


@dataclass
class Setup:
    """What a step needs besides the models and the run's plain settings: DERIVED from the config
    (``cfg``, the run's :class:`~dflashpipe.training.train.TrainConfig`, which the step reads its plain
    keys from: ``setup.cfg.grad_clip``), the target, the device and K.

    How the step's hot functions run is part of it: ``target_layer`` and ``chunk_ce``
    (compiled with ``compile: layers`` on the flex path, eager otherwise); the drafter
    carries its own mode (:func:`.model.apply_compile_mode`). Process-wide settings are made there only.
    """

    cfg: object  # the run's TrainConfig: the keys read as they are (block_size, num_anchors, grad_clip, ...)
    device: torch.device
    attention: str  # "flex" | "sdpa"
    compile: str  # "layers" | "flex" | "none" (always "none" on the SDPA path: nothing compiles)
    autocast_dtype: torch.dtype | None  # bf16 on CUDA (fp32 master weights), None: plain fp32
    target_dtype: torch.dtype
    label_shift: int  # DrafterConfig.label_shift: DSpark's slots predict one token further (every slot drafts)
    mask_token_id: int  # the drafter config's (train.build fills it in once the target is loaded)
    layer_ids: list[int]  # the target layers the drafter taps (likewise)
    gamma: float
    rank_batch: int  # sequences per rank per step: train.batch_size / K
    world_size: int  # K: the run's ranks
    objective: Objective = Objective()  # what each block position's loss is (train.loss, DFlash 2's logit transform)
    selector_weight: float = 0.0  # DFlash 2's candidate-selector loss, relative to the token loss (0: other archs)
    windows: dict = field(default_factory=lambda: {"full_attention": None})  # layer type -> sliding window
    target_layer: Callable | None = field(default=None, repr=False)  # None: eager target layers
    target_cache: TargetCache | None = field(default=None, repr=False)  # train.cache_target_features
    chunk_ce: ChunkCE = field(default=EAGER_CE, repr=False)


def resolve_setup(cfg, device: str, mask_token_id: int, layer_ids: list[int], world_size: int = 1) -> Setup:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if cuda else "sdpa")
    if attention == "flex" and not cuda:
        raise UserError("train.attention: flex has no backward on CPU; use sdpa (or auto) when training on the CPU")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if cuda else "fp32")
    bf16 = dtype == "bf16"
    if cfg.batch_size % world_size:
        raise UserError(
            f"train.batch_size ({cfg.batch_size}) is the global batch of a step, split over {world_size} shards; "
            "make it a multiple of train.shards"
        )
    compile_mode = cfg.compile if attention == "flex" else "none"
    layers = compile_mode == "layers"
    dflash2, dspark = cfg.arch == "dflash2", cfg.arch == "dspark"
    if dspark and cfg.position_weights == "dpace":
        raise UserError("train.position_weights: dpace re-weighs rows after their gradients are taken, which the "
                        "Markov head of drafter.arch dspark cannot follow; use decay")
    cache = cfg.cache_target_features and not target_cache_off(cfg, world_size)
    cap = cfg.final_logit_softcapping if dflash2 else None
    objective = Objective(loss=cfg.loss, tv_weight=cfg.tv_weight, multiplier=cfg.output_multiplier if dflash2 else 1.0,
                          cap=float(cap) if cap else None, accept=dspark)
    layer_types = resolve_layer_types(cfg.num_layers, cfg.sliding_window, cfg.layer_types)
    return Setup(
        cfg=cfg,
        device=dev,
        attention=attention,
        compile=compile_mode,
        autocast_dtype=torch.bfloat16 if bf16 else None,
        target_dtype=torch.bfloat16 if bf16 else torch.float32,
        label_shift=int(dspark),
        mask_token_id=int(mask_token_id),
        layer_ids=list(layer_ids),
        gamma=default_gamma(cfg.block_size, int(dspark)),
        rank_batch=cfg.batch_size // world_size,
        world_size=world_size,
        objective=objective,
        selector_weight=cfg.selector_weight if dflash2 else 0.0,
        windows={t: (cfg.sliding_window if t == "sliding_attention" else None) for t in layer_types},
        target_layer=compiled_target_layer() if layers else None,  # torch.compile is lazy: nothing compiles here
        chunk_ce=compiled_chunk_ce() if layers else EAGER_CE,
        target_cache=TargetCache() if cache else None,
    )


def target_cache_off(cfg, world_size: int) -> str | None:
    """Why ``train.cache_target_features`` is off for this run (rank 0's log line), or None."""
    if not cfg.cache_target_features or world_size == 1:
        return None
    return (f"train.cache_target_features: off with {world_size} ranks: a sample goes to another rank in a later "
            "epoch, so a step (it waits for its slowest rank) would skip the target in only 60% of the steps at 2 "
            "ranks and 20% at 4 (simulated on the default run) while every rank cached nearly all samples; it is on "
            "with one rank")


def lr_at(step: int, total_steps: int, cfg) -> float:
    """LR of 0-based step ``step``: linear warm-up over warmup_ratio*total, then cosine to min_lr_ratio*lr."""
    import math

    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _no_mark(phase: str) -> None:
    pass


def _rows_before_labels(anchors: torch.Tensor, S: int, bs: int, shift: int = 0) -> torch.Tensor:
    """[B, N*bs]: for block position k of each block, the position a + k + shift - 1 (the token before the label)."""
    B, N = anchors.shape
    pos = anchors[:, :, None] + torch.arange(bs, device=anchors.device) + shift - 1
    return pos.clamp(0, S - 1).reshape(B, N * bs)


def _row_plan(batch, setup: Setup, S: int, needs_teacher: bool) -> RowPlan:
    """The loss's rows and teacher plan (:class:`~dflashpipe.drafter.loss.RowPlan`) from the batch's host
    tensors, on the batch's device: the weights and teacher rows :func:`forward_loss` builds, found where no
    GPU work is waited for."""
    ids, loss_mask, anchors, keep = getattr(batch, "host", None) or (batch.input_ids, batch.loss_mask, batch.anchors,
                                                                      batch.keep)
    bs = setup.cfg.block_size
    weights = build_block_inputs(ids, loss_mask, anchors, keep, bs, setup.mask_token_id, setup.gamma,
                                 setup.label_shift)[2]
    rows = _rows_before_labels(anchors, S, bs, setup.label_shift)
    plan = RowPlan.of(weights, setup.cfg.loss_chunk_size, rows, S, needs_teacher)
    return plan.to(batch.input_ids.device)


def _dpace_reweight(weights: torch.Tensor, bs: int):
    """``reweight`` for :func:`block_loss`: D-PACE weights of the rows it scores, from their losses."""
    valid = (weights > 0).view(-1, bs)

    def reweight(row_loss, idx):
        grid = torch.zeros(valid.numel(), dtype=torch.float32, device=row_loss.device)
        grid[idx] = row_loss.detach()
        return dpace_weights(grid.view(-1, bs), valid).reshape(-1)[idx]

    return reweight


def _target_outputs(target, batch, setup: Setup, final: bool):
    """The frozen target's (context features, final hidden or None) of a batch; from the setup's
    :class:`TargetCache` when it holds the batch's samples."""

    def compute():
        # Right padding: real tokens never see the pad after them, so no attention mask.
        out = context_features(target, batch.input_ids, None, setup.layer_ids, layer_fn=setup.target_layer, final=final)
        return out if final else (out, None)

    if setup.target_cache is None:
        return compute()
    return setup.target_cache.outputs(batch.index, compute)


def forward_loss(model, target, batch, setup: Setup, mark=_no_mark):
    """Local (sum w*loss, sum w*correct, sum of the loss's weights, sum w) of one batch; the loss sum
    carries the gradient. ``w``: the fixed decay weights (accuracy always uses them; the loss
    too unless ``position_weights`` is dpace).

    ``model`` is the drafter, or the drafter wrapped in DistributedDataParallel.
    ``mark(phase)`` is called after the target forward and after the drafter
    forward + loss (the benchmark times phases with it; a no-op otherwise).
    """
    S, bs = batch.input_ids.shape[1], setup.cfg.block_size
    obj = setup.objective
    drafter = getattr(model, "module", model)
    selector = getattr(drafter, "candidate_selector", None) if setup.selector_weight > 0 else None
    markov = getattr(drafter, "markov_head", None)
    with torch.no_grad():
        rows = _rows_before_labels(batch.anchors, S, bs, setup.label_shift)
        target_hidden, final = _target_outputs(target, batch, setup, obj.needs_teacher)
        teacher = final if obj.needs_teacher else None  # the target's last hidden state: rows index it
        block_ids, labels, weights = build_block_inputs(
            batch.input_ids, batch.loss_mask, batch.anchors, batch.keep, bs, setup.mask_token_id, setup.gamma,
            setup.label_shift
        )
        row_plan = _row_plan(batch, setup, S, obj.needs_teacher)
        previous = batch.input_ids.gather(1, rows)  # the token before each label (position 1: the anchor)
        block_embeds = target.get_input_embeddings()(block_ids)
        position_ids = block_position_ids(batch.anchors, S, bs)
    mark("target_forward")
    attn = attention_masks(batch, setup, S)
    autocast = (
        torch.autocast(setup.device.type, dtype=setup.autocast_dtype)
        if setup.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        hidden = model(block_embeds, target_hidden, position_ids, attn)
    lm_head = target.get_output_embeddings().weight
    reweight = _dpace_reweight(weights, bs) if setup.cfg.position_weights == "dpace" else None
    # what the LM head's chunks give on the way: DFlash 2's candidates, DSpark's acceptance per row
    found = {"top_k": selector.top_k} if selector is not None else ({} if obj.accept else None)
    previous_embeds = markov.markov_w1(previous) if markov is not None else None  # DSpark: teacher-forced
    loss_sum, correct, loss_weight = block_loss(hidden, lm_head, labels, weights, setup.cfg.loss_chunk_size,
                                                reduction="sum", ce=setup.chunk_ce, objective=obj,
                                                teacher_hidden=teacher, teacher_rows=rows, reweight=reweight,
                                                collect=found, row_plan=row_plan,
                                                markov=(previous_embeds, markov.markov_w2.weight) if markov else None)
    if markov is not None:  # the confidence head learns each row's acceptance
        loss_sum = loss_sum + DSPARK_CONFIDENCE * confidence_loss(drafter.confidence_head, hidden, previous_embeds,
                                                                  found["accept"], weights)
    if selector is not None:
        chosen = found.get("teacher_argmax", labels)  # the target's own greedy token, with a teacher
        loss_sum = loss_sum + setup.selector_weight * selector_loss(
            selector, hidden, lm_head, previous, chosen, weights, obj, setup.cfg.loss_chunk_size,
            found=found)
    mark("drafter_forward")
    return loss_sum, correct, loss_weight, weights.sum()


def train_step(model, target, opt, batch, lr: float, setup: Setup, mark=_no_mark) -> dict:
    """One optimiser step of this rank on its slice of the global batch (collectives inside).

    ``model``: the drafter, in DistributedDataParallel when K > 1;
    ``opt``: its optimiser (ZeRO-1 sharded AdamW in the pipeline). Returns the
    global (all-ranks) loss, acc, weight, context tokens and the pre-clip
    global grad norm. ``mark(phase)``: see :func:`forward_loss`; also called
    after the backward (+ the tail of the gradient all-reduce) and after the
    optimiser (+ ZeRO's parameter broadcast).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for group in opt.param_groups:
        group["lr"] = lr
    # DDP (K > 1): zeroed in place, not set to None: after its first step the gradients are views of its
    # all-reduce buckets (gradient_as_bucket_view); fresh gradient tensors would be a second copy.
    # One rank: set to None, so the backward writes each gradient once (no zero fill, no add) and the
    # forward runs without the gradients' memory (a parameter the loss does not reach keeps None: AdamW
    # skips it, as it always did at K = 1)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    opt.zero_grad(set_to_none=not ddp)
    loss_sum, correct, loss_w, acc_w = forward_loss(model, target, batch, setup, mark)
    tokens = torch.full((), float(batch.num_tokens), device=acc_w.device)  # a fill: no copy from the host, no wait
    stats = all_reduce_(torch.stack([loss_sum.detach(), correct, loss_w, acc_w, tokens]).float())  # global sums
    w_global, acc_global = stats[2].clamp(min=1e-6), stats[3].clamp(min=1e-6)
    world_size = torch.distributed.get_world_size()
    (loss_sum * world_size / w_global).backward()  # DDP averages over the K ranks
    mark("backward")
    grad_norm = clip_and_step(opt, params, setup.cfg.grad_clip)
    mark("optimizer")
    loss, acc, gn = (stats[0] / w_global).item(), (stats[1] / acc_global).item(), grad_norm.item()
    return {"loss": loss, "acc": acc, "grad_norm": gn, "weight": stats[3].item(), "tokens": int(stats[4].item())}


def allow_bucket_graphs(buckets: np.ndarray) -> None:
    """Room in Dynamo's per-function graph limit for every length bucket of a run: per bucket up to 3
    graphs per compiled function (the first drafter layer, the others, the no-grad held-out forward).
    Past the limit a function falls back to eager, and eager flex_attention would build the whole score
    matrix (the hot-start guard refuses it). Every run sets it, primed or not."""
    n_buckets = len(set(np.asarray(buckets).tolist()))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * n_buckets + 8)


def prime_buckets(model, target, ds, buckets: np.ndarray, setup: Setup, pad_id: int, log=print) -> dict:
    """Run every graph a shard will run, once per length bucket, without changing any weight.

    Per bucket: the training forward+backward (flex_attention's backward is
    compiled lazily at the first ``.backward()``) and the held-out forward under
    ``no_grad`` (Dynamo guards on grad mode: a separate graph), both on batches of
    exactly one rank's training shape [rank_batch, bucket]. The compile-warm job
    calls this to fill a slot's cache; a shard calls it before its first step
    (through DDP, without gradient exchange) so that every compile happens up
    front, from the warm cache, and can be checked. Returns seconds per bucket.
    """
    seconds = {}
    allow_bucket_graphs(buckets)
    no_sync = model.no_sync if hasattr(model, "no_sync") else contextlib.nullcontext
    drafter = getattr(model, "module", model)
    for b in sorted(set(buckets.tolist())):
        t0 = time.time()
        idx = np.flatnonzero(buckets == b)[: setup.rank_batch]
        seeds = [sample_seed(setup.cfg.seed, PRIME_SALT, int(i)) for i in idx]
        batch = make_batch(ds[idx.tolist()], int(b), seeds, pad_id, setup.cfg, setup.device, pad_rows_to=setup.rank_batch)
        with no_sync():
            loss_sum, _, loss_w, _ = forward_loss(model, target, batch, setup)
            (loss_sum / loss_w.clamp(min=1e-6)).backward()
        drafter.zero_grad(set_to_none=True)
        with torch.no_grad():
            drafter.eval()
            forward_loss(drafter, target, batch, setup)
            drafter.train()
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        seconds[int(b)] = time.time() - t0
        log(f"primed bucket {b}: {seconds[int(b)]:.2f}s")
    return seconds


def compile_signature(setup: Setup, drafter_config: dict, buckets: np.ndarray) -> dict:
    """What decides the compiled code of a shard's step (shapes, dtypes, backend), for the warm stamp."""
    return {
        "drafter": drafter_config,
        "rank_batch": setup.rank_batch,
        "num_anchors": setup.cfg.num_anchors,
        "loss_chunk_size": setup.cfg.loss_chunk_size,
        "attention": setup.attention,
        "compile": setup.compile,
        "activation_memory_budget": setup.cfg.activation_memory_budget if setup.compile != "none" else None,
        "objective": [setup.objective.loss, setup.objective.tv_weight, setup.objective.multiplier, setup.objective.cap],
        "position_weights": setup.cfg.position_weights,
        "selector_weight": setup.selector_weight,
        "compiled_flex": setup.attention == "flex" and setup.compile != "none",
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "buckets": sorted(int(b) for b in set(buckets.tolist())),
    }
