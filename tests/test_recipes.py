"""The recipes beyond the paper's: sliding-window layers, DFlash 2, the KL/TV losses, D-PACE, simulated tau."""

import pytest
import torch
import torch.nn.functional as F

from dflashpipe.training.heldout import acceptance_sums
from dflashpipe.drafter.loss import Objective, block_loss, selector_loss
from dflashpipe.drafter.masks import block_mask, block_position_ids, build_block_inputs, dense_mask, dpace_weights
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig, _grouped_causal_conv, expected_state_shapes
from dflashpipe.jobs.errors import UserError

from test_drafter_model import H, V, make_batch, tiny_cfg

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# -- sliding-window layers -------------------------------------------------------------


def test_window_mask_hides_old_context_and_flex_agrees():
    cfg = tiny_cfg()
    ids, lm, anchors, keep, th = make_batch(cfg)
    S, bs, W = ids.shape[1], cfg.block_size, 6
    full, win = dense_mask(anchors, keep, S, bs), dense_mask(anchors, keep, S, bs, window=W)
    assert (win <= full).all() and (win != full).any()
    b, n = 0, 2  # query at position a + k sees context j iff j < a and a + k - j < W
    a = anchors[b, n].item()
    for k in range(bs):
        seen = win[b, 0, n * bs + k, :S].nonzero().flatten().tolist()
        assert seen == [j for j in range(S) if j < a and a + k - j < W]
    bm = block_mask(anchors, keep, S, bs, window=W, BLOCK_SIZE=16)
    dense_from_flex = bm.to_dense()  # block-level: every visible element's block must be kept
    assert dense_from_flex.shape[-1] >= (S + anchors.shape[1] * bs + 15) // 16


def test_sliding_layers_match_between_cache_inference_and_training():
    torch.manual_seed(0)
    cfg = tiny_cfg(sliding_window=5, layer_types=["sliding_attention", "full_attention"])
    model = DFlashDrafter(cfg).eval()
    bs = cfg.block_size
    ids, lm, anchors, keep, th = make_batch(cfg)
    S, N = ids.shape[1], anchors.shape[1]
    emb = torch.randn(ids.shape[0], N * bs, H)
    masks = {t: dense_mask(anchors, keep, S, bs, window=cfg.sliding_window if t == "sliding_attention" else None)
             for t in set(cfg.layer_types)}
    with torch.no_grad():
        ref = model(emb, th, block_position_ids(anchors, S, bs), masks)
        plain = model(emb, th, block_position_ids(anchors, S, bs), masks["full_attention"])
    assert not torch.allclose(ref, plain)  # the window changes the output
    for b in range(ids.shape[0]):
        for n in range(N):
            if not keep[b, n]:
                continue
            a = anchors[b, n].item()
            cache = model.new_cache()
            model.extend_context(cache, th[b : b + 1, :a], torch.arange(a).view(1, -1))
            out = model.draft(cache, emb[b : b + 1, n * bs : (n + 1) * bs], (a + torch.arange(bs)).view(1, bs))
            torch.testing.assert_close(out[0], ref[b, n * bs : (n + 1) * bs], atol=1e-5, rtol=1e-4)


def test_bad_layer_types_are_one_line():
    with pytest.raises(UserError, match="sliding_window"):
        tiny_cfg(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(UserError, match="layer_types"):
        tiny_cfg(layer_types=["full_attention"])
    with pytest.raises(UserError, match="at least drafter.block_size"):
        tiny_cfg(sliding_window=2)


# -- DFlash 2 ------------------------------------------------------------------------


def dflash2_cfg(**kw):
    return tiny_cfg(arch="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=5,
                    final_logit_softcapping=20.0, output_multiplier=0.5, **kw)


def test_grouped_conv_is_causal_within_each_block_and_identity_at_start():
    torch.manual_seed(0)
    B, bs, Hs, G, K = 2, 4, 8, 2, 2
    x = torch.randn(B, 3 * bs, Hs)
    dyn = torch.randn(B, 3 * bs, K, G)
    base = torch.randn(K, Hs)
    out = _grouped_causal_conv(x, dyn, base, bs)
    # by hand: out[t] = sum_o (base[o] + dyn[t, o, group]) * x[t - o], within the block
    grp = torch.arange(Hs) // (Hs // G)
    for t in range(3 * bs):
        want = torch.zeros(B, Hs)
        for o in range(K):
            if t % bs - o >= 0:
                want += (base[o] + dyn[:, t, o][:, grp]) * x[:, t - o]
        torch.testing.assert_close(out[:, t], want)
    # a fresh DFlash 2 drafter's convolutions are the identity: the same hidden as DFlash with its weights
    cfg = dflash2_cfg()
    d2 = DFlashDrafter(cfg).eval()
    d1 = DFlashDrafter(tiny_cfg()).eval()
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()})
    ids, lm, anchors, keep, th = make_batch(cfg)
    S, bs = ids.shape[1], cfg.block_size
    emb = torch.randn(ids.shape[0], anchors.shape[1] * bs, H)
    args = (emb, th, block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))
    with torch.no_grad():
        torch.testing.assert_close(d2(*args), d1(*args))


