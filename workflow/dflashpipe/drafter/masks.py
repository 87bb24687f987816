"""Anchors, the DFlash attention mask, block inputs, labels and loss weights.

Layout of one training sequence (length S) with N blocks of size bs:

* queries: the N*bs block tokens, block b = [anchor token a_b, MASK x (bs-1)]
* keys:    [context 0..S-1 ; blocks S..S+N*bs-1]
* block position k of block b predicts token a_b + k (k = 1..bs-1 are trained); with a label
  shift of 1 (DSpark) position k predicts a_b + k + 1 (k = 0..bs-1 are trained)

ONE mask function, :func:`dflash_mask_mod`, defines visibility; it is evaluated
on index grids for the dense SDPA mask (:func:`dense_mask`, CPU training) and
inside flex_attention's partial tiles (:func:`block_mask`, GPU training). Which
tiles flex visits, :func:`block_mask` counts from the anchors (each query sees
two intervals of keys); ``tests/test_drafter_masks.py`` holds it equal to
``create_block_mask`` on the same mask function.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

_KNOWN_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int, shift: int = 0) -> float:
    """Decay constant of the loss weights exp(-(k-1)/gamma).

    7 for bs 16, 5 for bs 10, 4 for bs 8 (paper). Other sizes: piecewise-linear
    through those points, (8, 4) - (10, 5) - (16, 7), extended linearly at the
    ends, never below 1 (bs 4 -> 2, bs 12 -> 5.67, bs 32 -> 12.33). By the drafted
    positions: with a label shift (DSpark: bs drafts per block) that of bs + shift
    (DSpark's block 7 -> 4, DeepSpec's recipe).
    """
    bs = int(block_size) + int(shift)
    if bs in _KNOWN_GAMMA:
        return _KNOWN_GAMMA[bs]
    if bs < 10:
        g = 4.0 + (bs - 8) * 0.5
    else:
        g = 5.0 + (bs - 10) / 3.0
    return max(1.0, g)


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N random anchors per sequence among response tokens.

    loss_mask [B, S] bool (True on assistant tokens) -> anchors [B, N] long,
    keep [B, N] bool.

    A position ``a`` is a valid anchor iff ``loss_mask[a]`` (the anchor is a
    response token, as in the public DFlash trainer and as at inference, where
    the anchor is always a token the target already produced) AND
    ``a + 1 < S`` and ``loss_mask[a+1]`` (its block has at least one supervised
    label). The block is NOT required to fit before the end of the sequence:
    labels past the end get weight 0 (:func:`build_block_inputs`).
    ``block_size`` is accepted for symmetry with the other functions; the rule
    above does not need it.

    Sampled without replacement (uniformly), sorted ascending; when fewer than N
    valid positions exist the tail is padded with anchor 0 and keep=False.
    """
    del block_size  # see docstring
    B, S = loss_mask.shape
    N = int(num_anchors)
    device = loss_mask.device
    lm = loss_mask.bool()
    valid = torch.zeros(B, S, dtype=torch.bool, device=device)
    if S >= 2:
        valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    keys = torch.rand(B, S, generator=generator, device=device)
    keys = keys.masked_fill(~valid, 2.0)  # invalid positions sort last
    take = min(N, S)
    picked_keys, picked = keys.topk(take, dim=1, largest=False)  # [B, take]
    picked_ok = picked_keys < 2.0
    # Sort the picked positions, padding (invalid) at the end.
    order_key = torch.where(picked_ok, picked, torch.full_like(picked, S + 1))
    order_key, _ = order_key.sort(dim=1)
    keep = order_key <= S
    anchors = torch.where(keep, order_key, torch.zeros_like(order_key))
    if take < N:
        pad = N - take
        anchors = torch.cat([anchors, anchors.new_zeros(B, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(B, pad)], dim=1)
    return anchors.long(), keep


def dflash_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int, window: int | None = None):
    """The mask_mod(b, h, q_idx, kv_idx) -> bool of DFlash training attention.

    anchors, keep: [B, N]. Keys are [context 0..S-1 ; blocks S..S+N*bs-1].
    Query q_idx is in block bq = q_idx // bs, clamped to N-1 before indexing
    (create_block_mask pads Q_LEN up to a multiple of 128; queries past N*bs see
    nothing). Visible:

    * context key j < S  iff  j < anchors[b, bq]  (STRICT: the target's feature at
      the anchor itself does not exist yet at inference) and keep[b, bq];
    * block key  iff  it is in the same block (bidirectional) and keep[b, bq].

    Padded blocks (keep=False) see nothing. With a sliding ``window`` (a
    sliding-attention layer), a context key must also be within the window of the
    query's position: ``anchors[b, bq] + q_idx % bs - kv_idx < window`` (the
    block itself is always within it: window >= bs).
    """
    N = anchors.shape[1]
    S, bs = int(seq_len), int(block_size)

    def mask_mod(b, h, q_idx, kv_idx):
        bq = torch.clamp(q_idx // bs, max=N - 1)
        live = (q_idx < N * bs) & keep[b, bq]
        is_ctx = kv_idx < S
        anchor = anchors[b, bq]
        ctx_ok = is_ctx & (kv_idx < anchor)
        if window is not None:
            ctx_ok = ctx_ok & (anchor + q_idx % bs - kv_idx < window)
        blk_ok = (~is_ctx) & ((kv_idx - S) // bs == bq)
        return live & (ctx_ok | blk_ok)

    return mask_mod


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int,
               window: int | None = None) -> torch.Tensor:
    """bool [B, 1, N*bs, S+N*bs] (True = visible), by evaluating :func:`dflash_mask_mod` on index grids."""
    B, N = anchors.shape
    Q, K = N * block_size, seq_len + N * block_size
    dev = anchors.device
    mod = dflash_mask_mod(anchors, keep, seq_len, block_size, window)
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.arange(Q, device=dev).view(1, 1, Q, 1)
    kv = torch.arange(K, device=dev).view(1, 1, 1, K)
    return mod(b, h, q, kv).expand(B, 1, Q, K)


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, block_size: int, device=None,
               window: int | None = None, BLOCK_SIZE: int | tuple[int, int] = 128) -> BlockMask:
    """flex_attention ``BlockMask`` for (Q=N*bs, KV=S+N*bs) of :func:`dflash_mask_mod`: the one
    ``create_block_mask(dflash_mask_mod(...), B, None, Q, KV, BLOCK_SIZE=...)`` builds, tile for tile.

    ``create_block_mask`` evaluates the mask on the whole B x Q x KV grid and sums it per tile (at Qwen3-8B's
    training shapes, 92 M entries a step, summed as int64: a dozen launches and ~0.7 GB of temporaries).
    Here each query row's visible keys are two intervals (its context [lo, anchor) and its own block), so a
    tile's count of visible entries is a sum of interval overlaps over B x Q x KV/``BLOCK_SIZE``: a tile is
    full when every entry is visible, partial (``mask_mod`` applied) when some are. Queries past N*bs
    (the padding of Q to a tile) and keys past KV see nothing, as there.
    """
    B, N = anchors.shape
    S, bs = int(seq_len), int(block_size)
    device = anchors.device if device is None else torch.device(device)
    anchors, keep = anchors.to(device), keep.to(device)
    qb, kb = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    Q, KV = N * bs, S + N * bs
    n_q, n_kv = -(-Q // qb), -(-KV // kb)
    q = torch.arange(n_q * qb, device=device)
    bq = torch.clamp(q // bs, max=N - 1)
    live = (q < Q) & keep[:, bq]  # [B, Qpad]
    a = anchors[:, bq].clamp(max=S)
    lo = (a + q % bs - int(window) + 1).clamp(min=0) if window is not None else torch.zeros_like(a)
    own = S + bq * bs  # the query's own block: keys [own, own + bs)
    start = torch.arange(n_kv, device=device) * kb  # [n_kv]: each key tile [start, start + kb)

    def overlap(lo, hi):  # [B, Qpad, n_kv]: keys of [lo, hi) in each tile
        return (torch.minimum(hi[..., None], start + kb) - torch.maximum(lo[..., None], start)).clamp(min=0)

    seen = (overlap(lo, a) + overlap(own.expand_as(a), own.expand_as(a) + bs)) * live[..., None]
    count = seen.view(B, n_q, qb, n_kv).sum(dim=2)[:, None]  # [B, 1, n_q, n_kv]
    full = count == qb * kb
    partial = (count > 0) & ~full

    def ordered(tiles):  # as create_block_mask lists them: how many per query tile, then which (stable order)
        tiles = tiles.to(torch.int32)
        return tiles.sum(dim=-1, dtype=torch.int32), torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=(qb, kb),
                                    mask_mod=dflash_mask_mod(anchors, keep, S, bs, window), seq_lengths=(Q, KV))


def block_position_ids(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, S+N*bs]: arange(S) for the context, then a_b + arange(bs) for each block."""
    B, N = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev).expand(B, seq_len)
    blk = (anchors[:, :, None] + torch.arange(block_size, device=dev)).reshape(B, N * block_size)
    return torch.cat([ctx, blk], dim=1)


def build_block_inputs(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = None,
    shift: int = 0,
):
    """Block tokens, labels and loss weights.

    input_ids [B, S] long, loss_mask [B, S] bool, anchors/keep [B, N] ->
    block_ids [B, N*bs] (anchor token, then MASK x (bs-1)),
    labels [B, N*bs] (block position k -> input_ids[a + k + shift]; where that is past
    the end the label is a placeholder, the clamped last token, with weight 0),
    weights [B, N*bs] float32: w_k = exp(-(k+shift-1)/gamma) for the drafting positions
    (k >= 1 - shift), 0 at k=0 without shift, 0 where the label is past the end or outside
    the loss mask, 0 for padded blocks. ``shift``: the drafter's ``label_shift`` (DSpark: 1).
    """
    B, S = input_ids.shape
    N = anchors.shape[1]
    bs = int(block_size)
    gamma = default_gamma(bs, shift) if gamma is None else float(gamma)
    dev = input_ids.device
    k = torch.arange(bs, device=dev)
    pos = anchors[:, :, None] + k + int(shift)  # [B, N, bs]
    inside = pos < S
    pos_c = pos.clamp(max=S - 1).reshape(B, N * bs)
    labels = input_ids.gather(1, pos_c)
    label_in_mask = loss_mask.bool().gather(1, pos_c).view(B, N, bs)

    block_ids = torch.full((B, N, bs), int(mask_token_id), dtype=input_ids.dtype, device=dev)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    decay = torch.exp(-(k.float() + shift - 1.0) / gamma)
    if not shift:  # the anchor's own position predicts nothing (a where, not decay[0] = 0.0: that waits for the GPU)
        decay = torch.where(k > 0, decay, torch.zeros((), device=dev))
    ok = inside & label_in_mask & keep[:, :, None]
    weights = torch.where(ok, decay.expand(B, N, bs), torch.zeros((), device=dev))
    return block_ids.view(B, N * bs), labels, weights.view(B, N * bs)


#: D-PACE's floor of each position's survival chance (train.position_weights: dpace; the other choice,
#: decay, is the paper's fixed exp(-(k-1)/gamma))
DPACE_ALPHA = 0.5


@torch.no_grad()
def dpace_weights(row_loss: torch.Tensor, valid: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE position weights of blocks, from the drafter's own current losses (no gradient).

    row_loss, valid: [..., bs] per block position (valid: a supervised label; False at
    the anchor). With s_k = (1 - alpha) exp(-loss_k) + alpha (1 where not valid) and
    P_k = prod_{j<=k} s_j (the chance, as the model stands, that the block is still
    accepted at k), w_k = valid_k * sum_{j>=k} valid_j P_j: the accepted length that
    position k still stands to gain. Replaces the fixed exp decay (``train.position_weights``).
    """
    s = torch.where(valid, (1 - alpha) * torch.exp(-row_loss.float()) + alpha, torch.ones_like(row_loss, dtype=torch.float32))
    reach = valid * torch.cumprod(s, dim=-1)
    tail = reach.flip(-1).cumsum(-1).flip(-1)
    return valid * tail


def attention_masks(batch, setup, S: int):
    """The training attention mask(s) of a batch of length ``S``: one per distinct layer type (a dict when layers
    differ); ``setup``: the run's :class:`~dflashpipe.training.step.Setup` (its attention path, windows, device)."""
    build = block_mask if setup.attention == "flex" else dense_mask
    kw = {"device": setup.device} if setup.attention == "flex" else {}
    masks = {t: build(batch.anchors, batch.keep, S, setup.cfg.block_size, window=w, **kw) for t, w in setup.windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks
