"""The drafter's training data: held-out split, epoch order, batches and anchors.

Every choice here is a pure function of (seed, epoch, step, sample index),
never of the rank, the shard count or hidden RNG state. So the K shards of a
run take exactly the global batch one process would take (same samples, same
order, same anchors), and a resumed run repeats the steps a killed one lost:

* each epoch is a permutation seeded by (seed, epoch) of the training samples,
  grouped into global batches of ``batch_size`` samples of ONE length bucket
  (batch order shuffled too); rank r of K takes the r-th contiguous slice of
  ``batch_size / K`` samples. The data position is just the step number.
* anchors are drawn per sample from a generator seeded by (seed, epoch, step,
  index of the sample in the dataset), re-sampled every step.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from dflashpipe.jobs.errors import UserError

from dflashpipe.training.distributed import check_same_on_all_ranks
from dflashpipe.drafter.masks import sample_anchors

#: Salts that keep the anchor streams of training, held-out evaluation and priming apart.
TRAIN_SALT, HELDOUT_SALT, PRIME_SALT = 0, 1, 2


def sample_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys (stable across machines and processes)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def heldout_size(n_samples: int, cap: int, fraction: float) -> int:
    """Samples to hold out: ``fraction`` of the corpus, at most ``cap``, at least 1
    (``train.heldout_fraction`` and ``train.heldout_samples``)."""
    return max(1, min(cap, math.floor(fraction * n_samples + 1e-9)))


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


def rank_slice(global_idx: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of a global batch (``world_size`` must divide it)."""
    per_rank = len(global_idx) // world_size
    return global_idx[rank * per_rank : (rank + 1) * per_rank]


@dataclass(frozen=True)
class RunData:
    """The tokenized data of a run as its ranks read it: the rows, their length buckets, the held-out split,
    and the step count they give."""

    ds: object  # the tokenized dataset (dflashpipe.inputs.tokenized.load_tokenized)
    buckets: np.ndarray  # per sample: its length bucket
    train_idx: np.ndarray
    heldout_idx: np.ndarray
    pad_id: int
    steps_per_epoch: int
    total_steps: int
    _epoch: dict = field(default_factory=dict, repr=False, compare=False)  # the current epoch's batch order

    def batch(self, step: int, rank: int, setup) -> Batch:
        """Rank ``rank``'s slice of step ``step``'s global batch (1-based), on the setup's device (``setup``:
        the run's :class:`~dflashpipe.training.step.Setup`); anchors seeded by (seed, epoch, step, sample)."""
        cfg = setup.cfg
        epoch, pos = divmod(step - 1, self.steps_per_epoch)
        if epoch not in self._epoch:  # one epoch's order kept: the steps walk the epochs in order
            self._epoch.clear()
            self._epoch[epoch] = epoch_batches(self.buckets, self.train_idx, cfg.seed, epoch, cfg.batch_size)
        idx = rank_slice(self._epoch[epoch][pos], rank, setup.world_size)
        seeds = [sample_seed(cfg.seed, TRAIN_SALT, epoch, step, int(i)) for i in idx]
        return make_batch(self.ds[idx.tolist()], int(self.buckets[idx[0]]), seeds, self.pad_id, cfg, setup.device,
                          index=idx)


def long_enough(ds, cfg, source: str, log=print) -> np.ndarray:
    """The indices of the samples with at least 2 x ``block_size`` loss tokens: a full block to learn from
    (the tokenized data keeps shorter ones for drafters of shorter blocks); a line says how many are left out."""
    need = 2 * cfg.block_size
    usable = np.flatnonzero(np.asarray(ds["num_loss_tokens"], dtype=np.int64) >= need)
    if len(usable) < len(ds):
        log(f"{len(ds) - len(usable)} of {len(ds)} samples have fewer than {need} loss tokens (2 x drafter.block_size "
            f"{cfg.block_size}): not trained on")
    if not len(usable):
        raise UserError(f"train: no sample of {source} has {need} loss tokens (2 x drafter.block_size "
                        f"{cfg.block_size}); lower drafter.block_size, or raise expand.max_new_tokens or the largest "
                        "of tokenize.buckets")
    return usable