def test_dflash2_state_has_the_reference_layout_and_cache_inference_matches_training():
    torch.manual_seed(0)
    cfg = dflash2_cfg()
    model = DFlashDrafter(cfg)
    with torch.no_grad():  # move away from the identity start so the convolutions matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_state_shapes(cfg)
    assert shapes["candidate_selector.predecessor_codebook"] == (V, 8)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (2 * 2 * (H // 16), H)
    ids, lm, anchors, keep, th = make_batch(cfg)
    S, N, bs = ids.shape[1], anchors.shape[1], cfg.block_size
    emb = torch.randn(ids.shape[0], N * bs, H)
    with torch.no_grad():
        ref = model(emb, th, block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))
    b, n = 0, 1
    a = anchors[b, n].item()
    cache = model.new_cache()
    model.extend_context(cache, th[b : b + 1, :a], torch.arange(a).view(1, -1))
    out = model.draft(cache, emb[b : b + 1, n * bs : (n + 1) * bs], (a + torch.arange(bs)).view(1, bs))
    torch.testing.assert_close(out[0], ref[b, n * bs : (n + 1) * bs], atol=1e-5, rtol=1e-4)


def test_selector_path_reranks_by_the_previous_token():
    torch.manual_seed(0)
    cfg = dflash2_cfg()
    model = DFlashDrafter(cfg).eval()
    lm_head = torch.randn(V, H)
    block = torch.randn(3, cfg.block_size, H)
    hidden = block[:, 1:]  # slots 1..bs-1 draft
    anchors = torch.tensor([1, 2, 3])
    # a fresh selector (zero successor codebook) proposes exactly the argmax
    assert torch.equal(model.propose(block, anchors, lm_head), model.compute_logits(hidden, lm_head).argmax(-1))
    sel = model.candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 3.0)
        sel.predecessor_codebook.normal_(0, 3.0)
        sel.hidden_projection.weight.normal_(0, 1.0)
    path = model.propose(block, anchors, lm_head)
    logits = model.compute_logits(hidden, lm_head)
    unary, cand = logits.topk(cfg.selector_top_k, dim=-1)
    prev = anchors
    for i in range(hidden.shape[1]):  # by hand, position by position
        best = sel.scores(hidden[:, i], unary[:, i], cand[:, i], prev).argmax(-1)
        prev = cand[:, i].gather(-1, best[:, None])[:, 0]
        assert torch.equal(path[:, i], prev)
    assert not torch.equal(path, logits.argmax(-1))  # the selector re-ranked some positions


