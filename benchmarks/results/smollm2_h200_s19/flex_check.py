"""Which static piece's flex attention decodes differently from the eager loop (float32, a random Qwen3; GPU).

    python3 flex_check.py [QUERY_HEADS]   # 4 (default: 2 per key/value head, the logs here); 6: 3, as SmolLM2
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "workflow"))
import test_cuda_paths as t  # noqa: E402
from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, TargetRunner  # noqa: E402
from dflashpipe.decode.static_drafter import StaticDrafterRunner  # noqa: E402
from dflashpipe.decode.static_target import StaticTargetRunner  # noqa: E402

target, drafter, dcfg = t._models(heads=int(sys.argv[1]) if len(sys.argv) > 1 else 4)
target, drafter = target.float(), drafter.float()
ends, C = [7], 512
prompts = t._prompts(target.config.vocab_size, (150, 5, 120, 200))
refs = [(ARDecoder(target, ends, runner=TargetRunner(target)).generate(p, 30).tokens,
         DFlashDecoder(target, drafter, dcfg, ends).generate(p, 30)) for p in prompts]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


for name, compile, att in (("AR sdpa compiled", True, "sdpa"), ("AR flex compiled", True, "flex"), ("AR flex captured eager", False, "flex")):
    try:
        r = StaticTargetRunner(target, capacity=C, graph_sizes=(1,), compile=compile, attention=att)
        ar = ARDecoder(target, ends, runner=r)
        print(name, r.mode, [first_diff(ar.generate(p, 30).tokens, ref[0]) for p, ref in zip(prompts, refs)], flush=True)
    except Exception as e:  # noqa: BLE001
        print(name, "failed:", repr(e)[:300], flush=True)
for vt, dt, compile in (("sdpa", "sdpa", True), ("flex", "sdpa", True), ("sdpa", "flex", True), ("flex", "flex", True), ("flex", "flex", False)):
    try:
        v = StaticTargetRunner(target, dcfg.target_layer_ids, capacity=C, graph_sizes=(t.BS,), compile=compile, attention=vt)
        d = StaticDrafterRunner(drafter, v.embed, v.lm_head, dcfg.mask_token_id, C, compile=compile, attention=dt)
        dec = DFlashDecoder(target, drafter, dcfg, ends, runner=v, draft_runner=d)
        out = [dec.generate(p, 30) for p in prompts]
    except Exception as e:  # noqa: BLE001
        print(vt, dt, compile, "failed:", repr(e)[:300], flush=True)
        continue
    print(f"DFlash verify {vt} draft {dt} compiled {compile}", v.mode, d.mode,
          "vs AR", [first_diff(o.tokens, ref[0]) for o, ref in zip(out, refs)],
          "accepted equal", [o.accepted == ref[1].accepted for o, ref in zip(out, refs)], flush=True)
