"""Drafter training throughput at Qwen3-8B shapes: context tokens/s, step split, memory, MFU.

Builds a Qwen3-8B-shaped target (36 layers, hidden 4096, GQA 32/8, head dim
128, vocab 151936; random bf16 weights: throughput does not depend on them) and
the paper's 5-layer DFlash drafter, then runs the PIPELINE'S OWN training step
(:func:`dflashpipe.drafter.train.train_step`, one rank) on S=3072 context
tokens with 512 anchors and block size 16. Numerics as in the pipeline: frozen
bf16 target, fp32 master weights and AdamW state, bf16 autocast.

Reported:

* context tokens/s from steps run back to back (no extra syncs),
* the step split, from separate steps with a CUDA sync at each phase boundary
  (``mark`` hooks of ``train_step``): target forward (embedding + the layers up
  to the deepest tapped one; no LM head), drafter forward (+ chunked LM head,
  decayed CE and the LM head's input-gradient matmul, which the fused CE does
  in its forward), backward (+ gradient all-reduce), optimiser (clip + fused AdamW),
* memory: target weights, drafter + optimiser state, and the peak of a step,
* MFU: model matmul FLOPs per step / step time / the bf16 matmul peak measured
  on the same GPU (8192^3).

``--compile`` is the pipeline's ``train.compile``: ``layers`` (default: the
drafter layers with flex_attention inside, the target layers and the loss
chunks compiled, one graph shared by all layers of a kind), ``flex`` (only
flex_attention compiled) or ``none`` (uncompiled flex_attention: the dense-flex
guard must stop the step with an error instead of materialising the scores).

    python benchmarks/train_throughput.py --out $OUT/throughput.json
    python benchmarks/train_throughput.py --compile none        # the guard, same shapes
    python benchmarks/train_throughput.py --device cpu --tiny   # smoke run of the code path

Peer measured on one H200 with torch 2.11 at these shapes (see the GPU-scale
issue): SpecForge's DFlash trainer, 10,178 context tokens/s, step 0.302 s
(target forward 104 ms, drafter forward 64 ms, backward 104 ms, optimiser 30 ms),
peak memory 46.9 GiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=10_000.0)
PHASES = ("target_forward", "drafter_forward", "backward", "optimizer")
GIB = 2**30


def matmul_peak_tflops(device: str, n: int = 8192, reps: int = 20) -> float:
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


def model_flops(tcfg, dcfg, S: int, queries: int, deepest: int, keys_per_query: float) -> dict:
    """Useful matmul FLOPs of one step: projections, MLPs, LM head, and attention over the
    keys each query may see (causal half for the target; context before the anchor plus
    its own block for the drafter, ``keys_per_query`` on average)."""
    H, I, hd = tcfg.hidden_size, tcfg.intermediate_size, tcfg.head_dim
    q, kv = tcfg.num_attention_heads * hd, tcfg.num_key_value_heads * hd
    layer_params = H * (q + 2 * kv) + q * H + 3 * H * I
    target = 2 * (deepest + 1) * (layer_params * S + 2 * S * S * q / 2)  # causal: half the scores
    n_ctx = len(dcfg.target_layer_ids)
    drafter_fwd = dcfg.num_hidden_layers * (2 * layer_params * queries + 2 * 2 * queries * keys_per_query * q)
    drafter_fwd += 2 * n_ctx * H * H * S + 2 * dcfg.num_hidden_layers * 2 * kv * H * S  # fc + context K/V
    lm_head = 2 * H * tcfg.vocab_size * queries
    # backward: 2x forward for the trained drafter; the frozen LM head needs input grads only (1x)
    return {"target_fwd": target, "drafter_fwd": drafter_fwd + lm_head, "backward": 2 * drafter_fwd + lm_head}


def build_target(shapes: dict, S: int, bs: int, device: str):
    """A randomly initialised Qwen3 of the given shapes, frozen, bf16 on CUDA (fp32 on CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tcfg = Qwen3Config(**shapes, max_position_embeddings=max(4096, S + bs), tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        try:
            target = Qwen3ForCausalLM(tcfg).eval().requires_grad_(False)
        finally:
            torch.set_default_dtype(torch.float32)
    return target, tcfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5, help="drafter layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", default="layers", choices=["layers", "flex", "none"], help="the pipeline's train.compile")
    p.add_argument("--no-compile", action="store_true", help="same as --compile none")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="write a torch.profiler table of 3 steps to this file")
    a = p.parse_args(argv)
    if a.no_compile:
        a.compile = "none"

    from dflashpipe.drafter.features import trim_unused_layers
    from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
    from dflashpipe.drafter.train import TrainConfig, _resolve_device, init_dist, make_batch, resolve_setup, setup_attention, train_step

    cuda = a.device.startswith("cuda")
    shapes = TINY if a.tiny else QWEN3_8B
    S = 256 if a.tiny else a.seq_len
    N = 16 if a.tiny else a.anchors
    bs = a.block_size
    dev = _resolve_device(a.device)
    init_dist(f"file://{tempfile.mkdtemp()}/rdzv", 0, 1, dev, 120)

    target, tcfg = build_target(shapes, S, bs, a.device)
    mask_id = tcfg.vocab_size - 1
    dcfg = DrafterConfig.from_target_config(tcfg, a.layers, bs, mask_id)
    cfg = TrainConfig(num_layers=a.layers, block_size=bs, num_anchors=N, batch_size=1, compile=a.compile)
    setup = resolve_setup(cfg, a.device, mask_id, dcfg.target_layer_ids)
    dropped = trim_unused_layers(target, dcfg.target_layer_ids)
    setup_attention(setup, cfg)  # on the flex path: dense flex_attention calls raise
    mem = {}
    if cuda:
        torch.cuda.empty_cache()
        mem["target_gib"] = torch.cuda.memory_allocated() / GIB
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg).to(dev).train()  # fp32 master weights, as the pipeline
    opt = torch.optim.AdamW(drafter.parameters(), lr=6e-4, **({"fused": True} if cuda else {"foreach": True}))

    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": [torch.randint(0, tcfg.vocab_size - 2, (S,), generator=g).tolist()],
            "loss_mask": [[0] * (S // 8) + [1] * (S - S // 8)]}

    def batch(step: int):
        return make_batch(rows, S, [step], 0, setup)  # anchors re-sampled per step, as in training

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result = {"shapes": shapes, "seq_len": S, "anchors": N, "block_size": bs, "drafter_layers": a.layers,
              "target_layers_run": max(dcfg.target_layer_ids) + 1, "target_layers_dropped": dropped,
              "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "compile": a.compile if setup.attention == "flex" else "none (sdpa)"}
    try:
        t0 = time.perf_counter()
        train_step(drafter, target, opt, batch(0), 6e-4, setup)  # compile + first step (allocates AdamW state)
        sync()
        result["first_step_s"] = time.perf_counter() - t0
        train_step(drafter, target, opt, batch(1), 6e-4, setup)
        if cuda:
            sync()
            mem["after_step_gib"] = torch.cuda.memory_allocated() / GIB  # target + drafter + grads + AdamW
            torch.cuda.reset_peak_memory_stats()
        # throughput: back to back, only the step's own host syncs
        batches = [batch(2 + i) for i in range(a.steps)]
        sync()
        t0 = time.perf_counter()
        for b in batches:
            train_step(drafter, target, opt, b, 6e-4, setup)
        sync()
        step_s = (time.perf_counter() - t0) / a.steps
        if cuda:
            mem["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            mem["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        # split: the same steps with a sync at every phase boundary
        split = {k: 0.0 for k in PHASES}
        for b in batches:
            sync()
            last = [time.perf_counter()]

            def mark(phase, last=last):
                sync()
                now = time.perf_counter()
                split[phase] += now - last[0]
                last[0] = now

            train_step(drafter, target, opt, b, 6e-4, setup, mark=mark)
        if a.profile:
            write_profile(a.profile, lambda: [train_step(drafter, target, opt, b, 6e-4, setup) for b in batches[:3]], cuda)
    except RuntimeError as err:
        result["error"] = str(err).strip().splitlines()[0]
        result["memory"] = mem
        return finish(result, a.out)
    kept = [b.anchors[b.keep].float() for b in batches]
    keys_per_query = float(torch.cat(kept).mean()) + bs  # context before the anchor + the block
    flops = model_flops(tcfg, dcfg, S, N * bs, max(dcfg.target_layer_ids), keys_per_query)
    from torch._dynamo.utils import counters

    result["compiled_graphs"] = counters["stats"].get("unique_graphs", 0)
    result.update(
        step_s=step_s,
        context_tokens_per_s=S / step_s,
        split_ms={k: 1000 * v / a.steps for k, v in split.items()},
        split_sum_ms=1000 * sum(split.values()) / a.steps,
        memory=mem,
        drafter_keys_per_query=keys_per_query,
        model_tflop_per_step=sum(flops.values()) / 1e12,
        tflop_per_phase={k: v / 1e12 for k, v in flops.items()},
    )
    if cuda:
        peak = matmul_peak_tflops(a.device)
        result.update(matmul_peak_tflops=peak, mfu=sum(flops.values()) / step_s / 1e12 / peak)
    return finish(result, a.out)


def write_profile(path: str, run, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=45, max_name_column_width=90) + "\n")


def finish(result: dict, out: str | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
