"""The drafter module: config, flex vs SDPA, gradients, cache inference, chunked loss."""

import types

import pytest
import torch
import torch.nn.functional as F

from dflashpipe.drafter.loss import block_loss
from dflashpipe.drafter.masks import (
    block_mask,
    block_position_ids,
    build_block_inputs,
    dense_mask,
    sample_anchors,
)
from dflashpipe.drafter.model import (
    DFlashDrafter,
    DrafterConfig,
    default_target_layer_ids,
    expected_state_shapes,
)
from dflashpipe.jobs.errors import UserError

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

H, V, NT = 64, 101, 3  # hidden, vocab, number of tapped target layers


def tiny_cfg(**kw):
    args = dict(
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=V,
        max_position_embeddings=256,
        block_size=4,
        mask_token_id=V - 1,
        target_layer_ids=[0, 2, 4],
        num_target_layers=6,
        arch="dflash",
    )
    args.update(kw)
    return DrafterConfig(**args)


def make_batch(cfg, B=2, S=40, N=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (B, S), generator=g)
    lm = torch.zeros(B, S, dtype=torch.bool)
    lm[0, 10:] = True  # anchors can land right at the end (38)
    lm[1, 30:34] = True  # only 3 valid anchors -> one padded block
    anchors, keep = sample_anchors(lm, N, cfg.block_size, g)
    anchors[0, -1] = S - 2  # force an anchor near the sequence end
    anchors[0], _ = anchors[0].sort()
    th = torch.randn(B, S, NT * H, generator=g)
    return ids, lm, anchors, keep, th


# -- config ------------------------------------------------------------------


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    # too shallow for 1..L-3: spread over 0..L-1, deduplicated
    assert default_target_layer_ids(3, 5) == [0, 1, 2]
    # shallow targets: [1, L-3] has too few layers, spread over all of them instead (not [1, 1, 1] -> [1])
    assert default_target_layer_ids(4, 3) == [0, 2, 3]
    assert default_target_layer_ids(6, 5) == [0, 1, 2, 4, 5]
    assert default_target_layer_ids(2, 5) == [0, 1]
    assert default_target_layer_ids(1, 5) == [0]
    assert default_target_layer_ids(36, 1) == [18]


def test_from_target_config_reads_rope_theta_both_ways():
    from transformers import Qwen3Config

    tc = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 123456.0},
    )
    cfg = DrafterConfig.from_target_config(tc, 5, 16, V - 1)
    assert cfg.rope_theta == 123456.0
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert (cfg.num_target_layers, cfg.num_hidden_layers, cfg.block_size, cfg.head_dim) == (36, 5, 16, 16)
    old = types.SimpleNamespace(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, rope_theta=5e5, rms_norm_eps=1e-5,
        max_position_embeddings=128,
    )
    cfg2 = DrafterConfig.from_target_config(old, 2, 8, 7, target_layer_ids=[1, 5])
    assert cfg2.rope_theta == 5e5 and cfg2.head_dim == 16 and cfg2.target_layer_ids == [1, 5]
    with pytest.raises(UserError, match="target_layer_ids"):
        DrafterConfig.from_target_config(old, 2, 8, 7, target_layer_ids=[8])
    with pytest.raises(UserError, match="mask_token_id"):
        DrafterConfig.from_target_config(old, 2, 8, V + 5)


def test_parameter_names_match_export_layout():
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == expected_state_shapes(cfg)
    assert not any("bias" in k or "embed" in k or "lm_head" in k for k in got)


# -- attention backends --------------------------------------------------------


def test_flex_blockmask_equals_sdpa_dense():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg).eval()
    bs = cfg.block_size
    ids, lm, anchors, keep, th = make_batch(cfg)
    S, N = ids.shape[1], anchors.shape[1]
    assert not keep[1].all() and anchors[0].max() == S - 2
    emb = torch.randn(ids.shape[0], N * bs, H)
    pos = block_position_ids(anchors, S, bs)
    dm = dense_mask(anchors, keep, S, bs)
    bm = block_mask(anchors, keep, S, bs, device="cpu")
    with torch.no_grad():
        out_sdpa = model(emb, th, pos, dm)
        out_flex = model(emb, th, pos, bm)
    assert torch.isfinite(out_sdpa).all() and torch.isfinite(out_flex).all()
    sees = dm[:, 0].any(-1)  # rows that see something
    assert (~sees).any() and sees.any()
    torch.testing.assert_close(out_flex[sees], out_sdpa[sees], atol=1e-5, rtol=1e-4)


