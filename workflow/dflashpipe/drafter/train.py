"""Train a DFlash drafter: ONE data-parallel shard of one run, read top to bottom.

A run with K shards is K processes (one Snakemake job, one GPU each) that call
:func:`train_shard` with ranks 0..K-1 and meet through a file rendezvous
(torch.distributed; NCCL on GPU, gloo on CPU; also for K=1, one code path).

Everything a step does is a pure function of (seed, step) and the data, never
of the rank or of hidden RNG state, so K shards take EXACTLY the optimiser step
that one process would take on the union of their batches, and a resumed run
repeats the steps a killed one lost bit for bit:

* data: each epoch a permutation seeded by (seed, epoch) of the training
  samples, grouped into global batches of K*batch_size samples of ONE length
  bucket (batch order shuffled too); rank r takes the r-th contiguous slice.
  The data position is just the step number.
* anchors: per sample, seeded by (seed, epoch, step, index of the sample in
  the dataset), re-sampled every step.
* loss: every rank computes sum(w*CE) and sum(w) over its slice; the weight sum
  is all-reduced and each rank back-propagates sum_local(w*CE) / sum_global(w);
  the gradients are all-reduced (SUM) in one flat buffer. The result is the
  gradient of the weighted mean over the GLOBAL batch (what K=1 computes).
* optimiser: AdamW, fp32 master weights (bf16 autocast on CUDA), linear warm-up
  then cosine, grad clip on the global norm (after the all-reduce).

The target is frozen: it supplies the context features (:mod:`.features`), the
embedding of the block tokens and the LM head.

Checkpoints (rank 0; atomic): ``ckpt_dir/step{N:07d}.pt`` then ``latest.json``
pointing at it; the last two are kept. A restarted run resumes from
``latest.json`` (all ranks), so a killed run loses at most ``checkpoint_every``
steps. A checkpoint written by a different shard count, train config, data or
target is refused with one line naming the file.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import hashlib
import json
import math
import random
import resource
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dflashpipe.atomic import atomic_path, torch_save, write_json
from dflashpipe.errors import UserError

from .export import save_drafter
from .features import context_features, trim_unused_layers, use_compiled_target_layers
from .loss import decayed_ce, use_compiled_ce
from .masks import block_mask, block_position_ids, build_block_inputs, default_gamma, dense_mask, sample_anchors
from .model import (
    DFlashDrafter,
    DrafterConfig,
    use_compiled_flex_attention,
    use_compiled_layers,
    use_eager_layers,
)

# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class TrainConfig:
    num_layers: int = 5  # drafter layers
    block_size: int = 16
    num_anchors: int = 512  # N anchors per sequence, padded with keep=False
    target_layer_ids: list[int] | None = None  # None: default_target_layer_ids(L, num_layers)
    mask_token_id: int | None = None  # None: tokenizer.mask_token_id, else error
    batch_size: int = 4  # sequences per shard per step
    epochs: float = 6.0
    max_steps: int | None = None  # cap (for tests / quick runs)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss_chunk_size: int = 1024
    checkpoint_every: int = 100  # steps
    eval_every: int = 0  # 0: only at the end
    heldout_samples: int = 64  # deterministic held-out split of the tokenized data (by hash of id)
    seed: int = 0
    attention: str = "auto"  # auto: flex on CUDA, sdpa (dense mask) on CPU
    compile: str = "layers"  # flex path (CUDA): layers | flex (flex_attention alone) | none (guard stops it)
    dtype: str = "auto"  # auto: bf16 autocast on CUDA with fp32 master weights; fp32 on CPU
    dist_timeout_s: float = 600.0


    @classmethod
    def from_sections(cls, drafter: dict, train: dict, seed: int = 0) -> "TrainConfig":
        """Build from the config's ``drafter`` and ``train`` sections (pipeline-only keys ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in train.items() if k in known}
        values.update(
            num_layers=drafter["num_layers"],
            block_size=drafter["block_size"],
            target_layer_ids=drafter.get("target_layer_ids"),
            mask_token_id=drafter.get("mask_token_id"),
            seed=seed,
        )
        return cls(**values)


#: Fields that do not change what is computed; a checkpoint may differ in them.
OPERATIONAL_FIELDS = ("checkpoint_every", "eval_every", "dist_timeout_s", "compile")

