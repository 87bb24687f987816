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

try:
    import pytest
except ImportError:  # run as a script on a box without pytest
    pytest = None
else:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BS = 4


def _models():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=512,
                      tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    target = target.to("cuda", torch.float64).eval()
    dcfg = DrafterConfig.from_target_config(cfg, 2, BS, 96)
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
        accepted = []
        for prompt in _prompts(target.config.vocab_size):  # the first prompt meets fresh graphs
            a_ref = ARDecoder(target, ends, runner=TargetRunner(target)).generate(prompt, 30)
            d_ref = DFlashDecoder(target, drafter, dcfg, ends).generate(prompt, 30)
            a, d = ar.generate(prompt, 30), dflash.generate(prompt, 30)
            assert a.tokens == a_ref.tokens == d.tokens == d_ref.tokens, step
            assert d.accepted == d_ref.accepted, step
            accepted += d.accepted
        assert len(set(accepted)) > 1  # drafts were accepted and rejected: rollback exercised


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
            assert dec.mode == f"slots+{attention}+cuda_graphs" + ("+compiled" if compile else "")
            if attention == "flex":
                for t in dec.k + dec.v:
                    t.zero_()
                    t[:, :, block:] = float("nan")
            for (ids, _), p in zip(dec.generate(prompts, 24, [7]), prompts):
                ref = target.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                                      eos_token_id=[7], pad_token_id=0, temperature=None, top_p=None,
                                      top_k=None)[0, len(p):].tolist()
                assert ids == ref, (attention, compile, slots)


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"ok {name}")
