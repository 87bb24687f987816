"""Drafter training throughput at Qwen3-8B shapes, with the step split and MFU.

Builds a Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, head dim
128, vocab 151936; random bf16 weights: throughput does not depend on them) and
the paper's 5-layer DFlash drafter (fp32 master weights, bf16 autocast), then
times the pipeline's own training step on S=3072 context tokens with 512
anchors and block size 16, split into:

* target forward (only the layers up to the deepest tapped one; no LM head),
* drafter forward (+ chunked LM head and decayed CE),
* backward,
* optimiser (fused AdamW + clip).

It reports context tokens/s, the split (CUDA events), peak memory, and model
FLOP utilisation against the bf16 matmul peak measured on the same GPU. With
``--no-compile`` (uncompiled flex_attention) the dense-flex guard must stop
the step with an error instead of materialising the score matrix.

    python benchmarks/train_throughput.py --out $OUT/throughput.json
    python benchmarks/train_throughput.py --no-compile          # the guard, same shapes
    python benchmarks/train_throughput.py --device cpu --tiny   # smoke run of the code path

Peer measured on one H200 with torch 2.11 at these shapes (see the GPU-scale
issue): SpecForge's DFlash trainer, 10,178 context tokens/s, step 0.302 s,
peak memory 46.9 GiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=10_000.0)


def matmul_peak_tflops(device: str, n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def model_flops(tcfg, dcfg, S: int, queries: int, deepest: int) -> dict:
    """Matmul FLOPs of one step (attention scores included, masks ignored: an upper bound for them)."""
    H, I, hd = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    q, kv = tcfg.num_attention_heads * hd, tcfg.num_key_value_heads * hd
    layer_params = H * (q + 2 * kv) + q * H + 3 * H * I
    target = 2 * (deepest + 1) * (layer_params * S + 2 * S * S * q / 2)  # causal: half the scores
    n_ctx = len(dcfg.target_layer_ids)
    drafter_fwd = dcfg.num_hidden_layers * (2 * layer_params * queries + 2 * 2 * queries * (S + queries) * q)
    drafter_fwd += 2 * n_ctx * H * H * S + 2 * dcfg.num_hidden_layers * 2 * kv * H * S  # fc + context K/V
    lm_head = 2 * H * tcfg.vocab_size * queries
    # backward: 2x forward for the trained drafter; the frozen LM head needs input grads only (1x)
    return {"target_fwd": target, "drafter_fwd": drafter_fwd + lm_head, "backward": 2 * drafter_fwd + lm_head}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="uncompiled flex_attention: the guard must stop it")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.drafter.features import context_features
    from dflashpipe.drafter.loss import decayed_ce
    from dflashpipe.drafter.masks import block_mask, block_position_ids, build_block_inputs, dense_mask, sample_anchors
    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
    from dflashpipe.drafter.train import TrainConfig, resolve_setup, setup_attention
    from dflashpipe.hotstart import forbid_dense_flex

    cuda = a.device.startswith("cuda")
    shapes = TINY if a.tiny else QWEN3_8B
    S = 256 if a.tiny else a.seq_len
    N = 16 if a.tiny else a.anchors
    bs = a.block_size
    tcfg = Qwen3Config(**shapes, max_position_embeddings=max(4096, S + bs), tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(a.device):
        torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)
        target = Qwen3ForCausalLM(tcfg).eval().requires_grad_(False)
        torch.set_default_dtype(torch.float32)
    mask_id = tcfg.vocab_size - 1
    dcfg = DrafterConfig.from_target_config(tcfg, 5, bs, mask_id)
    drafter = DFlashDrafter(dcfg).to(a.device).train()
    cfg = TrainConfig(num_layers=5, block_size=bs, num_anchors=N, batch_size=1, compile_flex=not a.no_compile)
    setup = resolve_setup(cfg, a.device, mask_id, dcfg.target_layer_ids)
    setup_attention(setup, cfg)
    if setup.attention == "flex":
        forbid_dense_flex()
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, **({"fused": True} if cuda else {"foreach": True}))
    ids = torch.randint(0, tcfg.vocab_size - 2, (1, S), device=a.device)
    loss_mask = torch.zeros(1, S, dtype=torch.bool, device=a.device)
    loss_mask[:, S // 8 :] = True
    lm_head = target.get_output_embeddings().weight
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def step(g):
        """One training step; returns seconds per phase (events on CUDA)."""
        marks = [time.perf_counter()]
        anchors, keep = sample_anchors(loss_mask, N, bs, g)
        with torch.no_grad():
            feats = context_features(target, ids, None, dcfg.target_layer_ids)
            block_ids, labels, weights = build_block_inputs(ids, loss_mask, anchors, keep, bs, mask_id, setup.gamma)
            embeds = target.get_input_embeddings()(block_ids)
        sync()
        marks.append(time.perf_counter())
        pos = block_position_ids(anchors, S, bs)
        attn = block_mask(anchors, keep, S, bs, device=a.device) if setup.attention == "flex" else dense_mask(anchors, keep, S, bs)
        with autocast:
            hidden = drafter(embeds, feats, pos, attn)
        loss, _ = decayed_ce(hidden, lm_head, labels, weights, 1024)
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        marks.append(time.perf_counter())
        return [b - a_ for a_, b in zip(marks, marks[1:])]

    g = torch.Generator(device=a.device).manual_seed(0)
    result = {"shapes": shapes, "seq_len": S, "anchors": N, "block_size": bs, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "compiled_flex": setup.attention == "flex" and not a.no_compile}
    try:
        t0 = time.perf_counter()
        step(g)  # compile + first step
        result["first_step_s"] = time.perf_counter() - t0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = [step(g) for _ in range(a.steps)]
    except RuntimeError as err:
        result["error"] = str(err).splitlines()[0]
        print(json.dumps(result, indent=2))
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    mean = [sum(t[i] for t in times) / len(times) for i in range(4)]
    step_s = sum(mean)
    flops = model_flops(tcfg, dcfg, S, N * bs, max(dcfg.target_layer_ids))
    result.update(
        step_s=step_s,
        split_ms={k: 1000 * v for k, v in zip(["target_fwd", "drafter_fwd", "backward", "optimizer"], mean)},
        context_tokens_per_s=S / step_s,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        model_tflop_per_step=sum(flops.values()) / 1e12,
    )
    if cuda:
        peak = matmul_peak_tflops(a.device)
        result.update(matmul_peak_tflops=peak, mfu=sum(flops.values()) / step_s / 1e12 / peak)
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
