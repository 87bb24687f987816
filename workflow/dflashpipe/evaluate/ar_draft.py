"""The assisted-generation peer's draft: a small autoregressive Qwen3 with the target's tokenizer.

Trained on the same data the DFlash drafter sees, so the comparison is fair.
Kept apart from the decoding code so that editing one does not rerun the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

from dflashpipe.inputs.target import check_saved_model
from dflashpipe.inputs.tiny_target import TinyTargetConfig, build_model, train_lm
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import schema_settings


@schema_settings("ar_draft")
class ARDraftConfig(TinyTargetConfig):
    """``ar_draft`` (and ``seed``), defaults the schema's: a 1-2 layer Qwen3 causal LM with the target's
    tokenizer and vocabulary. Built and trained as the tiny target is (:mod:`dflashpipe.inputs.tiny_target`); the
    fields it inherits that ``ar_draft`` lacks keep ``target.tiny``'s defaults (``vocab_size`` is ignored:
    the target's is used, and recorded in the metrics)."""

    JOB_KEYS = ("threads",)  # the job's threads

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    max_steps: int
    max_minutes: float


def _token_lists(items, tokenizer) -> list[list[int]]:
    out = []
    for it in items:
        it = list(it)
        if it and isinstance(it[0], dict):  # a chat: list of {role, content}
            out.append(list(tokenizer.apply_chat_template([dict(t) for t in it], tokenize=True, return_dict=True)["input_ids"]))
        else:
            out.append([int(t) for t in it])
    return [t for t in out if t]


def train_ar_draft(chats_or_token_lists, target_dir: str, out_dir: str, cfg: ARDraftConfig | None = None, log=print,
                   device: str = "cpu") -> dict:
    """Train a small Qwen3 causal LM on the drafter's data; save an HF model dir (atomic) with the target's tokenizer.

    ``chats_or_token_lists``: expanded chats (lists of {role, content}) or token
    lists already encoded with the target's tokenizer (e.g. a tokenized
    dataset's ``input_ids``). Returns training metrics (also written to
    ``ar_draft_metrics.json`` in the directory).
    """
    from transformers import AutoConfig

    from dflashpipe.inputs.target import load_tokenizer
    from dflashpipe.jobs.atomic import atomic_path

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
    model = build_model(
        cfg,
        tok,
        vocab_size=int(tcfg.vocab_size),  # same rows as the target: assisted generation requires it
        eos_token_id=eos,
        bos_token_id=getattr(tcfg, "bos_token_id", None),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 4096)),
    )
    run = train_lm(model.to(device), lists, replace(cfg, seq_len=seq_len), log, desc="ar draft", stop_key="ar_draft.max_minutes")
    model.to("cpu").eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    metrics = {
        "config": asdict(replace(cfg, vocab_size=int(tcfg.vocab_size), seq_len=seq_len)),  # what was built
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": n_tokens,
        **run,
    }
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        check_saved_model(tmp)
        (tmp / "ar_draft_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"ar draft: {metrics['parameters'] / 1e6:.2f}M parameters, {metrics['steps']} steps, loss {metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}")
    return metrics
