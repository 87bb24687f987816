"""Anchors, the DFlash mask (dense and BlockMask from one mask_mod), labels and weights."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from dflashpipe.drafter.masks import (
    block_mask,
    block_position_ids,
    build_block_inputs,
    default_gamma,
    dense_mask,
    dflash_mask_mod,
    sample_anchors,
)

torch.set_num_threads(1)


def test_default_gamma():
    assert default_gamma(16) == 7
    assert default_gamma(10) == 5
    assert default_gamma(8) == 4
    assert default_gamma(4) == 2
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)
    assert default_gamma(2) >= 1
    assert default_gamma(7, shift=1) == 4  # DSpark: 7 drafted positions, as DFlash's block 8 (DeepSpec: 4)


def test_sample_anchors_valid_sorted_padded():
    S = 40
    lm = torch.zeros(3, S, dtype=torch.bool)
    lm[0, 10:30] = True  # 19 valid anchors: 10..28 (a and a+1 in mask)
    lm[1, 35:] = True  # valid: 35..38 (a+1 < S) -> 4 anchors
    lm[2, 5] = True  # a single response token: no anchor has a supervised next token
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(lm, 6, 4, g)
    assert anchors.shape == keep.shape == (3, 6) and anchors.dtype == torch.long
    # row 0: 6 distinct valid anchors, sorted
    assert keep[0].all()
    a0 = anchors[0].tolist()
    assert a0 == sorted(a0) and len(set(a0)) == 6
    assert all(10 <= a <= 28 for a in a0)
    # row 1: all 4 valid anchors, then padding (anchor 0, keep False)
    assert anchors[1].tolist() == [35, 36, 37, 38, 0, 0]
    assert keep[1].tolist() == [True] * 4 + [False] * 2
    # row 2: nothing valid
    assert not keep[2].any() and (anchors[2] == 0).all()
    # every kept anchor: response token with a response token after it
    for b in range(3):
        for a, k in zip(anchors[b].tolist(), keep[b].tolist()):
            if k:
                assert lm[b, a] and a + 1 < S and lm[b, a + 1]
    # reproducible with a seeded generator; resampled otherwise
    again, _ = sample_anchors(lm, 6, 4, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    # N larger than S still gives exactly N
    a, k = sample_anchors(lm[:, :5], 8, 4, g)
    assert a.shape == (3, 8) and not k.any()


def test_sample_anchors_uniform_coverage():
    lm = torch.ones(1, 12, dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    seen = torch.zeros(12)
    for _ in range(200):
        a, k = sample_anchors(lm, 3, 4, g)
        assert k.all() and len(set(a[0].tolist())) == 3
        seen[a[0]] += 1
    assert seen[11] == 0  # a+1 < S
    assert (seen[:11] > 20).all()


def _setup():
    S, bs = 20, 4
    anchors = torch.tensor([[3, 7, 18, 0], [0, 5, 12, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, False]])
    return S, bs, anchors, keep


def test_dense_mask_semantics():
    S, bs, anchors, keep = _setup()
    B, N = anchors.shape
    m = dense_mask(anchors, keep, S, bs)
    assert m.shape == (B, 1, N * bs, S + N * bs) and m.dtype == torch.bool
    for b in range(B):
        for q in range(N * bs):
            blk = q // bs
            row = m[b, 0, q]
            if not keep[b, blk]:
                assert not row.any(), "padded blocks see nothing"
                continue
            a = anchors[b, blk].item()
            # strict context: exactly j < a
            assert row[:S].nonzero().flatten().tolist() == list(range(a))
            assert not row[a], "a block never sees its anchor's own context position"
            # bidirectional inside its own block, blind to others
            vis_blocks = row[S:].view(N, bs)
            assert vis_blocks[blk].all()
            assert not vis_blocks[torch.arange(N) != blk].any()


def test_mask_mod_clamps_padded_queries():
    S, bs, anchors, keep = _setup()
    N = anchors.shape[1]
    mod = dflash_mask_mod(anchors, keep, S, bs)
    q = torch.arange(128).view(1, 1, 128, 1)  # create_block_mask pads Q_LEN to 128
    kv = torch.arange(S + N * bs).view(1, 1, 1, -1)
    out = mod(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long), q, kv)
    assert out.shape == (1, 1, 128, S + N * bs)
    assert not out[0, 0, N * bs :].any(), "queries past N*bs see nothing"
    # and the BlockMask builds (it evaluates the mod on the padded grid)
    bm = block_mask(anchors, keep, S, bs, device="cpu")
    assert bm.shape[-2:] == (N * bs, S + N * bs)


def test_block_mask_agrees_with_dense():
    S, bs, anchors, keep = _setup()
    bm = block_mask(anchors, keep, S, bs, device="cpu", BLOCK_SIZE=4)
    dense = dense_mask(anchors, keep, S, bs)
    # a 4x4 tile is non-empty in the BlockMask iff some entry of the dense mask is visible
    tiles = bm.to_dense()[:, 0]  # [B, Q/4, KV/4]
    B, _, Q, K = dense.shape
    dense_tiles = dense[:, 0].view(B, Q // 4, 4, K // 4, 4).any(dim=(2, 4))
    assert torch.equal(tiles.bool(), dense_tiles)


# (B, S, N, bs, window, BLOCK_SIZE, valid rows): tiles of 128 (the default) and small ones; S and N*bs that are
# and are not multiples of a tile; full and sliding windows; padded blocks (keep False) and empty rows
_TILE_CASES = [
    (2, 1024, 128, 8, None, 128, [(0, 1024), (300, 360)]),
    (1, 3072, 512, 16, None, 128, [(100, 3072)]),
    (3, 200, 12, 8, 37, 16, [(0, 200), (150, 200), (0, 0)]),
    (2, 77, 9, 5, 9, (8, 16), [(0, 77), (20, 26)]),
    (2, 64, 6, 4, None, 4, [(0, 64), (60, 64)]),
]


@pytest.mark.parametrize("B,S,N,bs,window,tile,spans", _TILE_CASES)
def test_block_mask_is_create_block_mask_tile_for_tile(B, S, N, bs, window, tile, spans):
    """The tiles counted from the anchors are the ones create_block_mask finds on the whole grid: the same
    partial and full tiles, in the same order, both ways round (the backward reads the q-major lists)."""
    lm = torch.zeros(B, S, dtype=torch.bool)
    for i, (lo, hi) in enumerate(spans):
        lm[i, lo:hi] = True
    anchors, keep = sample_anchors(lm, N, bs, torch.Generator().manual_seed(B * S + N))
    assert (~keep).any() == (B > 1)  # padded blocks (a short row) in every case but the long one
    ours = block_mask(anchors, keep, S, bs, device="cpu", window=window, BLOCK_SIZE=tile)
    ref = create_block_mask(dflash_mask_mod(anchors, keep, S, bs, window), B, None, N * bs, S + N * bs, device="cpu",
                            BLOCK_SIZE=tile)
    assert ours.BLOCK_SIZE == ref.BLOCK_SIZE and ours.seq_lengths == ref.seq_lengths
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        mine, theirs = getattr(ours, name), getattr(ref, name)
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    assert ours.kv_num_blocks.sum() > 0 and (window is not None or ours.full_kv_num_blocks.sum() > 0)  # both kinds
    assert torch.equal(ours.to_dense(), ref.to_dense())


def test_block_position_ids():
    S, bs, anchors, keep = _setup()
    pos = block_position_ids(anchors, S, bs)
    assert pos.shape == (2, S + 4 * bs)
    assert pos[0, :S].tolist() == list(range(S))
    assert pos[0, S:].view(4, bs).tolist() == [[3, 4, 5, 6], [7, 8, 9, 10], [18, 19, 20, 21], [0, 1, 2, 3]]


def test_build_block_inputs_labels_and_weights():
    S, bs, mask_id = 20, 4, 99
    ids = torch.arange(100, 100 + S).view(1, S)
    lm = torch.zeros(1, S, dtype=torch.bool)
    lm[0, 2:9] = True
    lm[0, 12:] = True
    anchors = torch.tensor([[3, 7, 18, 0]])
    keep = torch.tensor([[True, True, True, False]])
    block_ids, labels, w = build_block_inputs(ids, lm, anchors, keep, bs, mask_id)
    gamma = default_gamma(bs)
    assert block_ids.view(4, bs).tolist() == [
        [103, 99, 99, 99],
        [107, 99, 99, 99],
        [118, 99, 99, 99],
        [100, 99, 99, 99],
    ]
    lab = labels.view(4, bs)
    w = w.view(4, bs)
    # block position k -> token anchor + k
    for n, a in enumerate([3, 7, 18]):
        for k in range(bs):
            if a + k < S:
                assert lab[n, k].item() == 100 + a + k
    decay = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, bs)]
    assert w[0].tolist() == pytest.approx(decay)  # 4..6 all in the loss mask
    assert w[1].tolist() == pytest.approx([0.0, decay[1], 0.0, 0.0])  # 8 in mask, 9 and 10 not
    assert w[2].tolist() == pytest.approx([0.0, decay[1], 0.0, 0.0])  # 19 in range, 20 and 21 past the end
    assert w[3].tolist() == [0.0] * 4  # padded block
    assert w.dtype == torch.float32
    # explicit gamma
    _, _, w2 = build_block_inputs(ids, lm, anchors, keep, bs, mask_id, gamma=1.0)
    assert w2.view(4, bs)[0, 3].item() == pytest.approx(math.exp(-2.0))