METRIC_FIELDS = (
    "step", "epoch", "loss", "acc", "lr", "grad_norm", "tokens_per_s",
    "step_seconds", "peak_mem_mb", "heldout_loss", "heldout_acc",
)  # fmt: skip


@dataclass
class Setup:
    """Everything a step needs besides the models: resolved from TrainConfig + target + device."""

    device: torch.device
    attention: str  # "flex" | "sdpa"
    autocast_dtype: torch.dtype | None  # bf16 on CUDA (fp32 master weights), None: plain fp32
    target_dtype: torch.dtype
    block_size: int
    num_anchors: int
    mask_token_id: int
    layer_ids: list[int]
    gamma: float
    loss_chunk_size: int
    grad_clip: float


def resolve_setup(cfg: TrainConfig, device: str, mask_token_id: int, layer_ids: list[int]) -> Setup:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if cuda else "sdpa")
    if attention not in ("flex", "sdpa"):
        raise UserError(f"train.attention: {cfg.attention!r} is not one of auto, flex, sdpa")
    if attention == "flex" and not cuda:
        raise UserError("train.attention: flex has no backward on CPU; use sdpa (or auto) when training on the CPU")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if cuda else "fp32")
    if dtype not in ("bf16", "fp32"):
        raise UserError(f"train.dtype: {cfg.dtype!r} is not one of auto, bf16, fp32")
    bf16 = dtype == "bf16"
    return Setup(
        device=dev,
        attention=attention,
        autocast_dtype=torch.bfloat16 if bf16 else None,
        target_dtype=torch.bfloat16 if bf16 else torch.float32,
        block_size=cfg.block_size,
        num_anchors=cfg.num_anchors,
        mask_token_id=int(mask_token_id),
        layer_ids=list(layer_ids),
        gamma=default_gamma(cfg.block_size),
        loss_chunk_size=cfg.loss_chunk_size,
        grad_clip=cfg.grad_clip,
    )


def setup_attention(setup: Setup, cfg: TrainConfig) -> None:
    """Install how a shard runs its layers on the flex (CUDA) path; SDPA (CPU) runs eager.

    ``layers``: the drafter's layers (flex_attention inside), the target's
    layers and the loss chunks are compiled graphs, one each shared by all
    layers (norms, RoPE, SwiGLU, softmax-CE fused); ``flex``: only
    flex_attention is compiled; ``none``: nothing is. On the flex path any
    dense (uncompiled) flex_attention call is an error, whatever the mode: with
    ``none`` the first attention call stops with one line instead of
    materialising the full score matrix. Shapes are static: one graph per bucket.
    """
    from dflashpipe.hotstart import forbid_dense_flex

    use_eager_layers()
    use_compiled_target_layers(False)
    use_compiled_ce(False)
    if setup.attention != "flex":
        return
    forbid_dense_flex()
    if cfg.compile == "none":
        return
    if cfg.compile == "layers":
        use_compiled_layers(dynamic=False)
        use_compiled_target_layers()
        use_compiled_ce()
    elif cfg.compile == "flex":
        use_compiled_flex_attention(dynamic=False)
    else:
        raise UserError(f"train.compile: {cfg.compile!r} is not one of layers, flex, none")


# ---------------------------------------------------------------------------
# Data: held-out split, epoch order, batches
# ---------------------------------------------------------------------------


def sample_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys (stable across machines and processes)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def heldout_split(datasets_col, ids_col, n_heldout: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices). Whole prompts (dataset, id) go to one side, so
    several samples of one prompt never straddle the split; prompts are taken in
    order of a hash of (dataset, id) until ``n_heldout`` samples are held out."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(zip(datasets_col, ids_col)):
        groups.setdefault(key, []).append(i)
    order = sorted(groups, key=lambda k: hashlib.sha1(f"{k[0]}\0{k[1]}".encode()).hexdigest())
    held: list[int] = []
    for key in order:
        if len(held) >= n_heldout:
            break
        held += groups[key]
    held_set = set(held)
    train = [i for i in range(len(datasets_col)) if i not in held_set]
    return np.asarray(train, dtype=np.int64), np.asarray(sorted(held), dtype=np.int64)


