"""The CUDA-graph paths of the decoders, on a GPU: captured steps decode what the eager ones do.

Skipped without CUDA (CI has none). On a GPU box without pytest, run it as a script:
``python tests/test_cuda_paths.py`` (prints each check). A random Qwen3 in float64 (so no
near-tie can flip an argmax between two kernels), random drafter weights scaled up so
that its drafts depend on the context.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from dflashpipe.drafter.fp8 import check_fp8_device  # noqa: E402

try:
    import pytest
except ImportError:  # run as a script on a box without pytest
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BS = 4


def _models(heads: int = 4, kv_heads: int = 2, head_dim: int = 16, bs: int = BS):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=97, max_position_embeddings=512,
                      tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    target = target.to("cuda", torch.float64).eval()
    dcfg = DrafterConfig.from_target_config(cfg, 2, bs, 96, arch="dflash")
    drafter = DFlashDrafter(dcfg)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.mul_(50.0)
    return target, drafter.to("cuda", torch.float64).eval(), dcfg


def _prompts(vocab, lengths=(5, 23, 1, 14)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def test_captured_target_and_drafter_steps_decode_like_the_eager_loop():
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, TargetRunner, drafter_runner, target_runner

    target, drafter, dcfg = _models()
    ends = [7]
    for step in ("static", "compiled"):
        ar = ARDecoder(target, ends, runner=target_runner(target, step, None, 256, graph_sizes=(1,)))
        verify = target_runner(target, step, dcfg.target_layer_ids, 256, graph_sizes=(BS,))
        assert verify.mode.startswith("static+cuda_graphs")
        dflash = DFlashDecoder(target, drafter, dcfg, ends, runner=verify, draft_runner=drafter_runner(drafter, verify, step, 256))
        assert dflash.draft.mode == verify.mode.removesuffix("+fused")  # the drafter's pieces compiled when the target's steps are
        accepted = []
        for prompt in _prompts(target.config.vocab_size):  # the first prompt meets fresh graphs
            a_ref = ARDecoder(target, ends, runner=TargetRunner(target)).generate(prompt, 30)
            d_ref = DFlashDecoder(target, drafter, dcfg, ends).generate(prompt, 30)
            a, d = ar.generate(prompt, 30), dflash.generate(prompt, 30)
            assert a.tokens == a_ref.tokens == d.tokens == d_ref.tokens, step
            assert d.accepted == d_ref.accepted, step
            accepted += d.accepted
        assert len(set(accepted)) > 1  # drafts were accepted and rejected: rollback exercised


def test_a_draft_vocabulary_decodes_like_the_eager_loop_in_captured_steps():
    """evaluate.draft_vocab under CUDA graphs (and compiled): the captured draft reads the head's rows of the
    draft vocabulary as the eager draft does, so decoding gives AR's tokens and the eager loop's acceptances,
    and every drafted token is one of the vocabulary's."""
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, TargetRunner, drafter_runner, target_runner

    target, drafter, dcfg = _models()
    ends = [7]
    ids = torch.arange(3, target.config.vocab_size, 2)  # every other token: many drafts leave the vocabulary
    drafter.use_draft_vocab(ids, target.get_output_embeddings().weight)
    allowed = set(ids.tolist())
    for step in ("static", "compiled"):
        verify = target_runner(target, step, dcfg.target_layer_ids, 256, graph_sizes=(BS,))
        dflash = DFlashDecoder(target, drafter, dcfg, ends, runner=verify, draft_runner=drafter_runner(drafter, verify, step, 256))
        drafted = []

        def recorded(*args, propose=dflash._propose):
            draft = propose(*args)
            drafted.extend(draft.tolist())
            return draft

        dflash._propose = recorded
        for prompt in _prompts(target.config.vocab_size):
            a_ref = ARDecoder(target, ends, runner=TargetRunner(target)).generate(prompt, 30)
            d_ref = DFlashDecoder(target, drafter, dcfg, ends).generate(prompt, 30)
            d = dflash.generate(prompt, 30)
            assert d.tokens == d_ref.tokens == a_ref.tokens, step
            assert d.accepted == d_ref.accepted, step
        assert drafted and set(drafted) <= allowed, step


