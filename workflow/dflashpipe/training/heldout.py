"""Held-out evaluation of the drafter during training: loss, accuracy and a simulated acceptance length.

The simulated acceptance length (``sim_tau``) answers "what tau would greedy decoding
see on these blocks?" from the training forward alone: per held-out block (the
target's own reply as the labels, fixed anchors), the drafter's proposals for
positions 1..bs-1 (DFlash: the argmax; DFlash 2: the candidate selector's path; DSpark:
every position, its Markov head over the tokens it proposed before; as at inference) are
compared with the labels; the block's accepted length is 1 (the target's bonus token)
plus its leading run of correct proposals, positions without
a label (past the reply's end) passing through uncounted, as SpecForge counts it.
``sim_tau`` is its mean over blocks; per position, ``accept_by_position`` is the
conditional acceptance P(correct at k | accepted up to k), whose running product
summed gives the same figure.
"""

from __future__ import annotations

import numpy as np
import torch

from dflashpipe.training.data import HELDOUT_SALT, RunData, make_batch, sample_seed
from dflashpipe.training.distributed import all_reduce_
from dflashpipe.drafter.masks import build_block_inputs
from dflashpipe.training.step import Setup, forward_loss


@torch.no_grad()
def heldout_figures(drafter, target, data: RunData, setup: Setup, rank: int) -> dict:
    """Held-out ``loss`` and weighted ``acc`` (the training loss weights, FIXED anchors: comparable across
    evaluations), ``acc_by_position`` (top-1
    accuracy of the proposals at block positions 1..bs-1), ``accept_by_position`` and ``sim_tau``
    (module docstring); None where there is nothing to measure.

    Each rank takes every K-th held-out sample (K ranks); sums are all-reduced.
    Batches have one rank's training shape [rank_batch, bucket] (padded with empty
    rows), so no new graph is compiled for them. The proposals reuse the forward's
    output (a hook on the drafter): one more LM-head pass, no more forwards.
    """
    was_training = drafter.training
    drafter.eval()
    cfg, buckets = setup.cfg, data.buckets
    D = cfg.block_size - 1 + setup.label_shift  # proposals per block
    sums = torch.zeros(4 + 4 * D + 2, dtype=torch.float32, device=setup.device)
    seen = {}
    hook = drafter.register_forward_hook(lambda _m, _a, out: seen.__setitem__("hidden", out))
    try:
        mine = data.heldout_idx[rank :: setup.world_size]
        for b in sorted(set(buckets[mine].tolist())):
            members = mine[buckets[mine] == b]
            for s in range(0, len(members), setup.rank_batch):
                idx = members[s : s + setup.rank_batch]
                seeds = [sample_seed(cfg.seed, HELDOUT_SALT, int(i)) for i in idx]  # fixed per sample
                batch = make_batch(data.ds[idx.tolist()], int(b), seeds, data.pad_id, cfg, setup.device,
                                   pad_rows_to=setup.rank_batch, index=idx)
                sums[:4] += torch.stack(forward_loss(drafter, target, batch, setup)).float()
                sums[4:] += acceptance_sums(drafter, seen.pop("hidden"), target, batch, setup)
    finally:
        hook.remove()
    all_reduce_(sums)
    drafter.train(was_training)
    if sums[3].item() <= 0:
        return {"loss": None, "acc": None, "acc_by_position": None, "accept_by_position": None, "sim_tau": None}
    correct, valid, accepted, reached = sums[4 : 4 + 4 * D].view(4, D)
    tau_sum, blocks = sums[-2:]

    def ratio(a, b):
        return [(x / y).item() if y > 0 else None for x, y in zip(a, b)]

    return {"loss": (sums[0] / sums[2]).item(), "acc": (sums[1] / sums[3]).item(),
            "acc_by_position": ratio(correct, valid), "accept_by_position": ratio(accepted, reached),
            "sim_tau": (tau_sum / blocks).item() if blocks > 0 else None}


@torch.no_grad()
def proposals(drafter, hidden: torch.Tensor, block_ids: torch.Tensor, lm_head: torch.Tensor, bs: int,
              chunk_rows: int) -> torch.Tensor:
    """The drafter's proposal for every label of :func:`build_block_inputs` [B, N*bs] (DFlash: position 0,
    the anchor itself, then the proposals; DSpark: bs proposals), as inference makes them
    (:meth:`DFlashDrafter.propose`), over chunks of blocks."""
    B, Q, H = hidden.shape
    blocks = hidden.reshape(-1, bs, H)
    anchors = block_ids.reshape(-1, bs)[:, 0]
    step = max(1, chunk_rows // bs)
    out = torch.cat([drafter.propose(blocks[s : s + step], anchors[s : s + step], lm_head)
                     for s in range(0, blocks.shape[0], step)])
    if out.shape[1] < bs:
        out = torch.cat([anchors[:, None], out], dim=1)
    return out.view(B, Q)


def acceptance_sums(drafter, hidden, target, batch, setup: Setup) -> torch.Tensor:
    """Per-position sums [correct, valid, accepted, reached] x proposals per block, then [sum of block taus, blocks]."""
    bs, first = setup.cfg.block_size, 1 - setup.label_shift  # the first block position that proposes
    block_ids, labels, weights = build_block_inputs(batch.input_ids, batch.loss_mask, batch.anchors, batch.keep, bs,
                                                    setup.mask_token_id, setup.gamma, setup.label_shift)
    pred = proposals(drafter, hidden, block_ids, target.get_output_embeddings().weight, bs, setup.cfg.loss_chunk_size)
    valid = (weights > 0).view(-1, bs)[:, first:]
    correct = (pred == labels).view(-1, bs)[:, first:] & valid
    miss = valid & ~correct
    reached = valid & (torch.cumsum(miss.int(), dim=1) - miss.int() == 0)  # no miss before k
    accepted = reached & correct
    live = valid.any(dim=1)
    taus = (1 + accepted.sum(dim=1)).float()[live]
    per_position = torch.stack([correct.sum(0), valid.sum(0), accepted.sum(0), reached.sum(0)]).float().reshape(-1)
    return torch.cat([per_position, torch.stack([taus.sum(), live.sum().float()])])