def run_data(ds, cfg, pad_id: int, source: str, log=print) -> RunData:
    """A run's tokenized data ``ds`` (:func:`dflashpipe.inputs.tokenized.load_tokenized` of ``source``), its
    held-out split and the number of steps (the same on every rank). ``cfg``: the run's
    :class:`~dflashpipe.training.train.TrainConfig`; ``log`` gets a line when the fraction lowers the cap."""
    buckets = np.asarray(ds["bucket"], dtype=np.int64)
    names = list(ds["dataset"])
    usable = long_enough(ds, cfg, source, log)
    n_heldout = heldout_size(len(usable), cfg.heldout_samples, cfg.heldout_fraction)
    train_pos, heldout_pos = heldout_split([names[i] for i in usable], [ds["id"][i] for i in usable], n_heldout)
    train_idx, heldout_idx = usable[train_pos], usable[heldout_pos]
    if n_heldout < cfg.heldout_samples:
        log(f"held out {len(heldout_idx)} of {len(usable)} samples ({len(heldout_idx) / max(1, len(usable)):.0%}, "
            f"train.heldout_samples {cfg.heldout_samples} capped by train.heldout_fraction {cfg.heldout_fraction}"
            + (", but at least 1)" if n_heldout > cfg.heldout_fraction * len(usable) else ")"))
    if cfg.repeat:  # the mix's weights: a dataset's training samples drawn `repeat` times per epoch
        train_idx = np.repeat(train_idx, [cfg.repeat.get(names[i], 1) for i in train_idx])
    steps_per_epoch = len(epoch_batches(buckets, train_idx, cfg.seed, 0, cfg.batch_size))
    if steps_per_epoch == 0:
        raise UserError(
            f"train: {len(train_idx)} training samples (after holding out {len(heldout_idx)}) give no complete "
            f"batch of train.batch_size {cfg.batch_size} samples in any length bucket of {source}; lower "
            f"train.batch_size or train.heldout_samples, or add data"
        )
    total_steps = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    if total_steps <= 0:
        raise UserError(f"train: epochs={cfg.epochs} and max_steps={cfg.max_steps} leave no step to run")
    check_same_on_all_ranks(samples=len(ds), steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    return RunData(ds, buckets, train_idx, heldout_idx, pad_id, steps_per_epoch, total_steps)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] long, right-padded to the bucket length
    loss_mask: torch.Tensor  # [B, S] bool, False on padding
    anchors: torch.Tensor  # [B, N] long
    keep: torch.Tensor  # [B, N] bool
    num_tokens: int  # real (non-pad) tokens
    index: tuple[int, ...] | None = None  # the rows' dataset indices (None: not known, e.g. padded rows)
    # input_ids, loss_mask, anchors, keep as built, on the host (the same tensors on a CPU): what the loss's
    # row plan is found from without waiting for the GPU (dflashpipe.drafter.loss.RowPlan)
    host: tuple[torch.Tensor, ...] | None = None


def anchor_mask(loss_mask: torch.Tensor, reach: int) -> torch.Tensor:
    """The loss mask [1, S] that :func:`~dflashpipe.drafter.masks.sample_anchors` draws anchors from.

    A sample of several loss segments (one per reply of the target in a multi-turn chat) must not have a
    block whose labels (anchor + 1 .. anchor + ``reach``) run from one reply into the next: the labels
    between them (the user's turn) weigh nothing, those past it would. So the tail of each segment but
    the last is left out where the next segment starts within ``reach`` of the anchor; a block may still
    run past its own reply's end (labels of weight 0), as in a sample of one segment, which is unchanged.
    """
    lm = loss_mask[0]
    starts = torch.nonzero(lm[1:] & ~lm[:-1]).flatten() + 1  # where a segment begins after a gap
    if len(starts) == 0:
        return loss_mask
    out = loss_mask.clone()
    for g in starts.tolist():
        # anchors a >= g - reach are out; sample_anchors takes a iff mask[a] and mask[a + 1], so the mask is
        # cleared from g - reach + 1 to the segment's end (a position of the gap is False already)
        out[0, max(0, g - reach + 1) : g] = False
    return out


def make_batch(rows: dict, seq_len: int, seeds: list[int], pad_id: int, cfg, device: torch.device,
               pad_rows_to: int = 0, index=None) -> Batch:
    """Collate tokenized rows (dict of columns) into a padded batch with per-sample anchors.

    ``cfg``: the run's :class:`~dflashpipe.training.train.TrainConfig` (``num_anchors`` per sample, of
    blocks of ``block_size``). Sample i's anchors come from its own generator seeded with ``seeds[i]``;
    ``pad_rows_to`` appends empty rows (no loss) for a fixed batch shape. ``index``: the rows' dataset
    indices (what :class:`~dflashpipe.drafter.features.TargetCache` keys the target's outputs by).
    """
    n = len(rows["input_ids"])
    B = max(n, pad_rows_to)
    ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    lm = torch.zeros(B, seq_len, dtype=torch.bool)
    for i in range(n):
        x = rows["input_ids"][i][:seq_len]
        ids[i, : len(x)] = torch.as_tensor(x, dtype=torch.long)
        lm[i, : len(x)] = torch.as_tensor(rows["loss_mask"][i][: len(x)], dtype=torch.bool)
    reach = cfg.block_size - 1 + int(getattr(cfg, "arch", None) == "dspark")  # a block's last label: anchor + reach
    anchors, keep = [], []
    for i in range(B):
        g = torch.Generator().manual_seed(seeds[i] if i < n else 0)
        a, k = sample_anchors(anchor_mask(lm[i : i + 1], reach), cfg.num_anchors, cfg.block_size, g)
        anchors.append(a)
        keep.append(k)
    num_tokens = int(sum(min(len(x), seq_len) for x in rows["input_ids"]))
    index = tuple(int(i) for i in index) if index is not None and B == n else None
    host = (ids, lm, torch.cat(anchors), torch.cat(keep))
    return Batch(*(t.to(device) for t in host), num_tokens, index, host)
