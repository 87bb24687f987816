"""The assisted-generation peer's draft: a small autoregressive Qwen3 with the target's tokenizer.

Trained on the same data the DFlash drafter sees, so the comparison is fair.
Kept apart from the decoding code so that editing one does not rerun the other.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass

import torch

from dflashpipe.errors import UserError


@dataclass
class ARDraftConfig:
    """A 1-2 layer Qwen3 causal LM with the target's tokenizer and vocabulary."""

    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_steps: int = 400
    max_minutes: float = 10.0
    seed: int = 0


def _token_lists(items, tokenizer) -> list[list[int]]:
    out = []
    for it in items:
        it = list(it)
        if it and isinstance(it[0], dict):  # a chat: list of {role, content}
            out.append(list(tokenizer.apply_chat_template([dict(t) for t in it], tokenize=True, return_dict=True)["input_ids"]))
        else:
            out.append([int(t) for t in it])
    return [t for t in out if t]


def train_ar_draft(chats_or_token_lists, target_dir: str, out_dir: str, cfg: ARDraftConfig | None = None, log=print) -> dict:
    """Train a small Qwen3 causal LM on the drafter's data; save an HF model dir (atomic) with the target's tokenizer.

    ``chats_or_token_lists``: expanded chats (lists of {role, content}) or token
    lists already encoded with the target's tokenizer (e.g. a tokenized
    dataset's ``input_ids``). Returns training metrics (also written to
    ``ar_draft_metrics.json`` in the directory).
    """
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    from dflashpipe.atomic import atomic_path
    from dflashpipe.target import load_tokenizer
    from dflashpipe.tiny_target import lr_at, pack

    cfg = cfg or ARDraftConfig()
    if not 1 <= cfg.num_layers:
        raise UserError(f"ar_draft.num_layers must be >= 1, got {cfg.num_layers}")
    tok = load_tokenizer(target_dir)
    tcfg = AutoConfig.from_pretrained(target_dir)
    tcfg = tcfg.get_text_config() if hasattr(tcfg, "get_text_config") else tcfg
    lists = _token_lists(chats_or_token_lists, tok)
    n_tokens = sum(map(len, lists))
    seq_len = min(cfg.seq_len, n_tokens // max(1, cfg.batch_size) - 1)
    if seq_len < 8:
        raise UserError(f"train_ar_draft: only {n_tokens} training tokens; need at least {9 * cfg.batch_size}")
    eos = tok.eos_token_id if tok.eos_token_id is not None else getattr(tcfg, "eos_token_id", None)
    mcfg = Qwen3Config(
        vocab_size=int(tcfg.vocab_size),  # same rows as the target: assisted generation requires it
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
        tie_word_embeddings=True,
        bos_token_id=getattr(tcfg, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(mcfg)
    rng = random.Random(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95)
    )
    windows, cursor = pack(lists, seq_len, rng), 0
    losses, t0 = [], time.time()
    model.train()
    for step in range(cfg.max_steps):
        if cursor + cfg.batch_size > len(windows):
            windows, cursor = pack(lists, seq_len, rng), 0
        batch = windows[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone(), use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            log(f"ar draft step {step + 1}: loss {loss.item():.3f}")
        if time.time() - t0 > cfg.max_minutes * 60:
            log(f"ar draft: stopping at step {step + 1}: max_minutes={cfg.max_minutes} reached")
            break
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    metrics = {
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": n_tokens,
        "steps": len(losses),
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": time.time() - t0,
    }
    if not math.isfinite(metrics["final_loss"]):
        raise UserError(f"train_ar_draft: loss is {metrics['final_loss']}; lower ar_draft.lr")
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "ar_draft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"ar draft: {metrics['parameters'] / 1e6:.2f}M parameters, {metrics['steps']} steps, loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}")
    return metrics