def epoch_batches(buckets: np.ndarray, train_idx: np.ndarray, seed: int, epoch: int, global_batch: int) -> list[np.ndarray]:
    """Global batches (dataset indices, all of one bucket) of one epoch, in training order.

    Incomplete batches are dropped, so every rank has the same number of steps.
    """
    rng = np.random.default_rng(sample_seed(seed, epoch))
    perm = train_idx[rng.permutation(len(train_idx))]
    batches = []
    for b in sorted(set(buckets[train_idx].tolist())):
        members = perm[buckets[perm] == b]
        n = len(members) // global_batch
        batches += [members[i * global_batch : (i + 1) * global_batch] for i in range(n)]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] long, right-padded to the bucket length
    loss_mask: torch.Tensor  # [B, S] bool, False on padding
    anchors: torch.Tensor  # [B, N] long
    keep: torch.Tensor  # [B, N] bool
    num_tokens: int  # real (non-pad) tokens


def make_batch(rows: dict, seq_len: int, seeds: list[int], pad_id: int, setup: Setup, pad_rows_to: int = 0) -> Batch:
    """Collate tokenized rows (dict of columns) into a padded batch with per-sample anchors.

    Sample i's anchors come from its own generator seeded with ``seeds[i]``;
    ``pad_rows_to`` appends empty rows (no loss) for a fixed batch shape.
    """
    n = len(rows["input_ids"])
    B = max(n, pad_rows_to)
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    lm = torch.zeros(B, seq_len, dtype=torch.bool)
    for i in range(n):
        x = rows["input_ids"][i][:seq_len]
        ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        lm[i, : len(x)] = torch.as_tensor(rows["loss_mask"][i][: len(x)], dtype=torch.bool)
    anchors, keep = [], []
    for i in range(B):
        g = torch.Generator().manual_seed(seeds[i] if i < n else 0)
        a, k = sample_anchors(lm[i : i + 1], setup.num_anchors, setup.block_size, g)
        anchors.append(a)
        keep.append(k)
    dev = setup.device
    num_tokens = int(sum(min(len(x), seq_len) for x in rows["input_ids"]))
    return Batch(ids.to(dev), lm.to(dev), torch.cat(anchors).to(dev), torch.cat(keep).to(dev), num_tokens)


# ---------------------------------------------------------------------------
# Distributed helpers
# ---------------------------------------------------------------------------


def checkpoint_dir(run_dir: str, sections: list, tokenized_dir: str, target_dir: str) -> str:
    """``run_dir/checkpoints/<key>``, keyed by what the checkpoints depend on.

    ``sections`` are the config parts that define the run (drafter, train, seed);
    the tokenized data enters through its ``datasets`` fingerprint (state.json),
    the target through :func:`dflashpipe.target.target_fingerprint`. A config,
    data or target change starts a fresh run (the old one stays on disk); a
    killed job finds and resumes its own.
    """
    from dflashpipe.target import target_fingerprint

    state = (Path(tokenized_dir) / "state.json").read_text()
    key = json.dumps([sections, state, target_fingerprint(target_dir)], sort_keys=True, default=str)
    return str(Path(run_dir) / "checkpoints" / hashlib.sha256(key.encode()).hexdigest()[:12])