def test_sdpa_backward_and_frozen_embedding_lm_head():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(V, H).requires_grad_(False)
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    ids, lm, anchors, keep, th = make_batch(cfg)
    S = ids.shape[1]
    block_ids, labels, w = build_block_inputs(ids, lm, anchors, keep, cfg.block_size, cfg.mask_token_id)
    hidden = model(embed(block_ids), th, block_position_ids(anchors, S, cfg.block_size),
                   dense_mask(anchors, keep, S, cfg.block_size))
    loss, acc = block_loss(hidden, lm_head.weight, labels, w, chunk_size=16)
    assert torch.isfinite(loss) and 0 <= acc.item() <= 1
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert embed.weight.grad is None and lm_head.weight.grad is None


# -- cache inference ------------------------------------------------------------


def test_cache_draft_equals_masked_training_forward():
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = DFlashDrafter(cfg).eval()
    bs = cfg.block_size
    ids, lm, anchors, keep, th = make_batch(cfg)
    B, S = ids.shape
    N = anchors.shape[1]
    emb = torch.randn(B, N * bs, H)
    with torch.no_grad():
        ref = model(emb, th, block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))
    for b in range(B):
        for n in range(N):
            if not keep[b, n]:
                continue
            a = anchors[b, n].item()
            blk = emb[b : b + 1, n * bs : (n + 1) * bs]
            pos = (a + torch.arange(bs)).view(1, bs)
            cache = model.new_cache()
            # commit the context in two pieces, with an over-long piece cropped back
            cut = a // 2
            model.extend_context(cache, th[b : b + 1, :cut], torch.arange(cut).view(1, -1))
            end = min(a + 3, S)
            model.extend_context(cache, th[b : b + 1, cut:end], torch.arange(cut, end).view(1, -1))
            cache.crop(a)
            assert cache.seq_len == a
            out = model.draft(cache, blk, pos)
            torch.testing.assert_close(out[0], ref[b, n * bs : (n + 1) * bs], atol=1e-5, rtol=1e-4)
            assert cache.seq_len == a  # the block's K/V are not stored


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_fused_projections_give_the_same_block_forward(arch):
    """Decoding fuses the drafter's q/k/v and gate/up into one matmul each (as the target's): the same
    hidden states, the weights becoming views (no copy), the state dict unchanged."""
    from dflashpipe.decode.layer import fuse_projections

    torch.manual_seed(0)
    cfg = tiny_cfg(arch=arch)
    model = DFlashDrafter(cfg).eval()
    for p in model.parameters():  # off the identity init of DFlash 2's convolutions
        p.data.normal_(0, 0.2)
    ids, lm, anchors, keep, th = make_batch(cfg)
    B, S = ids.shape
    emb = torch.randn(B, anchors.shape[1] * cfg.block_size, H)
    args = (emb, th, block_position_ids(anchors, S, cfg.block_size), dense_mask(anchors, keep, S, cfg.block_size))
    keys = set(model.state_dict())
    with torch.no_grad():
        ref = model(*args)
        fuse_projections(None, layers=model.layers)
        got = model(*args)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_dflash2_convolutions_run_in_the_dtype_of_the_matmuls_around_them():
    """Under autocast (bf16 training on a GPU) DFlash 2's convolution before a sub-layer reads the bf16 its
    matmuls read, not the fp32 a norm with fp32 weights gives: the same values as the conv of that bf16
    input (what decoding, all bf16, computes), at half the bytes. Without autocast (fp32, the CPU) nothing
    is cast."""
    from dflashpipe.drafter.model import GroupedDynamicConv, _grouped_causal_conv

    torch.manual_seed(0)
    cfg = tiny_cfg(arch="dflash2")
    conv = GroupedDynamicConv(cfg)
    for p in conv.parameters():  # off the identity init
        p.data.normal_(0, 0.2)
    x = torch.randn(2, 3 * cfg.block_size, H)  # fp32, as the norm before it gives
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, kernel = conv.prepare(x)
        dyn = conv.kernel_projection(x).view(*x.shape[:-1], 2, conv.kernel_size, conv.groups)
    assert out.dtype == kernel.dtype == torch.bfloat16
    ref = _grouped_causal_conv(x.bfloat16(), dyn[..., 0, :, :], conv.base_kernel[0], cfg.block_size)
    assert torch.equal(out, ref)
    out32, _ = conv.prepare(x)
    assert out32.dtype == torch.float32
    dyn32 = conv.kernel_projection(x).view(*x.shape[:-1], 2, conv.kernel_size, conv.groups)
    assert torch.equal(out32, _grouped_causal_conv(x, dyn32[..., 0, :, :], conv.base_kernel[0], cfg.block_size))