def test_flex_steps_read_only_their_live_key_blocks_and_decode_like_the_eager_loop():
    """The compiled steps' flex attention (float32: flex has no float64): the target's AR and verify steps and
    the drafter's draft give the eager loops' tokens over contexts of one and two key blocks (2 query heads per
    key/value head, and 3 as SmolLM2 has), so a live-block count too low would hide context. One too high reads
    masked keys only (a cost, not an error): the prefill's SDPA reads the whole cache, so no poisoned position
    past the live blocks can tell. The drafts must be the eager drafter's too (their acceptance, within a few
    float32 near-ties): lossless tokens alone hid a draft that flex's decoding kernel got wrong at the tiny
    target's shapes (head_dim 32, blocks of 6; torch 2.11 on an H100: tau 1.44 against 3.62)."""
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, TargetRunner, drafter_runner, target_runner
    from dflashpipe.decode.static_target import KV_BLOCK

    for heads, head_dim, bs in ((4, 16, BS), (6, 16, BS), (4, 32, 6)):
        target, drafter, dcfg = _models(heads=heads, head_dim=head_dim, bs=bs)
        target, drafter = target.float(), drafter.float()
        ends, capacity = [7], 4 * KV_BLOCK
        step = target_runner(target, "compiled", None, capacity, graph_sizes=(1,))
        verify = target_runner(target, "compiled", dcfg.target_layer_ids, capacity, graph_sizes=(bs,))
        draft = drafter_runner(drafter, verify, "compiled", capacity)
        assert step.mode.endswith("+flex") and verify.mode.endswith("+flex") and draft.mode.endswith("+flex")
        ar = ARDecoder(target, ends, runner=step)
        dflash = DFlashDecoder(target, drafter, dcfg, ends, runner=verify, draft_runner=draft)
        for prompt in _prompts(target.config.vocab_size, (150, 5, 120, 200)):  # one key block, or two
            a_ref = ARDecoder(target, ends, runner=TargetRunner(target)).generate(prompt, 30)
            d_ref = DFlashDecoder(target, drafter, dcfg, ends).generate(prompt, 30)
            a, d = ar.generate(prompt, 30), dflash.generate(prompt, 30)
            assert a.tokens == a_ref.tokens == d.tokens == d_ref.tokens, (heads, len(prompt))
            print(heads, head_dim, bs, len(prompt), "accepted", d.accepted, "eager", d_ref.accepted)
            assert sum(d.accepted) >= 0.9 * sum(d_ref.accepted), (heads, head_dim, bs, len(prompt))
        # this drafter accepts little, so compare the drafts themselves: the same contexts (one key block,
        # then two; blocks kept whole or cut) through the eager drafter and the compiled flex one
        same, total = _drafts_agree(drafter, dcfg, target, draft)
        print(heads, head_dim, bs, "drafts equal", same, "of", total)
        assert same >= 0.9 * total, (heads, head_dim, bs, same, total)


def _drafts_agree(drafter, dcfg, target, static) -> tuple[int, int]:
    """(draft tokens equal, drafted) between the eager drafter and ``static`` over one sequence of contexts."""
    from dflashpipe.decode.speculative import DrafterRunner

    eager = DrafterRunner(drafter, target.get_input_embeddings(), target.get_output_embeddings(), dcfg.mask_token_id)
    caches = eager.new_cache(), static.new_cache()
    g, dev = torch.Generator().manual_seed(2), next(drafter.parameters()).device
    width, verified = len(dcfg.target_layer_ids) * dcfg.hidden_size, dcfg.num_drafts + 1
    prompt = torch.randn(1, 100, width, generator=g).to(dev)
    for runner, cache in zip((eager, static), caches):
        runner.extend(cache, prompt, 0, 100)
    n, same, total = 101, 0, 0
    for keep in (1, verified, 2, 3, 1, verified) * 6:  # to past 128 positions: the context's second key block
        last = torch.randint(3, target.config.vocab_size - 1, (1, 1), generator=g).to(dev)
        a, b = (runner.propose(cache, n, last).tolist() for runner, cache in zip((eager, static), caches))
        same, total = same + sum(x == y for x, y in zip(a, b)), total + len(a)
        feats = torch.randn(1, verified, width, generator=g).to(dev)
        for runner, cache in zip((eager, static), caches):
            runner.extend(cache, feats, n - 1, keep)
        n += keep
    return same, total


