"""Held-out evaluation of the drafter during training: loss and accuracy on fixed anchors."""

from __future__ import annotations

import numpy as np
import torch

from .data import HELDOUT_SALT, make_batch, sample_seed
from .distributed import all_reduce_
from .step import Setup, forward_loss


@torch.no_grad()
def heldout_loss(drafter, target, ds, heldout_idx: np.ndarray, buckets: np.ndarray, setup: Setup, seed: int,
                 pad_id: int, rank: int, world_size: int) -> tuple[float | None, float | None]:
    """Held-out (loss, acc) with the training loss weights and FIXED anchors (comparable across evals).

    Each rank takes every world_size-th held-out sample; sums are all-reduced.
    Batches have one rank's training shape [rank_batch, bucket] (padded with
    empty rows), so no new graph is compiled for them.
    """
    was_training = drafter.training
    drafter.eval()
    sums = torch.zeros(3, dtype=torch.float32, device=setup.device)
    mine = heldout_idx[rank::world_size]
    for b in sorted(set(buckets[mine].tolist())):
        members = mine[buckets[mine] == b]
        for s in range(0, len(members), setup.rank_batch):
            idx = members[s : s + setup.rank_batch]
            seeds = [sample_seed(seed, HELDOUT_SALT, int(i)) for i in idx]  # fixed per sample
            batch = make_batch(ds[idx.tolist()], int(b), seeds, pad_id, setup.num_anchors, setup.block_size,
                               setup.device, pad_rows_to=setup.rank_batch)
            ce_sum, correct, w_sum = forward_loss(drafter, target, batch, setup)
            sums += torch.stack([ce_sum, correct, w_sum]).float()
    all_reduce_(sums)
    drafter.train(was_training)
    if sums[2].item() <= 0:
        return None, None
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
