"""The batched decoder's CUDA-graph path on a GPU: every row decodes what batch-1 AR decodes.

Skipped without CUDA (CI has none: tests/test_concurrency.py checks the same plumbing on the CPU
with capture faked). On a GPU box without pytest, run it as a script:
``python tests/test_concurrency_cuda.py`` (prints each check). A random Qwen3 in float64 (no
near-tie can flip an argmax between two kernels), drafter weights scaled up so that its drafts
depend on the context.
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


def _models(arch: str):
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
    drafter = DFlashDrafter(DrafterConfig.from_target_config(cfg, 2, BS, 96, arch=arch))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.mul_(50.0)
    return target.to("cuda", torch.float64).eval(), drafter.to("cuda", torch.float64).eval()


def test_batched_graphs_decode_like_batch1_ar():
    from dflashpipe.decode.batched import BatchedDecoder, BatchSettings
    from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 95, (n,), generator=g).tolist() for n in (5, 23, 1, 14, 9, 30, 2)]
    for arch in ("dflash", "dflash2", "dspark"):
        target, drafter = _models(arch)
        ref = [ARDecoder(target, []).generate(p, 24).tokens for p in prompts]
        one = [DFlashDecoder(target, drafter, drafter.cfg, []).generate(p, 24).accepted for p in prompts]
        for slots in (1, 3, 8):
            for d in (None, drafter):
                dec = BatchedDecoder(target, BatchSettings(slots=slots, max_new_tokens=24), [], d)
                run = dec.generate(prompts)
                assert dec.mode == "slots+dense+cuda_graphs"
                assert [r.tokens for r in run.results] == ref, (arch, slots, d is not None)
                if d is not None:  # each row drafted what the batch-1 drafter drafts
                    assert [r.accepted for r in run.results] == one, (arch, slots)
                    forced = BatchSettings(slots=slots, max_new_tokens=24, forced_tau=3.0)
                    tau = [run.tau, BatchedDecoder(target, forced, [], d).generate(prompts).tau]
        print(f"ok {arch}: batched AR and DFlash at 1, 3, 8 rows equal batch-1 AR (tau {tau[0]:.2f}, forced {tau[1]:.2f})")


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