def test_selector_loss_trains_selector_and_drafter_and_forces_the_target_in():
    torch.manual_seed(0)
    cfg = dflash2_cfg()
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_(0, 0.1)
    lm_head = torch.randn(V, H)
    hidden = torch.randn(2, 8, H, requires_grad=True)
    prev = torch.randint(0, V, (2, 8))
    target = torch.randint(0, V, (2, 8))
    w = torch.rand(2, 8)
    w[0, 0] = 0
    obj = Objective(multiplier=cfg.output_multiplier, cap=cfg.final_logit_softcapping)
    loss = selector_loss(model.candidate_selector, hidden, lm_head, prev, target, w, obj, chunk_size=5)
    loss.backward()
    assert hidden.grad.abs().sum() > 0 and (hidden.grad[0, 0] == 0).all()
    sel = model.candidate_selector
    for p in (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    # by hand for one row: CE over the top-k (+ the target if missing) of the transformed logits
    r = (1, 3)
    z = torch.tanh(hidden[r].detach() @ lm_head.t() * 0.5 / 20.0) * 20.0
    cand = z.topk(cfg.selector_top_k).indices
    if target[r] not in cand:
        cand[-1] = target[r]
    scores = sel.scores(hidden[r].detach(), z[cand], cand, prev[r])
    ce = F.cross_entropy(scores[None], (cand == target[r]).nonzero()[0])
    one = torch.zeros_like(w)
    one[r] = w[r]
    got = selector_loss(sel, hidden.detach(), lm_head, prev, target, one, obj)
    torch.testing.assert_close(got, ce * w[r], rtol=1e-5, atol=1e-6)


def test_block_loss_hands_the_selector_its_candidates_and_the_teachers_argmax():
    """The training step runs the LM head once per row for the drafter (and once for the teacher):
    the selector's top-k and the target's greedy token come from block_loss's chunks, and give the
    same loss and gradients as the selector computing them itself."""
    torch.manual_seed(1)
    cfg = dflash2_cfg()
    sel = DFlashDrafter(cfg).candidate_selector
    lm_head = torch.randn(V, H)
    hidden = torch.randn(2, 8, H, requires_grad=True)
    teacher = torch.randn(2, 8, H)
    labels, prev = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    w = torch.rand(2, 8)
    w[1, 2:5] = 0
    obj = Objective(loss="kl", multiplier=cfg.output_multiplier, cap=cfg.final_logit_softcapping)
    found = {"top_k": cfg.selector_top_k}
    block_loss(hidden, lm_head, labels, w, 5, reduction="sum", objective=obj, teacher_hidden=teacher, collect=found)
    keep = w > 0
    assert torch.equal(found["teacher_argmax"][keep], (teacher @ lm_head.t()).argmax(-1)[keep])
    assert torch.equal(found["teacher_argmax"][~keep], labels[~keep])
    assert found["candidates"].shape == (2, 8, cfg.selector_top_k)
    expected = found["teacher_argmax"]
    h1 = hidden.detach().clone().requires_grad_()
    a = selector_loss(sel, h1, lm_head, prev, expected, w, obj, chunk_size=5, found=found)
    a.backward()
    h2 = hidden.detach().clone().requires_grad_()
    b = selector_loss(sel, h2, lm_head, prev, expected, w, obj, chunk_size=5)
    b.backward()
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(h1.grad, h2.grad)


# -- losses -----------------------------------------------------------------------------


def _reference(hidden, W, labels, weights, teacher, obj):
    z = hidden.reshape(-1, hidden.shape[-1]) @ W.t() * obj.multiplier
    if obj.cap:
        z = torch.tanh(z / obj.cap) * obj.cap
    logq = F.log_softmax(z.double(), -1)
    if teacher is None:
        p = F.one_hot(labels.reshape(-1), W.shape[0]).double()
        per = -(p * logq).sum(-1)
    else:
        p = F.softmax((teacher.reshape(-1, teacher.shape[-1]) @ W.t()).double(), -1)
        per = (p * (p.log() - logq)).sum(-1)
    per = per + obj.tv_weight * 0.5 * (logq.exp() - p).abs().sum(-1)
    w = weights.reshape(-1).double()
    return (per * w).sum() / w.sum()


@pytest.mark.parametrize("obj", [Objective("kl"), Objective("ce", tv_weight=0.5),
                                 Objective("kl", tv_weight=1.0, multiplier=0.7, cap=3.0)],
                         ids=["kl", "ce+tv", "kl+tv+capped"])
def test_chunked_losses_match_autograd(obj):
    torch.manual_seed(0)
    B, Q = 2, 9
    hidden = torch.randn(B, Q, H, dtype=torch.float64)
    teacher = torch.randn(B, Q, H, dtype=torch.float64) if obj.needs_teacher else None
    W = torch.randn(V, H, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (B, Q))
    weights = torch.rand(B, Q, dtype=torch.float64)
    weights[0, :2] = 0
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    ref = _reference(h1, W, labels, weights, teacher, obj)
    ref.backward()
    loss, _ = block_loss(h2, W, labels, weights, chunk_size=4, objective=obj, teacher_hidden=teacher)
    loss.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)


