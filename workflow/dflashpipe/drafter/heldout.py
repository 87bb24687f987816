"""Held-out evaluation of the drafter during training: loss and accuracy on fixed anchors."""

from __future__ import annotations

import numpy as np
import torch

from .data import HELDOUT_SALT, make_batch, sample_seed
from .distributed import all_reduce_
from .loss import decayed_ce
from .masks import build_block_inputs
from .step import Setup, forward_loss


@torch.no_grad()
def heldout_loss(drafter, target, ds, heldout_idx: np.ndarray, buckets: np.ndarray, setup: Setup, seed: int,
                 pad_id: int, rank: int, world_size: int) -> tuple[float | None, float | None]:
    """Held-out (loss, acc) with the training loss weights and FIXED anchors (comparable across evals)."""
    f = heldout_figures(drafter, target, ds, heldout_idx, buckets, setup, seed, pad_id, rank, world_size)
    return f["loss"], f["acc"]


@torch.no_grad()
def heldout_figures(drafter, target, ds, heldout_idx: np.ndarray, buckets: np.ndarray, setup: Setup, seed: int,
                    pad_id: int, rank: int, world_size: int, by_position: bool = False) -> dict:
    """Held-out ``loss`` and weighted ``acc`` (as :func:`heldout_loss`); with ``by_position`` also
    ``acc_by_position``: top-1 accuracy at block positions 1..block_size-1 (None without one).

    Each rank takes every world_size-th held-out sample; sums are all-reduced
    (``by_position`` must be the same on every rank). Batches have one rank's
    training shape [rank_batch, bucket] (padded with empty rows), so no new
    graph is compiled for them. The per-position figures reuse the forward's
    output (a hook on the drafter) and its labels and weights, one position at
    a time through the LM head: together one more LM-head pass, no more forwards.
    """
    was_training = drafter.training
    drafter.eval()
    bs = setup.block_size
    extra = 2 * (bs - 1) if by_position else 0
    sums = torch.zeros(3 + extra, dtype=torch.float32, device=setup.device)
    seen = {}
    hook = drafter.register_forward_hook(lambda _m, _a, out: seen.__setitem__("hidden", out)) if by_position else None
    try:
        mine = heldout_idx[rank::world_size]
        for b in sorted(set(buckets[mine].tolist())):
            members = mine[buckets[mine] == b]
            for s in range(0, len(members), setup.rank_batch):
                idx = members[s : s + setup.rank_batch]
                seeds = [sample_seed(seed, HELDOUT_SALT, int(i)) for i in idx]  # fixed per sample
                batch = make_batch(ds[idx.tolist()], int(b), seeds, pad_id, setup.num_anchors, setup.block_size,
                                   setup.device, pad_rows_to=setup.rank_batch)
                ce_sum, correct, w_sum = forward_loss(drafter, target, batch, setup)
                sums[:3] += torch.stack([ce_sum, correct, w_sum]).float()
                if by_position:
                    sums[3:] += _position_sums(seen.pop("hidden"), target, batch, setup)
    finally:
        if hook is not None:
            hook.remove()
    all_reduce_(sums)
    drafter.train(was_training)
    if sums[2].item() <= 0:
        return {"loss": None, "acc": None, "acc_by_position": None}
    by_pos = None
    if by_position:
        correct, weight = sums[3:].view(2, bs - 1)
        by_pos = [(c / w).item() if w > 0 else None for c, w in zip(correct, weight)]
    return {"loss": (sums[0] / sums[2]).item(), "acc": (sums[1] / sums[2]).item(), "acc_by_position": by_pos}


def _position_sums(hidden, target, batch, setup: Setup) -> torch.Tensor:
    """[sum w*correct at positions 1..bs-1, then sum w at them] of one held-out batch (the training weights)."""
    bs = setup.block_size
    _, labels, weights = build_block_inputs(batch.input_ids, batch.loss_mask, batch.anchors, batch.keep, bs,
                                            setup.mask_token_id, setup.gamma)
    lm_head = target.get_output_embeddings().weight
    position = torch.arange(weights.shape[1], device=weights.device) % bs
    correct, weight = [], []
    for k in range(1, bs):
        w_k = weights * (position == k)
        correct.append(decayed_ce(hidden, lm_head, labels, w_k, setup.loss_chunk_size, reduction="sum")[1])
        weight.append(w_k.sum())
    return torch.stack([*correct, *weight]).float()
