"""SpecForge's own DFlash training step at train_throughput.py's shapes: tokens/s, step split, memory.

Measures the peer trainer, the public ``specforge`` package (0.2.0 on PyPI), on one GPU at the
shapes of ``benchmarks/train_throughput.py``'s default: a Qwen3-8B-shaped target (36 layers,
hidden 4096, GQA 32/8, head dim 128, vocab 151936; random bf16 weights, frozen; that script's
``build_target``), SpecForge's 5-layer ``DFlashDraftModel``, S=3072 context tokens, one sequence
per step, 512 anchors (SpecForge's ``training.num_anchors``), block size 16.

What runs is SpecForge's code, assembled as its trainer assembles it (``specforge/training/
trainer.py``, ``algorithms/model_providers.py``), only without the config/CLI/data plane:

* ``specforge.distributed.init_distributed`` (one rank), ``DFlashDraftModel`` built through its
  ``AutoDraftModel.from_config`` (layers' target taps from its ``build_target_layer_ids``),
  wrapped in its ``OnlineDFlashModel`` (anchor sampling, DFlash mask, chunked checkpointed LM
  head + CE, ``objective_chunk_blocks`` 128) with the frozen target embedding and LM head,
* its ``FSDPTrainingBackend`` (FSDP1, SHARD_GRAD_OP, bf16 MixedPrecision; the frozen
  embedding/head left out) and ``BF16Optimizer`` (fp32 master copies, AdamW, clip 0.5, cosine
  warm-up schedule) as the optimizer factory,
* one step = its ``TrainerCore.train_step`` on a ``TrainBatch``: ``DFlashTrainStrategy.
  forward_loss`` -> ``backend.backward`` -> gradient scaling by the loss denominator ->
  ``backend.step``.

Numerics are SpecForge's defaults (``model.torch_dtype: bfloat16``): bf16 drafter parameters and
activations (no autocast), fp32 masters and AdamW moments in the optimizer; attention
``training.attention_backend: flex_attention`` (transformers' compiled flex_attention with
SpecForge's DFlash BlockMask).

The target forward is the one part that is not SpecForge's: 0.2.0 captures target hidden states
only on an external SGLang server (``model.target_backend: sglang``; the in-process HF backend was
removed), and SGLang cannot travel here. The target runs in-process instead, as transformers'
Qwen3 with ``output_hidden_states=True`` and no KV cache, and SpecForge's
``extract_context_feature`` concatenates the tapped layers. ``--target-call model`` (default):
all 36 layers, no LM head (what the capture server hands the trainer); ``causal_lm``: also the LM
head over all S positions (transformers' default ``forward``).

Nothing is stubbed: the modules imported (``specforge.modeling.draft``, ``specforge.algorithms.
common.dflash_family_model``, ``specforge.training.{backend,controller,strategies.base}``,
``specforge.optimizer``, ``specforge.distributed``, ``specforge.runtime.contracts``) need only
torch, transformers, huggingface_hub and safetensors, so the one wheel ``specforge`` is installed
without its dependencies (sglang, yunchang, wandb, ... are imported lazily by code not run here).

Per run: context tokens/s from 20 steps back to back (after 2 warm-up steps, the first of which
compiles flex_attention), then the step split from 20 separate steps with a CUDA sync at each
phase boundary: target forward (+ ``extract_context_feature``), drafter forward (``forward_loss``:
anchors, mask, drafter, chunked LM head + CE), backward (recomputes the checkpointed LM-head
chunks), optimiser (loss-denominator gradient scaling with its ``.item()``, clip, AdamW on fp32
masters, copy back to bf16), and ``step_metrics`` (TrainerCore's metric reductions after the
optimizer step); peak memory from the back-to-back steps.

Wheels (fetched on a machine with a package index; pure-python):

    pip download --no-deps specforge==0.2.0 -d .whl/specforge

On the GPU (torch 2.11, transformers 5.x; from the repo root):

    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/specforge/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/specforge_step.py --out $OUT/specforge_step.json
    PYTHONPATH=/tmp/site python3 benchmarks/specforge_step.py --device cpu --tiny   # smoke run, 2 steps

The CPU smoke run takes SpecForge's ``sdpa`` backend (its dense DFlash mask; flex_attention has
no CPU backward) and ``NO_SHARD``, i.e. SpecForge's DDP wrapper (FSDP1 needs an accelerator);
the flex_attention step and the FSDP wrapper run only on the GPU.

Peer figures to re-measure (one H200, torch 2.11, same shapes): 10,178-10,303 context tokens/s,
step 0.302 s (target forward 104 ms, drafter forward 64 ms, backward 104 ms, optimiser 30 ms),
peak memory 46.9 GiB.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from train_throughput import GIB, PHASES, QWEN3_8B, TINY, build_target, finish  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


class Clock:
    """Phase times of one step: ``mark(phase)`` syncs and books the time since the last mark."""

    def __init__(self, sync):
        self.sync = sync
        self.split = {k: 0.0 for k in (*PHASES, "step_metrics")}
        self.last = None

    def start(self):
        self.sync()
        self.last = time.perf_counter()

    def mark(self, phase: str):
        self.sync()
        now = time.perf_counter()
        self.split[phase] += now - self.last
        self.last = now


def time_steps(step, ids: list, sync, clock: list, mem: dict, cuda: bool):
    """A peer's steps timed as train_throughput times ours: ``step(x)`` over ``ids`` back to back (only the
    peer's own host syncs; the peak memory into ``mem``), then again, each step split at the phase marks
    ``step`` books into ``clock[0]``. Returns (seconds a step, {phase: ms a step}, the last step's result)."""
    steps = len(ids)
    sync()
    t0 = time.perf_counter()
    for x in ids:
        last = step(x)
    sync()
    step_s = (time.perf_counter() - t0) / steps
    if cuda:
        mem["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        mem["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    c = Clock(sync)
    clock[0] = c
    for x in ids:
        c.start()
        step(x)
    clock[0] = None
    return step_s, {k: 1000 * v / steps for k, v in c.split.items()}, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 2 steps (CPU smoke run)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512, help="SpecForge's training.num_anchors")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5, help="drafter layers (model.draft_num_hidden_layers)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention", default=None, choices=["flex_attention", "sdpa", "eager"],
                   help="training.attention_backend (default: flex_attention on CUDA, sdpa on CPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model.torch_dtype")
    p.add_argument("--sharding", default=None, choices=["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"],
                   help="training.fsdp_sharding (default SHARD_GRAD_OP: FSDP; NO_SHARD: SpecForge wraps in DDP "
                        "instead; the CPU default, FSDP1 needs an accelerator)")
    p.add_argument("--no-wrap", action="store_true", help="no FSDP/DDP wrapper (not what SpecForge's trainer does)")
    p.add_argument("--objective-chunk-blocks", type=int, default=128, help="training.objective_chunk_blocks")
    p.add_argument("--lr", type=float, default=1e-4, help="training.learning_rate (SpecForge default)")
    p.add_argument("--target-call", default="model", choices=["model", "causal_lm"],
                   help="model: the target's layers only; causal_lm: plus its LM head over all positions")
    p.add_argument("--share-head", action="store_true",
                   help="give the drafter the target's own embedding/LM head modules instead of copies "
                        "(SpecForge's trainer loads its own copies: TargetEmbeddingsAndHead)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    cuda = a.device.startswith("cuda")
    attention = a.attention or ("flex_attention" if cuda else "sdpa")
    sharding = a.sharding or ("SHARD_GRAD_OP" if cuda else "NO_SHARD")
    shapes = TINY if a.tiny else QWEN3_8B
    S = 256 if a.tiny else a.seq_len
    N = 16 if a.tiny else a.anchors
    bs = a.block_size
    steps = min(a.steps, 2) if a.tiny else a.steps
    dtype = getattr(torch, a.dtype)

    # one-rank process group, as SpecForge's CLI sets it up under torchrun
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    os.environ["SPECFORGE_DEVICE"] = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(torch.device(a.device).index or 0)
    dev = torch.device(a.device if cuda else "cpu")

    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.distributed import destroy_distributed, init_distributed
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.draft.dflash import build_target_layer_ids, extract_context_feature
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import DFlashTrainStrategy
    from transformers import Qwen3Config

    init_distributed(timeout=10)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # the frozen target (train_throughput.py's builder), in SpecForge's dtype on either device
    target, tcfg = build_target(shapes, S, bs, str(dev))
    target = target.to(dtype)
    mask_id = tcfg.vocab_size - 1
    mem = {}
    if cuda:
        torch.cuda.empty_cache()
        mem["target_gib"] = torch.cuda.memory_allocated() / GIB

    # the draft config as SpecForge derives it from the target (populate_dflash_generated_config
    # + apply_dflash_overrides with model.draft_num_hidden_layers) and its draft builder
    layer_ids = build_target_layer_ids(tcfg.num_hidden_layers, a.layers)
    dcfg = Qwen3Config(**{**shapes, "num_hidden_layers": a.layers}, max_position_embeddings=max(4096, S + bs),
                       tie_word_embeddings=False, layer_types=["full_attention"] * a.layers,
                       use_sliding_window=False, sliding_window=None)
    dcfg.architectures = ["DFlashDraftModel"]
    dcfg.num_target_layers = tcfg.num_hidden_layers
    dcfg.block_size = bs
    dcfg.dflash_config = {"target_layer_ids": layer_ids, "mask_token_id": mask_id}
    dcfg._attn_implementation = attention
    torch.manual_seed(0)
    with torch.device(dev):
        draft = AutoDraftModel.from_config(dcfg, torch_dtype=dtype)
    draft = draft.to(device=dev, dtype=dtype)
    draft.mask_token_id = mask_id
    embed = target.model.embed_tokens if a.share_head else copy.deepcopy(target.model.embed_tokens)
    head = target.lm_head if a.share_head else copy.deepcopy(target.lm_head)
    model = OnlineDFlashModel(draft_model=draft, target_lm_head=head, target_embed_tokens=embed,
                              mask_token_id=mask_id, block_size=bs, attention_backend=attention, num_anchors=N,
                              loss_decay_gamma=None, objective_chunk_blocks=a.objective_chunk_blocks,
                              loss_type="dflash").to(device=dev, dtype=dtype)
    # SpecForge's frozen target tables (TargetEmbeddingsAndHead loads them with requires_grad False)
    model.lm_head.requires_grad_(False)
    model.embed_tokens.requires_grad_(False)
    model.train()

    def make_optimizer(module):
        return BF16Optimizer(module, lr=a.lr, max_grad_norm=0.5, total_steps=1000, warmup_ratio=0.015,
                             lr_scheduler="cosine")

    parallel = ParallelConfig.from_distributed(sharding_strategy=sharding)
    backend = FSDPTrainingBackend(parallel, optimizer_factory=make_optimizer)
    wrapped = backend.prepare_model(model, wrap=not a.no_wrap, optimizer_target=model.draft_model)
    strategy = DFlashTrainStrategy(wrapped)
    core = TrainerCore(strategy, backend, accumulation_steps=1)

    # phase marks around SpecForge's own calls (only set while the split is measured)
    clock: list[Clock | None] = [None]

    def marked(fn, phase):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if clock[0] is not None:
                clock[0].mark(phase)
            return out
        return call

    strategy.forward_loss = marked(strategy.forward_loss, "drafter_forward")
    backend.backward = marked(backend.backward, "backward")
    backend.step = marked(backend.step, "optimizer")  # after the gradient scaling of TrainerCore

    g = torch.Generator().manual_seed(0)
    loss_mask = torch.tensor([[0.0] * (S // 8) + [1.0] * (S - S // 8)], device=dev)

    def inputs():
        return torch.randint(0, tcfg.vocab_size - 2, (1, S), generator=g).to(dev)

    body = target.model if a.target_call == "model" else target

    def step(input_ids):
        with torch.no_grad():
            out = body(input_ids=input_ids, output_hidden_states=True, use_cache=False)
            hidden = extract_context_feature(list(out.hidden_states), layer_ids)
        del out
        if clock[0] is not None:
            clock[0].mark("target_forward")
        batch = TrainBatch(sample_ids=["0"], strategy="dflash",
                           tensors={"input_ids": input_ids, "hidden_states": hidden, "loss_mask": loss_mask})
        r = core.train_step(batch)
        if clock[0] is not None:
            clock[0].mark("step_metrics")  # TrainerCore's metric reductions after the optimizer step
        return r

    n_draft = sum(p.numel() for p in draft.parameters())
    result = {
        "trainer": "specforge DFlash (TrainerCore + DFlashTrainStrategy + FSDPTrainingBackend + BF16Optimizer)",
        "specforge": package_version("specforge"), "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "shapes": shapes, "seq_len": S, "anchors": N, "block_size": bs, "drafter_layers": a.layers,
        "drafter_params": n_draft, "target_layer_ids": list(draft.target_layer_ids),
        "knobs": {"attention_backend": attention, "torch_dtype": a.dtype, "autocast": False,
                  "wrapper": "none" if a.no_wrap else backend._wrapper_kind, "fsdp_sharding": parallel.sharding_strategy,
                  "objective_chunk_blocks": a.objective_chunk_blocks, "loss_type": "dflash", "loss_decay_gamma": None,
                  "optimizer": "BF16Optimizer: fp32 masters, torch AdamW (defaults), clip 0.5, cosine warm-up",
                  "lr": a.lr, "target_call": a.target_call, "target_layers_run": tcfg.num_hidden_layers,
                  "embed_and_head": "shared with the target" if a.share_head else "own copies (as SpecForge)",
                  "warmup_steps": a.warmup, "steps": steps},
    }
    try:
        t0 = time.perf_counter()
        r = step(inputs())  # compiles flex_attention, allocates the AdamW state
        sync()
        result["first_step_s"] = time.perf_counter() - t0
        for _ in range(a.warmup - 1):
            r = step(inputs())
        sync()
        if cuda:
            mem["after_step_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        step_s, split, r = time_steps(step, [inputs() for _ in range(steps)], sync, clock, mem, cuda)
    except RuntimeError as err:
        result["error"] = str(err).strip().splitlines()[0]
        result["memory"] = mem
        finish(result, a.out)
        return 1
    finally:
        destroy_distributed()
    result.update(
        step_s=step_s,
        context_tokens_per_s=S / step_s,
        split_ms=split,
        split_sum_ms=sum(split.values()),
        memory=mem,
        last_step={"loss": float(r.loss), "grad_norm": None if r.grad_norm is None else float(r.grad_norm),
                   "accuracy": float(r.metrics["acc"]) if "acc" in r.metrics else None},
    )
    return finish(result, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