def test_kl_to_its_own_distribution_is_zero_and_needs_the_teacher():
    hidden = torch.randn(1, 5, H, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, H, dtype=torch.float64)
    loss, _ = block_loss(hidden, W, torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5), objective=Objective("kl"),
                         teacher_hidden=hidden.detach())
    assert abs(loss.item()) < 1e-6  # the chunk math runs in fp32
    with pytest.raises(ValueError, match="teacher"):
        block_loss(hidden, W, torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5), objective=Objective("kl"))


def test_dpace_weights_by_hand_and_in_the_loss():
    loss = torch.tensor([[0.0, 0.5, 1.0, 2.0]])
    valid = torch.tensor([[False, True, True, True]])
    w = dpace_weights(loss, valid)
    s = [1.0] + [0.5 * torch.exp(-loss[0, k]).item() + 0.5 for k in (1, 2, 3)]
    P = [s[0], s[0] * s[1], s[0] * s[1] * s[2], s[0] * s[1] * s[2] * s[3]]
    want = [0.0, P[1] + P[2] + P[3], P[2] + P[3], P[3]]
    torch.testing.assert_close(w[0], torch.tensor(want))
    # through block_loss: the loss uses the D-PACE weights, accuracy keeps the given ones
    torch.manual_seed(0)
    hidden, Wm = torch.randn(1, 4, H, requires_grad=True), torch.randn(V, H) * 0.2
    labels, base = torch.randint(0, V, (1, 4)), torch.tensor([[0.0, 1.0, 0.8, 0.6]])

    def reweight(row_loss, idx):
        grid = torch.zeros(4)
        grid[idx] = row_loss
        return dpace_weights(grid.view(1, 4), base > 0).reshape(-1)[idx]

    s_loss, s_correct, s_w = block_loss(hidden, Wm, labels, base, reduction="sum", reweight=reweight)
    rows = F.cross_entropy(hidden[0] @ Wm.t(), labels[0], reduction="none")
    dw = dpace_weights(rows.detach().view(1, 4), base > 0)[0]
    torch.testing.assert_close(s_loss, (rows * dw).sum())
    torch.testing.assert_close(s_w, dw.sum())
    s_loss.backward()
    ref = hidden.detach().clone().requires_grad_()
    (F.cross_entropy(ref[0] @ Wm.t(), labels[0], reduction="none") * dw).sum().backward()
    torch.testing.assert_close(hidden.grad, ref.grad)


# -- simulated acceptance -------------------------------------------------------------


def test_simulated_tau_counts_each_blocks_leading_run():
    from types import SimpleNamespace

    bs = 4
    cfg = tiny_cfg(block_size=bs)
    # hand-made: W = identity-like so the proposal at a row is the hot index of its hidden
    Vs = V
    lm = torch.zeros(Vs, H)
    lm[:H] = torch.eye(H)
    S = 12
    ids = torch.arange(10, 10 + S).view(1, S)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    anchors = torch.tensor([[2, 9]])  # block 2 runs past the end: positions 10, 11 valid, 12 not
    keep = torch.tensor([[True, True]])
    _, labels, weights = build_block_inputs(ids, loss_mask, anchors, keep, bs, cfg.mask_token_id)
    want = labels.clone()
    want[0, 2] = 0  # block 1: position 1 right, 2 wrong, 3 right -> accepted 1
    hidden = F.one_hot(want, H).float() * 10
    target = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=lm))
    batch = SimpleNamespace(input_ids=ids, loss_mask=loss_mask, anchors=anchors, keep=keep)
    setup = SimpleNamespace(cfg=SimpleNamespace(block_size=bs, loss_chunk_size=3), mask_token_id=cfg.mask_token_id, gamma=2.0,
                            label_shift=0)
    drafter = DFlashDrafter(cfg)
    sums = acceptance_sums(drafter, hidden, target, batch, setup)
    correct, valid, accepted, reached = sums[: 4 * (bs - 1)].view(4, bs - 1)
    # block 2: positions 1, 2 right (labels 10, 11 inside), 3 past the end passes through
    assert (sums[-2] / sums[-1]).item() == pytest.approx(((1 + 1) + (1 + 2)) / 2)
    assert valid.tolist() == [2, 2, 1] and correct.tolist() == [2, 1, 1]
    assert reached.tolist() == [2, 2, 0] and accepted.tolist() == [2, 1, 0]


# -- DSpark ------------------------------------------------------------------------------


