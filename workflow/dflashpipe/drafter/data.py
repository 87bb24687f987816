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
from dataclasses import dataclass

import numpy as np
import torch

from .masks import sample_anchors

#: Salts that keep the anchor streams of training, held-out evaluation and priming apart.
TRAIN_SALT, HELDOUT_SALT, PRIME_SALT = 0, 1, 2


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


def rank_slice(global_idx: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of a global batch (``world_size`` must divide it)."""
    per_rank = len(global_idx) // world_size
    return global_idx[rank * per_rank : (rank + 1) * per_rank]


@dataclass(frozen=True)
class RunData:
    """The tokenized data of a run as its ranks read it: the rows, their length buckets, the held-out split,
    and the step count they give."""

    ds: object  # the tokenized dataset (dflashpipe.inputs.tokenize.load_tokenized)
    buckets: np.ndarray  # per sample: its length bucket
    train_idx: np.ndarray
    heldout_idx: np.ndarray
    pad_id: int
    steps_per_epoch: int
    total_steps: int


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] long, right-padded to the bucket length
    loss_mask: torch.Tensor  # [B, S] bool, False on padding
    anchors: torch.Tensor  # [B, N] long
    keep: torch.Tensor  # [B, N] bool
    num_tokens: int  # real (non-pad) tokens
    index: tuple[int, ...] | None = None  # the rows' dataset indices (None: not known, e.g. padded rows)


def make_batch(rows: dict, seq_len: int, seeds: list[int], pad_id: int, cfg, device: torch.device,
               pad_rows_to: int = 0, index=None) -> Batch:
    """Collate tokenized rows (dict of columns) into a padded batch with per-sample anchors.

    ``cfg``: the run's :class:`~dflashpipe.drafter.train.TrainConfig` (``num_anchors`` per sample, of
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
    anchors, keep = [], []
    for i in range(B):
        g = torch.Generator().manual_seed(seeds[i] if i < n else 0)
        a, k = sample_anchors(lm[i : i + 1], cfg.num_anchors, cfg.block_size, g)
        anchors.append(a)
        keep.append(k)
    num_tokens = int(sum(min(len(x), seq_len) for x in rows["input_ids"]))
    index = tuple(int(i) for i in index) if index is not None and B == n else None
    return Batch(ids.to(device), lm.to(device), torch.cat(anchors).to(device), torch.cat(keep).to(device), num_tokens,
                 index)