# -- loss ----------------------------------------------------------------------


def _reference_ce(hidden, W, labels, weights):
    logits = hidden.reshape(-1, hidden.shape[-1]) @ W.t()
    ce = F.cross_entropy(logits.float(), labels.reshape(-1), reduction="none")
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum()


def test_chunked_loss_matches_reference_value_and_grad():
    torch.manual_seed(0)
    B, Q = 2, 12
    hidden = torch.randn(B, Q, H, dtype=torch.float64)
    W = torch.randn(V, H, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (B, Q))
    weights = torch.rand(B, Q, dtype=torch.float64)
    weights[0, :3] = 0
    weights[1, 5] = 0
    h1, W1 = hidden.clone().requires_grad_(), W.clone().requires_grad_()
    h2, W2 = hidden.clone().requires_grad_(), W.clone().requires_grad_()
    ref = _reference_ce(h1, W1, labels, weights)
    ref.backward()
    loss, _ = block_loss(h2, W2, labels, weights, chunk_size=5)
    (loss * 1.0).backward()
    torch.testing.assert_close(loss.double(), ref.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(W2.grad, W1.grad, atol=1e-6, rtol=1e-5)
    # zero-weight rows get zero gradient; frozen weight gets none
    assert (h2.grad[0, :3] == 0).all()
    h3 = hidden.clone().requires_grad_()
    loss3, _ = block_loss(h3, W, labels, weights, chunk_size=7)
    (2.0 * loss3).backward()
    torch.testing.assert_close(h3.grad, 2.0 * h1.grad, atol=1e-6, rtol=1e-5)
    # mixed dtypes (fp32 hidden, bf16 frozen head) run and stay close
    h4 = hidden.float().requires_grad_()
    loss4, _ = block_loss(h4, W.bfloat16(), labels, weights.float(), chunk_size=4)
    loss4.backward()
    assert h4.grad.dtype == torch.float32
    torch.testing.assert_close(loss4.double(), ref.double(), atol=0.05, rtol=0.02)


def test_chunked_loss_all_zero_weights():
    hidden = torch.randn(1, 4, H, requires_grad=True)
    loss, acc = block_loss(hidden, torch.randn(V, H), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))
    assert loss.item() == 0 and acc.item() == 0
    loss.backward()
    assert (hidden.grad == 0).all()


def test_accuracy_hand_made():
    # hidden = one-hot rows, W = identity -> argmax is the hot index
    Hs, Vs = 4, 4
    W = torch.eye(Vs, Hs)
    hidden = torch.eye(Hs)[[0, 1, 2, 3]].view(1, 4, Hs) * 5
    labels = torch.tensor([[0, 1, 3, 0]])  # correct, correct, wrong, wrong
    weights = torch.tensor([[1.0, 0.5, 0.25, 0.0]])  # last row skipped
    _, acc = block_loss(hidden, W, labels, weights, chunk_size=2)
    assert acc.item() == pytest.approx(1.5 / 1.75)