def dspark_cfg(**kw):
    return tiny_cfg(arch="dspark", markov_rank=8, **kw)


def test_dspark_slots_predict_one_further_and_every_slot_drafts():
    cfg = dspark_cfg()
    bs = cfg.block_size
    assert (cfg.label_shift, cfg.num_drafts) == (1, bs)
    S = 12
    ids = torch.arange(10, 10 + S).view(1, S)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    anchors, keep = torch.tensor([[2, 9]]), torch.tensor([[True, True]])
    block_ids, labels, w = build_block_inputs(ids, loss_mask, anchors, keep, bs, cfg.mask_token_id, gamma=2.0, shift=1)
    assert block_ids.tolist() == [[12] + [cfg.mask_token_id] * 3 + [19] + [cfg.mask_token_id] * 3]  # as DFlash
    assert labels[0, :bs].tolist() == [13, 14, 15, 16]  # slot k: the token at a + k + 1
    decay = torch.exp(-torch.arange(bs) / 2.0)  # DeepSpec: exp(-k / gamma) from slot 0
    torch.testing.assert_close(w[0, :bs], decay)
    torch.testing.assert_close(w[0, bs:], torch.cat([decay[:2], torch.zeros(2)]))  # 12, 13 past the end


def test_dspark_layout_and_its_markov_head_drafts_slot_by_slot():
    torch.manual_seed(0)
    cfg = dspark_cfg()
    model = DFlashDrafter(cfg).eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_state_shapes(cfg)
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == (V, 8)
    assert shapes["confidence_head.proj.weight"] == (1, H + 8) and shapes["confidence_head.proj.bias"] == (1,)
    lm_head = torch.randn(V, H)
    block = torch.randn(3, cfg.block_size, H)
    anchors = torch.tensor([1, 2, 3])
    logits = model.compute_logits(block, lm_head)  # every slot drafts
    with torch.no_grad():
        model.markov_head.markov_w2.weight.zero_()
    assert torch.equal(model.propose(block, anchors, lm_head), logits.argmax(-1))  # no bias: the argmax
    with torch.no_grad():
        model.markov_head.markov_w1.weight.normal_(0, 3.0)
        model.markov_head.markov_w2.weight.normal_(0, 3.0)
    path = model.propose(block, anchors, lm_head)
    prev = anchors
    head = model.markov_head
    for i in range(cfg.block_size):  # by hand: the bias of the token drafted before (the anchor first)
        prev = (logits[:, i] + head.markov_w1.weight[prev] @ head.markov_w2.weight.T).argmax(-1)
        assert torch.equal(path[:, i], prev)
    assert not torch.equal(path, logits.argmax(-1))  # the Markov head changed some drafts


def test_dspark_loss_and_its_markov_term_match_autograd():
    """0.1 CE + 0.9 L1 to the target, with the Markov head's low-rank logits term: loss and gradients (hidden,
    Markov embeddings, W2) as autograd gives them; the chunks hand back each row's 1 - TV."""
    from dflashpipe.drafter.loss import DSPARK_CE, DSPARK_L1

    torch.manual_seed(0)
    B, Q, R = 2, 9, 5
    W = torch.randn(V, H, dtype=torch.float64) * 0.3
    teacher = torch.randn(B, Q, H, dtype=torch.float64)
    labels = torch.randint(0, V, (B, Q))
    weights = torch.rand(B, Q, dtype=torch.float64)
    weights[0, :2] = 0
    leaves = [torch.randn(B, Q, H, dtype=torch.float64), torch.randn(B, Q, R, dtype=torch.float64),
              torch.randn(V, R, dtype=torch.float64) * 0.3]
    ref_in = [t.clone().requires_grad_() for t in leaves]
    h, e, w2 = ref_in
    z = (h @ W.t() + e @ w2.t()).reshape(-1, V)
    q = F.softmax(z, -1)
    p = F.softmax((teacher @ W.t()).reshape(-1, V), -1)
    l1 = (q - p).abs().sum(-1)
    per = DSPARK_CE * F.cross_entropy(z, labels.reshape(-1), reduction="none") + DSPARK_L1 * l1
    ref = (per * weights.reshape(-1)).sum() / weights.sum()
    ref.backward()
    ours_in = [t.clone().requires_grad_() for t in leaves]
    found = {}
    loss, _ = block_loss(ours_in[0], W, labels, weights, chunk_size=4, objective=Objective("dspark", accept=True),
                         teacher_hidden=teacher, collect=found, markov=(ours_in[1], ours_in[2]))
    loss.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    accept = (1 - 0.5 * l1.detach()).view(B, Q).float()
    torch.testing.assert_close(found["accept"], torch.where(weights > 0, accept, torch.zeros_like(accept)))


