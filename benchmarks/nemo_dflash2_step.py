"""NVIDIA NeMo AutoModel's DFlash 2 training step at train_throughput.py's shapes: tokens/s, step split, memory.

Measures a peer's DFlash 2 trainer, the public ``nemo-automodel`` package (0.7.0 on PyPI), on one
GPU at the shapes of ``benchmarks/train_throughput.py``: a Qwen3-8B-shaped target (36 layers, hidden
4096, GQA 32/8, head dim 128, vocab 151936; random bf16 weights, frozen; that script's
``build_target``), NeMo's 5-layer ``Qwen3DFlash2DraftModel``, S=3072 context tokens, blocks of 16.
``--anchors 512 --batch 1`` (the default) is our step's shape; ``--anchors 256 --batch 2`` is the
peer's own ``examples/speculative/dflash/qwen3_dflash2.yaml`` (``num_anchors: 256``,
``micro_batch_size: 2``).

What runs is NeMo's code, assembled as its ``TrainDFlash2Recipe`` (``recipes/llm/train_dflash2.py``
on top of ``train_dflash.py``) assembles it for a Qwen3 target, only without the config/data/
checkpoint plane (that module itself is not imported: it needs torchao):

* the draft class and config builder from ``resolve_dflash_draft_spec`` (``draft2_cls``,
  ``build_qwen3_dflash_draft_config``), layer taps from its ``build_target_layer_ids``, the
  ``dflash_config`` with the yaml's DFlash 2 fields (conv 2 taps / group 16, selector rank 256,
  top-k 16); the draft in the recipe's compute dtype (bf16 on CUDA, fp32 on CPU), no autocast,
* ``DFlash2TrainerModule`` (anchor sampling, DFlash mask, draft, full LM head, decay-weighted block
  CE with gamma 7 + selector CE, weight 1.0), target capture by ``HFDFlashTargetModel``,
* ``torch.optim.AdamW`` over the bf16 draft (lr 6e-4, betas 0.9/0.95, no weight decay: the AdamW
  state is bf16 too) and the recipe's ``make_warmup_cosine_schedule``,
* one step = the recipe's loop body (grad accumulation 1): ``generate_batch`` -> trainer forward ->
  ``loss.backward()`` -> its metric bookkeeping (``.item()`` of loss, accuracy and the DFlash 2
  window sums) -> ``clip_grad_norm_(1.0)``, ``optimizer.step()``, ``zero_grad(set_to_none)``,
  scheduler step.

Attention: ``flex_attention`` on CUDA (the yaml's), ``sdpa`` on CPU (flex has no CPU backward).
The yaml sets no ``compile:`` block and no activation checkpointing, so neither is applied.

The target is the one part that is not NeMo's class: the recipe loads Qwen3 through
``NeMoAutoModelForCausalLM``, i.e. NeMo's ``components/models/qwen3`` ``Qwen3ForCausalLM``, whose
layers are HF's Qwen3 decoder layers with HF's attention interface on plain (unpacked) batches
(its TE path is for packed THD input only). Here it is transformers' Qwen3 from ``build_target``
(sdpa, as HF auto-selects without flash-attn), run by NeMo's ``HFDFlashTargetModel``: hooks on the
tapped layers, all 36 layers and the LM head over all positions, as the recipe runs it.

Per run: context tokens/s (B*S per step) from ``--steps`` steps back to back after ``--warmup``
steps (the first compiles flex_attention and the block-mask builder), then the step split from the
same number of separate steps with a sync at each phase boundary: target forward
(``generate_batch``), drafter forward (trainer forward: anchors, mask, draft, LM head, both
losses), backward, step_metrics (the recipe's ``.item()`` bookkeeping), optimiser (clip, AdamW,
scheduler); peak memory from the back-to-back steps.

Wheels: ``benchmarks/gpu_peer_dflash2.sh`` (its header lists them). From the repo root:

    PYTHONPATH=/tmp/site python3 benchmarks/nemo_dflash2_step.py --out $OUT/nemo.json        # ours: 512 x 1
    PYTHONPATH=/tmp/site python3 benchmarks/nemo_dflash2_step.py --anchors 256 --batch 2     # the peer's yaml
    python3 benchmarks/nemo_dflash2_step.py --device cpu --tiny                              # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from specforge_step import package_version, time_steps  # noqa: E402
from train_throughput import GIB, QWEN3_8B, TINY, build_target, finish  # noqa: E402

# the DFlash 2 metrics the recipe reads back with float() each step (loss, accuracy, window sums)
BOOKKEEPING = ("loss", "accuracy", "accept_len_sum", "valid_blocks", "base_loss", "selector_loss",
               "base_correct_tokens", "valid_tokens", "base_accept_len_sum", "candidate_recall")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, 2 steps (CPU smoke run)")
    p.add_argument("--seq-len", type=int, default=3072, help="recipe_args.seq_length")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (recipe_args.micro_batch_size)")
    p.add_argument("--anchors", type=int, default=512, help="recipe_args.num_anchors")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5, help="recipe_args.draft_num_hidden_layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention", default=None, choices=["flex_attention", "sdpa", "eager"],
                   help="recipe_args.attention_backend (default: flex_attention on CUDA, sdpa on CPU)")
    p.add_argument("--gamma", type=float, default=7.0, help="recipe_args.loss_decay_gamma")
    p.add_argument("--selector-rank", type=int, default=256)
    p.add_argument("--selector-top-k", type=int, default=16)
    p.add_argument("--selector-weight", type=float, default=1.0, help="recipe_args.selector_loss_weight")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    cuda = a.device.startswith("cuda")
    attention = a.attention or ("flex_attention" if cuda else "sdpa")
    shapes = TINY if a.tiny else QWEN3_8B
    S = 256 if a.tiny else a.seq_len
    N = 16 if a.tiny else a.anchors
    B, bs = a.batch, a.block_size
    layers = min(a.layers, 2) if a.tiny else a.layers  # TINY's 6 target layers give 2 distinct taps
    steps = min(a.steps, 2) if a.tiny else a.steps
    dev = torch.device(a.device)
    if cuda:
        torch.cuda.set_device(dev.index or 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from nemo_automodel.components.speculative.dflash.dflash2_core import DFlash2TrainerModule
    from nemo_automodel.components.speculative.dflash.draft_qwen3 import build_target_layer_ids
    from nemo_automodel.components.speculative.dflash.registry import resolve_dflash_draft_spec
    from nemo_automodel.components.speculative.dflash.target import HFDFlashTargetModel
    from nemo_automodel.recipes.llm._spec_train_utils import make_warmup_cosine_schedule

    # the frozen target: bf16 on CUDA, fp32 on CPU (also the recipe's compute_dtype rule)
    target, tcfg = build_target(shapes, S, bs, str(dev))
    dtype = next(target.parameters()).dtype
    mask_id = tcfg.vocab_size - 1
    mem = {}
    if cuda:
        torch.cuda.empty_cache()
        mem["target_gib"] = torch.cuda.memory_allocated() / GIB

    # the draft as TrainDFlash2Recipe.setup builds it for a Qwen3 target
    spec = resolve_dflash_draft_spec(["Qwen3ForCausalLM"])
    layer_ids = build_target_layer_ids(tcfg.num_hidden_layers, layers)
    dflash_config = {"block_size": bs, "mask_token_id": mask_id, "target_layer_ids": layer_ids,
                     "output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0,
                     "conv_kernel_size": 2, "conv_group_size": 16,
                     "selector_rank": a.selector_rank, "selector_top_k": a.selector_top_k}
    dcfg = spec.build_draft_config(tcfg, num_draft_layers=layers, num_target_layers=tcfg.num_hidden_layers,
                                   block_size=bs, dflash_config=dflash_config, attention_backend=attention)
    torch.manual_seed(0)
    with torch.device(dev):  # the recipe builds on the host, then moves: same module, faster here
        draft = spec.draft2_cls(dcfg)
    draft = draft.to(device=dev, dtype=dtype)
    trainer = DFlash2TrainerModule(
        draft_model=draft, target_lm_head=target.get_output_embeddings(),
        target_embed_tokens=target.get_input_embeddings(), mask_token_id=mask_id, block_size=bs,
        attention_backend=attention, num_anchors=N, loss_decay_gamma=a.gamma,
        selector_loss_weight=a.selector_weight).to(dev)
    trainer.train()
    capture = HFDFlashTargetModel(target, target_layer_ids=layer_ids)
    opt = torch.optim.AdamW([q for q in trainer.parameters() if q.requires_grad], lr=a.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_warmup_cosine_schedule(40, 1000, 0.1))  # warmup 0.04

    g = torch.Generator().manual_seed(0)
    attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
    loss_mask = torch.tensor([[0.0] * (S // 8) + [1.0] * (S - S // 8)] * B, device=dev)
    clock: list = [None]  # the Clock of a split step, else None

    def mark(phase):
        if clock[0] is not None:
            clock[0].mark(phase)

    def step(input_ids):
        b = capture.generate_batch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)
        mark("target_forward")
        m = trainer(input_ids=b.input_ids, hidden_states=b.hidden_states, loss_mask=b.loss_mask)
        mark("drafter_forward")
        m.loss.backward()
        mark("backward")
        [getattr(m, k).detach().item() for k in BOOKKEEPING]
        mark("step_metrics")
        norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        mark("optimizer")
        return m, norm

    n_draft = sum(q.numel() for q in draft.parameters())
    result = {
        "trainer": "nemo_automodel DFlash 2 (DFlash2TrainerModule + HFDFlashTargetModel + torch AdamW, "
                   "TrainDFlash2Recipe's loop body)",
        "nemo_automodel": package_version("nemo-automodel"), "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "shapes": shapes, "seq_len": S, "micro_batch": B, "anchors": N, "block_size": bs, "drafter_layers": layers,
        "drafter_params": n_draft, "selector_params": sum(q.numel() for q in draft.candidate_selector.parameters()),
        "target_layer_ids": layer_ids,
        "knobs": {"attention_backend": attention, "precision": f"{dtype} params, grads and AdamW state; no autocast",
                  "target_attn_implementation": tcfg._attn_implementation, "compile": None,
                  "activation_checkpointing": False, "loss_decay_gamma": a.gamma,
                  "selector": {"rank": a.selector_rank, "top_k": a.selector_top_k, "loss_weight": a.selector_weight},
                  "conv": {"kernel_size": 2, "group_size": 16},
                  "optimizer": "torch.optim.AdamW (defaults: foreach), betas (0.9, 0.95), weight decay 0, clip 1.0, "
                               "warmup-cosine schedule",
                  "lr": a.lr, "target_call": "HFDFlashTargetModel.generate_batch: all layers + LM head",
                  "warmup_steps": a.warmup, "steps": steps},
    }
    try:
        t0 = time.perf_counter()
        m, norm = step(torch.randint(0, tcfg.vocab_size - 2, (B, S), generator=g).to(dev))  # compiles flex
        sync()
        result["first_step_s"] = time.perf_counter() - t0
        for _ in range(a.warmup - 1):
            m, norm = step(torch.randint(0, tcfg.vocab_size - 2, (B, S), generator=g).to(dev))
        sync()
        if cuda:
            mem["after_step_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        ids = [torch.randint(0, tcfg.vocab_size - 2, (B, S), generator=g).to(dev) for _ in range(steps)]
        step_s, split, (m, norm) = time_steps(step, ids, sync, clock, mem, cuda)
    except RuntimeError as err:  # torch.OutOfMemoryError included
        result["error"] = str(err).strip().splitlines()[0]
        result["memory"] = mem
        finish(result, a.out)
        return 1
    result.update(
        step_s=step_s,
        context_tokens_per_s=B * S / step_s,
        split_ms=split,
        split_sum_ms=sum(split.values()),
        memory=mem,
        last_step={"loss": float(m.loss.detach()), "base_loss": float(m.base_loss), "selector_loss": float(m.selector_loss),
                   "accuracy": float(m.accuracy), "base_accuracy": float(m.base_accuracy),
                   "candidate_recall": float(m.candidate_recall), "grad_norm": float(norm)},
    )
    return finish(result, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