def test_batched_decoder_graphs_decode_like_transformers():
    """Dense attention in float64; flex (the GPU default) in float32 (flex has no float64), eager and
    compiled, with every cache position outside the live blocks NaN, so a read of one would poison the reply."""
    import copy

    from dflashpipe.decode.slots import SlotDecoder

    target64, _, _ = _models()
    prompts = _prompts(target64.config.vocab_size, (5, 23, 1, 14, 9, 30, 2, 11, 17, 4))
    block = 64  # every position stays below one block (prompt <= 30 + 24 new)
    target32 = copy.deepcopy(target64).float()
    for attention, target, compile in (("dense", target64, False), ("flex", target32, False), ("flex", target32, True)):
        for slots in (4, 16):  # refilled rows; partial steps (8 of 16 rows)
            dec = SlotDecoder(target, slots, 256, attention=attention, kv_block=block, compile=compile)
            assert dec.mode == f"slots+{attention}+cuda_graphs" + ("+compiled" if compile else "") + "+fused"
            if attention == "flex":
                for t in dec.k + dec.v:
                    t.zero_()
                    t[:, :, block:] = float("nan")
            for (ids, _), p in zip(dec.generate(prompts, 24, [7]), prompts):
                ref = target.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                                      eos_token_id=[7], pad_token_id=0, temperature=None, top_p=None,
                                      top_k=None)[0, len(p):].tolist()
                assert ids == ref, (attention, compile, slots)



def test_an_fp8_target_runs_cublas_fp8_matmuls_compiled_and_eager_alike():
    """train.target_fp8 on a GPU with FP8 tensor cores: the row-wise scaled matmul of the rounded operands,
    and the compiled target layer (training's) gives the eager layer's features."""
    check_fp8_device(torch.device("cuda"))  # raises on a GPU without FP8 matmuls
    _fp8_target_check("cuda")


def _fp8_target_check(device: str) -> dict:
    import copy

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.features import compiled_target_layer, context_features
    from dflashpipe.drafter.fp8 import FP8, Fp8Linear, quantize_decoder_linears

    torch.manual_seed(0)  # a default-initialised target: activations of a trained model's scale
    cfg = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512)
    ref = Qwen3ForCausalLM(cfg).to(device, torch.bfloat16).eval()
    fp8 = copy.deepcopy(ref)
    assert quantize_decoder_linears(fp8)["quantized"] == 7 * 4
    lin = fp8.model.layers[0].mlp.up_proj
    assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8
    x = torch.randn(40, 256, device=device, dtype=torch.bfloat16)
    sa = x.float().abs().amax(-1, keepdim=True) / 448
    by_hand = ((x.float() / sa).to(FP8).float() * sa) @ (lin.weight.float() * lin.weight_scale.t()).t()
    torch.testing.assert_close(lin(x).float(), by_hand, rtol=2e-2, atol=2e-2)  # out in bf16

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    ids = torch.randint(0, 512, (2, 128), device=device)
    eager = context_features(fp8, ids, None, [1, 3])
    compiled = context_features(fp8, ids, None, [1, 3], layer_fn=compiled_target_layer())
    full = context_features(ref, ids, None, [1, 3])
    errors = {"compiled_vs_eager": rel(compiled, eager), "fp8_vs_bf16": rel(eager, full),
              "compiled_fp8_vs_bf16": rel(compiled, full)}
    print(errors)
    # the compiled layer rounds as well as the eager one: 8-bit rounding turns the fused kernels' small
    # differences (bf16 alone: ~1% on the CPU) into differences of its own size, not into errors
    assert errors["fp8_vs_bf16"] < 0.15 and errors["compiled_vs_eager"] < errors["fp8_vs_bf16"]
    assert errors["compiled_fp8_vs_bf16"] < 1.25 * errors["fp8_vs_bf16"] + 0.01
    return errors

if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"ok {name}")