def test_dspark_training_step_trains_backbone_markov_and_confidence_heads():
    """The training step's gradient reaches every parameter: the backbone, the Markov head (through the logits)
    and the confidence head (its BCE to each row's acceptance); a DSpark drafter refuses D-PACE."""
    from types import SimpleNamespace

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.masks import default_gamma
    from dflashpipe.training.step import Setup, forward_loss, resolve_setup
    from dflashpipe.training.train import TrainConfig

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, target_layer_ids=[0, 1, 2], arch="dspark", markov_rank=8)
    drafter = DFlashDrafter(cfg)
    ids, lm, anchors, keep, _ = make_batch(cfg)
    batch = SimpleNamespace(input_ids=ids, loss_mask=lm, anchors=anchors, keep=keep, index=None)
    train = TrainConfig(block_size=4, num_anchors=anchors.shape[1], loss_chunk_size=7, grad_clip=1.0,
                        position_weights="decay")
    setup = Setup(cfg=train, device=torch.device("cpu"), attention="sdpa", compile="none", autocast_dtype=None,
                  target_dtype=torch.float32, label_shift=1, mask_token_id=V - 1, layer_ids=cfg.target_layer_ids,
                  gamma=default_gamma(4, 1), rank_batch=2, world_size=1, objective=Objective("dspark", accept=True))
    loss_sum, _, loss_w, _ = forward_loss(drafter, target, batch, setup)
    assert loss_w > 0
    loss_sum.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    dpace = SimpleNamespace(attention="sdpa", dtype="fp32", batch_size=2, compile="none", arch="dspark",
                            position_weights="dpace")
    with pytest.raises(UserError, match="dpace"):
        resolve_setup(dpace, "cpu", V - 1, [0])


@pytest.mark.parametrize("arch,loss,shift", [("dspark", "dspark", 1), ("dflash2", "kl", 0), ("dflash", "ce", 0)])
def test_the_loss_rows_found_on_the_host_give_the_same_step(monkeypatch, arch, loss, shift):
    """forward_loss hands block_loss the rows it scores and the teacher plan of its chunks, found from the
    batch's host tensors (``Batch.host``, copies here: on a GPU the GPU is not waited for). The step is the one
    block_loss makes when it finds them itself from the weights: the same loss and gradients, bit for bit (a
    DSpark block predicts one token further; chunks of 7 rows)."""
    from types import SimpleNamespace

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.masks import default_gamma
    from dflashpipe.training import step
    from dflashpipe.training.train import TrainConfig

    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    extra = {"markov_rank": 8} if arch == "dspark" else {}
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, target_layer_ids=[0, 1, 2], arch=arch, **extra)
    ids, lm, anchors, keep, _ = make_batch(cfg)
    host = tuple(t.clone() for t in (ids, lm, anchors, keep))
    train = TrainConfig(block_size=4, num_anchors=anchors.shape[1], loss_chunk_size=7, grad_clip=1.0, arch=arch,
                        position_weights="decay")
    setup = step.Setup(cfg=train, device=torch.device("cpu"), attention="sdpa", compile="none", autocast_dtype=None,
                       target_dtype=torch.float32, label_shift=shift, mask_token_id=V - 1,
                       layer_ids=cfg.target_layer_ids, gamma=default_gamma(4, shift), rank_batch=2, world_size=1,
                       objective=Objective(loss, accept=arch == "dspark"),
                       selector_weight=1.0 if arch == "dflash2" else 0.0)

    def run(batch):
        torch.manual_seed(1)
        drafter = DFlashDrafter(cfg)
        loss_sum, correct, loss_w, w = step.forward_loss(drafter, target, batch, setup)
        loss_sum.backward()
        return [loss_sum, correct, loss_w, w] + [p.grad for p in drafter.parameters()]

    planned = run(SimpleNamespace(input_ids=ids, loss_mask=lm, anchors=anchors, keep=keep, index=None, host=host))
    monkeypatch.setattr(step, "_row_plan", lambda *args: None)  # block_loss finds them itself
    found = run(SimpleNamespace(input_ids=ids, loss_mask=lm, anchors=anchors, keep=keep, index=None))
    assert planned[2] > 0 and len(planned) == len(found)
    for a, b in zip(planned, found):
        assert torch.equal(a, b)


