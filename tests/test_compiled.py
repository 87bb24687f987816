"""The compiled training paths (``train.compile: layers``) compute what the eager ones do.

On the GPU a shard runs the drafter layers, the target layers and the loss
chunks as compiled graphs. The same code compiles on the CPU (Inductor's C++
backend, SDPA instead of flex_attention), so these tests check it here: values
and gradients equal to eager, ONE graph shared by all layers, and trimming the
target's unused layers changes no feature.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dflashpipe.drafter import loss, model
from dflashpipe.drafter.features import compiled_target_layer, context_features, trim_unused_layers
from dflashpipe.drafter.loss import compiled_chunk_ce, block_loss
from dflashpipe.drafter.masks import block_position_ids, dense_mask, sample_anchors

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_compiled_drafter_layers_match_eager_and_share_one_graph():
    cfg = model.DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, vocab_size=50, mask_token_id=49, num_target_layers=4, num_hidden_layers=3,
                              block_size=4, arch="dflash")
    torch.manual_seed(0)
    drafter = model.DFlashDrafter(cfg)
    S, N, bs = 24, 3, 4
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(torch.ones(1, S, dtype=torch.bool), N, bs, g)
    args = (torch.randn(1, N * bs, 32), torch.randn(1, S, 32 * len(cfg.target_layer_ids)),
            block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))

    def run():
        drafter.zero_grad(set_to_none=True)
        out = drafter(*args)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), [p.grad.clone() for p in drafter.parameters()]

    ref, ref_grads = run()
    other = model.DFlashDrafter(cfg)  # the mode belongs to the instance: another drafter stays eager
    drafter.set_compile_mode("layers")
    assert other.layer_fn is model._block_layer and drafter.layer_fn is not model._block_layer
    out, grads = run()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # three layers, two graphs: the first layer's input needs no grad, the others' do
    assert counters["stats"]["unique_graphs"] == 2


def test_compiled_loss_chunks_match_eager_with_a_padded_last_chunk():
    torch.manual_seed(0)
    hidden, W = torch.randn(2, 11, 16), torch.randn(40, 16) * 0.5
    labels, weights = torch.randint(0, 40, (2, 11)), torch.rand(2, 11)
    weights[0, :2] = 0

    def run(ce):
        h = hidden.clone().requires_grad_()
        value, acc = block_loss(h, W, labels, weights, chunk_size=8, ce=ce)  # 20 rows: chunks 8, 8, 4 (padded)
        value.backward()
        return value.detach(), acc, h.grad

    ref = run(loss.EAGER_CE)
    got = run(compiled_chunk_ce())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # the padded last chunk reuses the graph


def test_compiled_target_layers_and_trimming_keep_the_features(micro_target):
    from dflashpipe.inputs.target import load_target

    target, _ = load_target(str(micro_target))
    ids = torch.randint(5, target.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    ref = context_features(target, ids, None, [0, 1])  # eager; equal to HF's hidden_states (test_train)
    compiled = compiled_target_layer()
    torch.testing.assert_close(context_features(target, ids, None, [0, 1], layer_fn=compiled), ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # both layers share one graph
    # the deepest tap is layer 0: layer 1 is dropped, and layer 0 stays pre-norm
    assert trim_unused_layers(target, [0]) == 1 and len(target.model.layers) == 1
    torch.testing.assert_close(context_features(target, ids, None, [0], layer_fn=compiled), ref[..., : target.config.hidden_size],
                               atol=1e-5, rtol=1e-5)


def test_an_activation_memory_budget_reaches_the_partitioner_and_keeps_the_gradients(monkeypatch):
    """``train.activation_memory_budget`` is set for the compiled graphs by the step's setup
    (measured on an H200: 0.5 takes 5-7 GiB off the peak), and recomputing changes no gradient."""
    from dataclasses import replace

    from torch._functorch import config as functorch_config

    from dflashpipe.training.step import apply_compile_mode, resolve_setup
    from dflashpipe.training.train import TrainConfig

    monkeypatch.setattr(functorch_config, "activation_memory_budget", functorch_config.activation_memory_budget)
    cfg = model.DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, vocab_size=50, mask_token_id=49, num_target_layers=4, num_hidden_layers=1,
                              block_size=4, arch="dflash")
    S, N, bs = 24, 3, 4
    anchors, keep = sample_anchors(torch.ones(1, S, dtype=torch.bool), N, bs, torch.Generator().manual_seed(0))
    args = (torch.randn(1, N * bs, 32), torch.randn(1, S, 32 * len(cfg.target_layer_ids)),
            block_position_ids(anchors, S, bs), dense_mask(anchors, keep, S, bs))

    def grads(drafter):
        out = drafter(*args)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [p.grad for p in drafter.parameters()]

    torch.manual_seed(0)
    eager = model.DFlashDrafter(cfg)
    compiled = model.DFlashDrafter(cfg)
    compiled.load_state_dict(eager.state_dict())
    setup = resolve_setup(TrainConfig(activation_memory_budget=0.2), "cpu", 49, cfg.target_layer_ids)
    assert setup.compile == "none"  # the CPU's SDPA path compiles nothing: the budget is left alone there
    apply_compile_mode(setup, compiled)
    assert functorch_config.activation_memory_budget != 0.2
    apply_compile_mode(replace(setup, compile="layers"), compiled)  # as on the flex (CUDA) path
    assert functorch_config.activation_memory_budget == 0.2
    for a, b in zip(grads(compiled), grads(eager)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_compiled_chunks_with_a_teacher_and_the_selectors_top_k_match_eager():
    """KL to a teacher whose rows are shared (teacher_rows), DFlash 2's transform and the selector's
    top-k from the chunks' group maxima: compiled at one padded shape == eager == a plain topk."""
    from dflashpipe.drafter.loss import Objective

    torch.manual_seed(1)
    V, H, S, Q = 1024, 16, 9, 11
    W = torch.randn(V, H) * 0.5
    final, rows = torch.randn(2, S, H), torch.randint(0, S, (2, Q))
    labels, weights = torch.randint(0, V, (2, Q)), torch.rand(2, Q)
    weights[1, :3] = 0
    obj = Objective(loss="kl", multiplier=0.5, cap=20.0)

    def run(ce):
        h = torch.randn(2, Q, H, generator=torch.Generator().manual_seed(2)).requires_grad_()
        found = {"top_k": 3}
        value, acc = block_loss(h, W, labels, weights, chunk_size=8, ce=ce, objective=obj, teacher_hidden=final,
                                teacher_rows=rows, collect=found)
        value.backward()
        return value.detach(), acc, h.grad, found["teacher_argmax"], found["candidates"], found["candidate_logits"]

    ref = run(loss.EAGER_CE)
    got = run(compiled_chunk_ce())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    h = torch.randn(2, Q, H, generator=torch.Generator().manual_seed(2))
    keep = weights > 0
    assert torch.equal(ref[4][keep], (h @ W.t()).topk(3, dim=-1).indices[keep])