def rendezvous_url(rdzv_dir: str, run_id: str) -> str:
    """A file rendezvous unique to one run of the workflow (a killed run's file is never reused).

    Files older than a day are removed: they belong to runs that died before cleaning up.
    """
    d = Path(rdzv_dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    for old in d.glob("*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 86400:
                old.unlink()
    return f"file://{d / run_id}"


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
            f"train shard {rank}: only some of the {world_size} shards joined the rendezvous {init_method} "
            f"(timed out after {timeout_s:.0f} s: {detail}); likely causes: --resources gpu (or --cores) is smaller "
            f"than the number of shards, so they cannot all run at once; only this shard is being rerun while its "
            f"peers finished earlier (rerun them all: --forcerun train_shard train_shard0); or a stale rendezvous "
            f"file left by a killed run (delete it and rerun)"
        ) from None


def all_reduce_(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    dist.all_reduce(t, op=op)
    return t


def all_reduce_grads_(params: list[torch.Tensor]) -> None:
    """SUM the gradients of all ranks in place: one collective per tensor, all in flight at once.

    No flat buffer: for a Qwen3-8B-sized drafter that would be one more fp32
    copy of every gradient (~4 GB) at the step's peak. One rank: nothing to do.
    """
    for p in params:
        if p.grad is None:  # every rank steps every parameter, as one process would
            p.grad = torch.zeros_like(p)
    if dist.get_world_size() == 1:
        return
    works = [dist.all_reduce(p.grad, async_op=True) for p in params]
    for w in works:
        w.wait()


def check_same_on_all_ranks(**values: int) -> None:
    """Fail with one line if integer facts (e.g. steps per epoch) differ between ranks."""
    v = torch.tensor([float(x) for x in values.values()] + [-float(x) for x in values.values()], dtype=torch.float64)
    all_reduce_(v, dist.ReduceOp.MAX)
    n = len(values)
    bad = [k for i, k in enumerate(values) if v[i].item() != -v[n + i].item()]
    if bad:
        raise UserError(f"train: shards disagree on {', '.join(bad)}; every shard must read the same tokenized data and config")


# ---------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """LR of 0-based step ``step``: linear warm-up over warmup_ratio*total, then cosine to min_lr_ratio*lr."""
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _no_mark(phase: str) -> None:
    pass


def forward_loss(drafter, target, batch: Batch, setup: Setup, mark=_no_mark):
    """Local (sum w*CE, sum w*correct, sum w) of one batch. Loss sum carries the gradient.

    ``mark(phase)`` is called after the target forward and after the drafter
    forward + loss (the benchmark times phases with it; a no-op otherwise).
    """
    S, bs = batch.input_ids.shape[1], setup.block_size
    with torch.no_grad():
        # Right padding: real tokens never see the pad after them, so no attention mask.
        target_hidden = context_features(target, batch.input_ids, None, setup.layer_ids)
        block_ids, labels, weights = build_block_inputs(
            batch.input_ids, batch.loss_mask, batch.anchors, batch.keep, bs, setup.mask_token_id, setup.gamma
        )
        block_embeds = target.get_input_embeddings()(block_ids)
        position_ids = block_position_ids(batch.anchors, S, bs)
    mark("target_forward")
    if setup.attention == "flex":
        attn = block_mask(batch.anchors, batch.keep, S, bs, device=setup.device)
    else:
        attn = dense_mask(batch.anchors, batch.keep, S, bs)
    autocast = (
        torch.autocast(setup.device.type, dtype=setup.autocast_dtype)
        if setup.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with autocast:
        hidden = drafter(block_embeds, target_hidden, position_ids, attn)
    lm_head = target.get_output_embeddings().weight
    ce_sum, correct = decayed_ce(hidden, lm_head, labels, weights, setup.loss_chunk_size, reduction="sum")
    mark("drafter_forward")
    return ce_sum, correct, weights.sum()


def train_step(drafter, target, opt, batch: Batch, lr: float, setup: Setup, mark=_no_mark) -> dict:
    """One optimiser step of this rank on its slice of the global batch (collectives inside).

    Returns global (all-ranks) loss, acc, weight and the pre-clip global grad norm.
    ``mark(phase)``: see :func:`forward_loss`; also called after the backward
    (+ gradient all-reduce) and after the optimiser.
    """
    params = [p for p in drafter.parameters() if p.requires_grad]
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    ce_sum, correct, w_sum = forward_loss(drafter, target, batch, setup, mark)
    stats = all_reduce_(torch.stack([ce_sum.detach(), correct, w_sum]).float())  # global sums
    w_global = stats[2].clamp(min=1e-6)
    (ce_sum / w_global).backward()  # summed over ranks below: d(global weighted mean)
    all_reduce_grads_(params)
    mark("backward")
    if setup.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, setup.grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    opt.step()
    mark("optimizer")
    loss, acc, gn = (stats[0] / w_global).item(), (stats[1] / w_global).item(), grad_norm.item()
    return {"loss": loss, "acc": acc, "grad_norm": gn, "weight": stats[2].item()}


def prime_buckets(drafter, target, ds, buckets: np.ndarray, cfg: TrainConfig, setup: Setup, pad_id: int,
                  log=print) -> dict:
    """Run every graph a shard will run, once per length bucket, without changing any weight.

    Per bucket: the training forward+backward (flex_attention's backward is
    compiled lazily at the first ``.backward()``) and the held-out forward under
    ``no_grad`` (Dynamo guards on grad mode: a separate graph), both on batches of
    exactly the training shape [batch_size, bucket]. The compile-warm job calls
    this to fill a slot's cache; a shard calls it before its first step so that
    every compile happens up front, from the warm cache, and can be checked.
    Returns seconds per bucket.
    """
    seconds = {}
    # per bucket up to 3 graphs per compiled function (first drafter layer, the others, no-grad
    # eval): lift Dynamo's per-function limit so no bucket ever falls back to eager
    n_buckets = len(set(buckets.tolist()))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * n_buckets + 8)
    for b in sorted(set(buckets.tolist())):
        t0 = time.time()
        idx = np.flatnonzero(buckets == b)[: cfg.batch_size]
        seeds = [sample_seed(cfg.seed, 2, int(i)) for i in idx]  # 2: priming salt
        batch = make_batch(ds[idx.tolist()], int(b), seeds, pad_id, setup, pad_rows_to=cfg.batch_size)
        ce_sum, _, w_sum = forward_loss(drafter, target, batch, setup)
        (ce_sum / w_sum.clamp(min=1e-6)).backward()
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


def compile_signature(cfg: TrainConfig, dcfg: DrafterConfig, setup: Setup, buckets: np.ndarray) -> dict:
    """What decides the compiled code of a shard's step (shapes, dtypes, backend), for the warm stamp."""
    return {
        "drafter": dcfg.to_dict(),
        "batch_size": cfg.batch_size,
        "num_anchors": cfg.num_anchors,
        "loss_chunk_size": cfg.loss_chunk_size,
        "attention": setup.attention,
        "compile": cfg.compile if setup.attention == "flex" else "none",
        "compiled_flex": setup.attention == "flex" and cfg.compile != "none",
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "buckets": sorted(int(b) for b in set(buckets.tolist())),
    }


@torch.no_grad()
def evaluate(drafter, target, ds, heldout_idx: np.ndarray, buckets: np.ndarray, cfg: TrainConfig, setup: Setup,
             pad_id: int, rank: int, world_size: int) -> tuple[float | None, float | None]:
    """Held-out (loss, acc) with the training loss weights and FIXED anchors (comparable across evals).

    Each rank takes every world_size-th held-out sample; sums are all-reduced.
    Batches have the training shape [batch_size, bucket] (padded with empty rows).
    """
    was_training = drafter.training
    drafter.eval()
    sums = torch.zeros(3, dtype=torch.float32, device=setup.device)
    mine = heldout_idx[rank::world_size]
    for b in sorted(set(buckets[mine].tolist())):
        members = mine[buckets[mine] == b]
        for s in range(0, len(members), cfg.batch_size):
            idx = members[s : s + cfg.batch_size]
            seeds = [sample_seed(cfg.seed, 1, int(i)) for i in idx]  # fixed per sample; 1: eval salt
            batch = make_batch(ds[idx.tolist()], int(b), seeds, pad_id, setup, pad_rows_to=cfg.batch_size)
            ce_sum, correct, w_sum = forward_loss(drafter, target, batch, setup)
            sums += torch.stack([ce_sum, correct, w_sum]).float()
    all_reduce_(sums)
    drafter.train(was_training)
    if sums[2].item() <= 0:
        return None, None
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


# ---------------------------------------------------------------------------
# Checkpoints and metrics
# ---------------------------------------------------------------------------


def save_checkpoint(ckpt_dir: Path, step: int, drafter, opt, cfg: TrainConfig, world_size: int, identity: dict,
                    last: dict) -> Path:
    """Rank 0: write step{N:07d}.pt, then point latest.json at it, then keep only the last two."""
    path = ckpt_dir / f"step{step:07d}.pt"
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {
        "format": 1,
        "step": step,  # also the data position: batches are a function of the step
        "model": drafter.state_dict(),
        "optimizer": opt.state_dict(),
        "cfg": asdict(cfg),
        "world_size": world_size,
        "identity": identity,
        "last": last,
        "rng": rng,
    }
    torch_save(state, path)
    write_json(ckpt_dir / "latest.json", {"step": step, "file": path.name, "world_size": world_size})
    for old in sorted(ckpt_dir.glob("step*.pt"))[:-2]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(ckpt_dir: Path, cfg: TrainConfig, world_size: int, identity: dict) -> dict | None:
    """The state latest.json points at, after checking it belongs to this run; None if there is none."""
    latest = ckpt_dir / "latest.json"
    if not latest.is_file():
        return None
    try:
        path = ckpt_dir / json.loads(latest.read_text())["file"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{latest}: unreadable ({err}); delete {ckpt_dir} to start over") from None
    if not path.is_file():
        raise UserError(f"{latest}: points at {path.name}, which does not exist; delete {ckpt_dir} to start over")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a corrupt file is the user's to delete
        raise UserError(f"{path}: cannot load checkpoint ({str(err).splitlines()[0][:120]}); delete {ckpt_dir} to start over") from None
    if state.get("world_size") != world_size:
        raise UserError(
            f"{path}: written by a run with {state.get('world_size')} shards, this run has {world_size}; "
            f"delete {ckpt_dir} to start over"
        )
    now = asdict(cfg)
    diff = [
        f"{k} {state['cfg'].get(k)!r} -> {now[k]!r}"
        for k in now
        if k not in OPERATIONAL_FIELDS and state["cfg"].get(k) != now[k]
    ]
    diff += [f"{k} {state['identity'].get(k)!r} -> {v!r}" for k, v in identity.items() if state["identity"].get(k) != v]
    if diff:
        raise UserError(f"{path}: written with a different train config/data ({'; '.join(diff)}); delete {ckpt_dir} to start over")
    return state


def open_metrics(path: Path, resume_step: int):
    """Rewrite the CSV keeping rows up to ``resume_step`` (the rest is redone), return it open for appending."""
    kept = []
    if resume_step > 0 and path.is_file():
        with open(path, newline="") as f:
            kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")
            w.writeheader()
            w.writerows(kept)
    f = open(path, "a", newline="")
    return f, csv.DictWriter(f, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")


def peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------
# The shard
# ---------------------------------------------------------------------------


def build(cfg: TrainConfig, target_dir: str, dev: torch.device):
    """Target (frozen), drafter (fp32 master weights), optimiser and the resolved step setup."""
    from dflashpipe.target import load_target

    early = resolve_setup(cfg, str(dev), 0, [0])  # validates attention/dtype before the (slow) target load
    target, tokenizer = load_target(target_dir, str(dev), early.target_dtype)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else tokenizer.mask_token_id
    if mask_id is None:
        raise UserError(
            "drafter.mask_token_id: the target tokenizer has no mask token; set it to a token id that exists in the "
            "target embedding (Qwen3: 151669)"
        )
    dcfg = DrafterConfig.from_target_config(
        target.config, cfg.num_layers, cfg.block_size, int(mask_id), cfg.target_layer_ids
    )
    setup = resolve_setup(cfg, str(dev), dcfg.mask_token_id, dcfg.target_layer_ids)
    trim_unused_layers(target, dcfg.target_layer_ids)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    setup_attention(setup, cfg)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg).to(dev).train()  # fp32 master weights
    opt_kw = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(list(drafter.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay, **opt_kw)
    return target, tokenizer, dcfg, setup, drafter, opt, pad_id


def warm_compile(cfg: TrainConfig, tokenized_dir: str, target_dir: str, device: str, log=print) -> dict:
    """The compile-warm job's work: build exactly what a shard builds and prime every bucket.

    Runs in a fresh process on one GPU slot alone, with the slot's cache dirs
    set; returns the compile signature and seconds per bucket for the stamp.
    """
    from dflashpipe.tokenize import load_tokenized

    dev = _resolve_device(device)
    target, tokenizer, dcfg, setup, drafter, opt, pad_id = build(cfg, target_dir, dev)
    ds = load_tokenized(tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    seconds = prime_buckets(drafter, target, ds, buckets, cfg, setup, pad_id, log)
    return {"signature": compile_signature(cfg, dcfg, setup, buckets), "bucket_seconds": seconds}


def _resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda": the visible GPU (one process per GPU)
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def train_shard(cfg: TrainConfig, tokenized_dir: str, target_dir: str, ckpt_dir: str, rank: int, world_size: int,
                init_method: str, device: str, metrics_csv: str, summary_json: str, export_dir: str | None = None,
                log=print, hot_start=None) -> dict:
    """Run rank ``rank`` of a ``world_size``-shard training run; returns the summary dict.

    ``hot_start``: a callable ``(signature: dict) -> checker`` (see
    :mod:`dflashpipe.hotstart`): it validates the slot's warm stamp against this
    shard's compile signature before anything compiles, and the returned
    checker's ``after_first_step(log)`` proves, after every bucket has been
    primed, that nothing was compiled from scratch and forbids compiles from then on.
    """
    dev = _resolve_device(device)
    t_start = time.time()
    init_dist(init_method, rank, world_size, dev, cfg.dist_timeout_s)
    try:
        return _train(cfg, tokenized_dir, target_dir, Path(ckpt_dir), rank, world_size, dev, Path(metrics_csv),
                      summary_json, export_dir, log, t_start, hot_start)
    finally:
        dist.destroy_process_group()


def _train(cfg, tokenized_dir, target_dir, ckpt_dir, rank, K, dev, metrics_csv, summary_json, export_dir, log, t_start,
           hot_start):
    from tqdm import tqdm

    from dflashpipe.target import target_fingerprint
    from dflashpipe.tokenize import load_tokenized

    target, tokenizer, dcfg, setup, drafter, opt, pad_id = build(cfg, target_dir, dev)
    params = [p for p in drafter.parameters()]

    # -- data ------------------------------------------------------------------
    ds = load_tokenized(tokenized_dir)
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    train_idx, heldout_idx = heldout_split(list(ds["dataset"]), list(ds["id"]), cfg.heldout_samples)
    global_batch = K * cfg.batch_size
    steps_per_epoch = len(epoch_batches(buckets, train_idx, cfg.seed, 0, global_batch))
    if steps_per_epoch == 0:
        raise UserError(
            f"train: {len(train_idx)} training samples (after holding out {len(heldout_idx)}) give no complete "
            f"global batch of {K} shards x batch_size {cfg.batch_size} = {global_batch} samples in any length bucket "
            f"of {tokenized_dir}; lower drafter batch_size, shards or heldout_samples, or add data"
        )
    total_steps = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps <= 0:
        raise UserError(f"train: epochs={cfg.epochs} and max_steps={cfg.max_steps} leave no step to run")
    check_same_on_all_ranks(samples=len(ds), steps_per_epoch=steps_per_epoch, total_steps=total_steps)

    # -- resume ----------------------------------------------------------------
    identity = {"samples": len(ds), "data_fingerprint": getattr(ds, "_fingerprint", None),
                "target": target_fingerprint(target_dir), "drafter": dcfg.to_dict()}
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for junk in ckpt_dir.glob(".tmp-*"):  # a killed writer's leftovers
            junk.unlink(missing_ok=True)
    dist.barrier()
    state = load_checkpoint(ckpt_dir, cfg, K, identity)
    start_step, last = 0, {"loss": None, "acc": None, "heldout_loss": None, "heldout_acc": None}
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and dev.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start_step, last = int(state["step"]), dict(state["last"])
        del state
    else:  # identical start everywhere, whatever each process's init did
        for p in params:
            dist.broadcast(p.data, src=0)
    resumed_from = start_step if start_step > 0 else None
    log(
        f"train shard {rank}/{K} on {dev}: {len(train_idx)} train / {len(heldout_idx)} held-out samples, "
        f"{steps_per_epoch} steps/epoch, {total_steps} steps, attention={setup.attention}, "
        f"dtype={'bf16 autocast' if setup.autocast_dtype else 'fp32'}"
        + (f", resumed from step {start_step}" if resumed_from else "")
    )

    # -- hot start: every compile up front, from the slot's warm cache ---------------
    hot = None
    if hot_start is not None:
        checker = hot_start(compile_signature(cfg, dcfg, setup, buckets))
        t_prime = time.time()
        prime_buckets(drafter, target, ds, buckets, cfg, setup, pad_id, log)
        hot = {"prime_seconds": time.time() - t_prime, "counters": checker.after_first_step(log)}

    # -- the loop ------------------------------------------------------------------
    metrics_csv.parent.mkdir(parents=True, exist_ok=True)
    mfile, metrics = open_metrics(metrics_csv, start_step)
    bar = tqdm(total=total_steps, initial=start_step, desc=f"train shard {rank}/{K}", mininterval=5)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    epoch_cache: dict[int, list[np.ndarray]] = {}
    step_times, step_tokens, first_step_seconds, t_first_done = [], [], None, None
    try:
        for step in range(start_step + 1, total_steps + 1):  # 1-based: "step N" = N optimiser steps done
            t0 = time.time()
            epoch, pos = divmod(step - 1, steps_per_epoch)
            if epoch not in epoch_cache:
                epoch_cache = {epoch: epoch_batches(buckets, train_idx, cfg.seed, epoch, global_batch)}
            global_idx = epoch_cache[epoch][pos]
            idx = global_idx[rank * cfg.batch_size : (rank + 1) * cfg.batch_size]  # this rank's slice
            seeds = [sample_seed(cfg.seed, 0, epoch, step, int(i)) for i in idx]  # 0: train salt
            batch = make_batch(ds[idx.tolist()], int(buckets[idx[0]]), seeds, pad_id, setup)
            lr = lr_at(step - 1, total_steps, cfg)

            out = train_step(drafter, target, opt, batch, lr, setup)

            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = time.time() - t0
            if first_step_seconds is None:
                first_step_seconds, t_first_done = dt, time.time()
                log(f"first step done in {dt:.2f}s (attention={setup.attention})")
            step_times.append(dt)
            step_tokens.append(batch.num_tokens)
            last.update(loss=out["loss"], acc=out["acc"])
            row = {"step": step, "epoch": f"{step / steps_per_epoch:.4f}", "loss": f"{out['loss']:.6f}",
                   "acc": f"{out['acc']:.6f}", "lr": f"{lr:.6g}", "grad_norm": f"{out['grad_norm']:.6g}",
                   "tokens_per_s": f"{batch.num_tokens / dt:.1f}", "step_seconds": f"{dt:.4f}",
                   "peak_mem_mb": f"{peak_mem_mb(dev):.1f}"}
            if step == total_steps or (cfg.eval_every and step % cfg.eval_every == 0):
                hl, ha = evaluate(drafter, target, ds, heldout_idx, buckets, cfg, setup, pad_id, rank, K)
                last.update(heldout_loss=hl, heldout_acc=ha)
                row.update(heldout_loss="" if hl is None else f"{hl:.6f}", heldout_acc="" if ha is None else f"{ha:.6f}")
                log(f"step {step}: loss {out['loss']:.4f} acc {out['acc']:.4f} held-out loss {hl} acc {ha}")
            metrics.writerow(row)
            mfile.flush()
            if rank == 0 and (step % cfg.checkpoint_every == 0 or step == total_steps):
                path = save_checkpoint(ckpt_dir, step, drafter, opt, cfg, K, identity, last)
                log(f"checkpoint step {step}: {path.name}")
            bar.update(1)
            bar.set_postfix(loss=f"{out['loss']:.3f}", acc=f"{out['acc']:.3f}", lr=f"{lr:.2e}", refresh=False)
    finally:
        bar.close()
        mfile.close()

    if first_step_seconds is None:  # resumed at the very end: recompute the held-out figures
        hl, ha = evaluate(drafter, target, ds, heldout_idx, buckets, cfg, setup, pad_id, rank, K)
        last.update(heldout_loss=hl, heldout_acc=ha)

    # -- summary and export --------------------------------------------------------
    steady = step_times[1:] or step_times  # the first step includes any compile
    steady_tokens = step_tokens[1:] or step_tokens
    summary = {
        "steps": total_steps,
        "epochs": total_steps / steps_per_epoch,
        "steps_per_epoch": steps_per_epoch,
        "train_samples": len(train_idx),
        "heldout_samples": len(heldout_idx),
        "final_loss": last["loss"],
        "final_acc": last["acc"],
        "heldout_loss": last["heldout_loss"],
        "heldout_acc": last["heldout_acc"],
        "tokens_per_s": (sum(steady_tokens) / sum(steady)) if steady else None,
        "total_seconds": time.time() - t_start,
        "first_step_seconds": first_step_seconds,
        "world_size": K,
        "rank": rank,
        "device": str(dev),
        "attention": setup.attention,
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "resumed_from_step": resumed_from,
        "hot_start": hot,
        "time_to_first_step_s": (t_first_done - t_start) if t_first_done else None,
        "started_at": t_start,
        "finished_at": time.time(),
    }
    dist.barrier()  # outputs appear only once every shard got here: one failed shard fails them all
    write_json(summary_json, summary)
    if export_dir:
        save_drafter(drafter, dcfg, export_dir, target_config=target.config, dtype=setup.autocast_dtype)
        log(f"exported drafter to {export_dir}")
    return summary