def test_dspark_simulated_tau_counts_every_slot():
    """DSpark's held-out proposals are all bs slots (slot k against the token at a + k + 1)."""
    from types import SimpleNamespace

    bs = 4
    cfg = dspark_cfg(block_size=bs)
    lm = torch.zeros(V, H)
    lm[:H] = torch.eye(H)
    S = 12
    ids = torch.arange(10, 10 + S).view(1, S)
    loss_mask = torch.ones(1, S, dtype=torch.bool)
    anchors, keep = torch.tensor([[2, 9]]), torch.tensor([[True, True]])  # block 2: labels 10, 11, then past the end
    _, labels, _ = build_block_inputs(ids, loss_mask, anchors, keep, bs, cfg.mask_token_id, shift=1)
    want = labels.clone()
    want[0, 1] = 0  # block 1: slot 0 right, 1 wrong, 2 and 3 right -> accepted 1
    hidden = F.one_hot(want, H).float() * 10
    target = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=lm))
    batch = SimpleNamespace(input_ids=ids, loss_mask=loss_mask, anchors=anchors, keep=keep)
    setup = SimpleNamespace(cfg=SimpleNamespace(block_size=bs, loss_chunk_size=3), mask_token_id=cfg.mask_token_id, gamma=2.0, label_shift=1)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()  # proposals: the argmax of each slot
    sums = acceptance_sums(drafter, hidden, target, batch, setup)
    correct, valid, accepted, reached = sums[: 4 * bs].view(4, bs)
    assert (sums[-2] / sums[-1]).item() == pytest.approx(((1 + 1) + (1 + 2)) / 2)
    assert valid.tolist() == [2, 2, 1, 1] and correct.tolist() == [2, 1, 1, 1]
    assert reached.tolist() == [2, 2, 0, 0] and accepted.tolist() == [2, 1, 0, 0]


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_selector_loss_from_block_loss_logits_equals_its_own_lm_head_pass(loss):
    """With block_loss's logits (candidates, their logits and the chosen token's) the selector runs no LM
    head; loss and gradients equal those of its own chunked pass, misses (target outside the top-k) included."""
    torch.manual_seed(3)
    cfg = dflash2_cfg()
    sel = DFlashDrafter(cfg).candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 0.1)
    lm_head = torch.randn(V, H)
    hidden, teacher = torch.randn(2, 8, H), torch.randn(2, 8, H)
    labels, prev = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))
    w = torch.rand(2, 8)
    w[0, 1] = 0
    obj = Objective(loss=loss, multiplier=cfg.output_multiplier, cap=cfg.final_logit_softcapping)
    found = {"top_k": cfg.selector_top_k}
    block_loss(hidden, lm_head, labels, w, 5, reduction="sum", objective=obj,
               teacher_hidden=teacher if loss == "kl" else None, collect=found)
    chosen = found.get("teacher_argmax", labels)
    assert (chosen[w > 0][:, None] != found["candidates"][w > 0]).all(-1).any()  # some target is a miss
    grads = []
    for kw in ({"found": found}, {}):
        h = hidden.clone().requires_grad_()
        sel.zero_grad()
        value = selector_loss(sel, h, lm_head, prev, chosen, w, obj, chunk_size=5, **kw)
        value.backward()
        grads.append((value.detach(), h.grad, sel.successor_codebook.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_block_loss_with_teacher_rows_equals_the_gathered_teacher():
    """Overlapping blocks share teacher rows: block_loss given the target's [B, S, H] states and each row's
    position equals block_loss given the gathered [B, Q, H] rows (loss, gradient, teacher argmax)."""
    torch.manual_seed(4)
    S, Q = 6, 10
    W = torch.randn(V, H)
    final = torch.randn(2, S, H)
    rows = torch.randint(0, S, (2, Q))
    labels = torch.randint(0, V, (2, Q))
    w = torch.rand(2, Q)
    w[1, :3] = 0
    obj = Objective(loss="kl", multiplier=0.5, cap=20.0)
    out = []
    for kw in ({"teacher_hidden": final, "teacher_rows": rows},
               {"teacher_hidden": final.gather(1, rows[..., None].expand(-1, -1, H))}):
        h = torch.randn(2, Q, H, generator=torch.Generator().manual_seed(5)).requires_grad_()
        found = {}
        value, acc = block_loss(h, W, labels, w, 4, objective=obj, collect=found, **kw)
        value.backward()
        out.append((value.detach(), acc, h.grad, found["teacher_argmax"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("V", [1000, 1024, 40])
def test_top_k_by_groups_is_topk(V):
    from dflashpipe.drafter.loss import top_k_by_groups

    x = torch.randn(7, V, generator=torch.Generator().manual_seed(V))
    x[0, :20] = 50.0 + torch.arange(20.0)  # a row whose top k sit in one group
    values, indices = top_k_by_groups(x, 5, group=16)
    ref = x.topk(5, dim=-1)
    torch.testing.assert_close(values, ref.values)
    assert torch.equal(indices, ref.indices)
    assert torch.equal(x.gather(1, indices), values)


@pytest.mark.parametrize("selector_weight", [0.5, 0.0])
def test_one_rank_step_sets_gradients_to_none_and_trains_as_the_ddp_step(selector_weight, one_rank_group):
    """At K = 1 the step sets the gradients to None before the backward (no zero fill, no accumulate, no
    gradient memory in the forward: none exists when the forward starts); DDP zeroes its bucket views in
    place. Three AdamW steps (weight decay on, DFlash 2 + KL) leave every parameter bit-identical both ways;
    at selector weight 0 the selector gets no gradient and stays as it was on both (AdamW skips it)."""
    from types import SimpleNamespace

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.training.distributed import adamw
    from dflashpipe.training.step import Setup, train_step
    from dflashpipe.training.train import TrainConfig

    torch.manual_seed(0)
    tc = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    target = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    cfg = DrafterConfig.from_target_config(tc, 2, 4, V - 1, target_layer_ids=[0, 1, 2], arch="dflash2",
                                           conv_group_size=16, selector_rank=8, selector_top_k=5,
                                           final_logit_softcapping=20.0, output_multiplier=0.5)
    ids, lm, anchors, keep, _ = make_batch(cfg)
    batch = SimpleNamespace(input_ids=ids, loss_mask=lm, anchors=anchors, keep=keep, index=None,
                            num_tokens=int(lm.sum()))
    train = TrainConfig(block_size=4, num_anchors=anchors.shape[1], loss_chunk_size=7, grad_clip=1.0,
                        position_weights="decay")
    setup = Setup(cfg=train, device=torch.device("cpu"), attention="sdpa", compile="none", autocast_dtype=None,
                  target_dtype=torch.float32, label_shift=0, mask_token_id=V - 1, layer_ids=cfg.target_layer_ids,
                  gamma=7.0, rank_batch=ids.shape[0], world_size=1, selector_weight=selector_weight,
                  objective=Objective("kl", multiplier=0.5, cap=20.0))
    plain = DFlashDrafter(cfg)
    inner = DFlashDrafter(cfg)
    inner.load_state_dict(plain.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(inner, gradient_as_bucket_view=True,
                                                    find_unused_parameters=selector_weight == 0)
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    grads_at_forward = []
    plain.register_forward_pre_hook(lambda m, a: grads_at_forward.append(any(p.grad is not None for p in m.parameters())))
    runs = []
    for model, module in ((plain, plain), (ddp, inner)):
        opt = adamw(module, 1e-2, 0.1, torch.device("cpu"), world_size=1)
        runs.append([train_step(model, target, opt, batch, 1e-2, setup) for _ in range(3)])
    assert runs[0] == runs[1]  # loss, accuracy, grad norm: the same floats
    assert grads_at_forward == [False] * 3  # set to None before every step's forward
    moved = {n for n, p in plain.named_parameters() if not torch.equal(p, before[n])}
    for (n, p), q in zip(plain.named_parameters(), inner.parameters()):
        assert torch.equal(p, q), n
    selector = {n for n, _ in plain.named_parameters() if n.startswith("candidate_selector.")}
    trained = {n for n in selector if before[n].any()}  # (a zero codebook stays zero under weight decay alone)
    assert trained and (trained <= moved if selector_weight else not selector & moved)
