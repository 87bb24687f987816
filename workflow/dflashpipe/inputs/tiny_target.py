"""The embedded default target: a tiny Qwen3 causal LM trained here on the shipped chats.

No hub access exists at run time, so when the config names no target checkpoint
the pipeline makes its own: a byte-level BPE tokenizer trained with
``tokenizers`` on the training chats, a ChatML chat template, and a small
``Qwen3ForCausalLM`` trained on packed chat text. The result is an ordinary HF
model directory that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import asdict
from typing import ClassVar

import torch

from dflashpipe.inputs.target import check_saved_model, prompt_text
from dflashpipe.jobs.atomic import atomic_path, write_json
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import schema_settings

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

# ChatML, as Qwen uses it. The generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ANSWER_RE = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")


@schema_settings("target.tiny")
class TinyTargetConfig:
    """``target.tiny`` (and ``seed``). Defaults: the schema's."""

    JOB_KEYS = ("threads", "train_datasets", "heldout_dataset")  # the job's threads; the rule's inputs
    # the schedule's constants (not config keys)
    min_lr_ratio: ClassVar[float] = 0.1
    weight_decay: ClassVar[float] = 0.1

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int  # packing window
    batch_size: int
    lr: float
    warmup_steps: int
    max_steps: int
    max_minutes: float  # stop early (and say so) if the machine is slow
    eval_every: int
    eval_rows: int  # held-out chats for the loss
    format_check_prompts: int  # held-out prompts for the `#### N` check
    seed: int


def chat_text(turns: list[dict]) -> str:
    return "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with ChatML special tokens, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=4096,
    )


def build_model(cfg: TinyTargetConfig, tokenizer, vocab_size: int | None = None, eos_token_id: int | None = None,
                bos_token_id: int | None = None, max_position_embeddings: int = 4096):
    """A randomly initialised Qwen3 of ``cfg``'s shapes (seeded), with ``tokenizer``'s special ids.

    ``vocab_size`` defaults to the tokenizer's; a draft for assisted generation
    passes the target's so both have the same embedding rows.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    mcfg = Qwen3Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos_token_id,
        eos_token_id=tokenizer.eos_token_id if eos_token_id is None else eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(mcfg)


def pack(token_lists: list[list[int]], seq_len: int, rng: random.Random) -> torch.Tensor:
    """Shuffle chats, concatenate them, cut into [n, seq_len + 1] windows (inputs + shifted labels)."""
    order = list(range(len(token_lists)))
    rng.shuffle(order)
    stream = [t for i in order for t in token_lists[i]]
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)


def lr_at(step: int, cfg: TinyTargetConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@torch.no_grad()
def heldout_loss(model, tokenizer, chats: list[list[dict]]) -> dict:
    """Mean next-token loss over held-out chats: all tokens, and assistant tokens only."""
    model.eval()
    tot, n, tot_a, n_a = 0.0, 0, 0.0, 0
    for turns in chats:
        ids = tokenizer(chat_text(turns))["input_ids"]
        n_prompt = len(tokenizer(chat_text(turns[:-1]) + "<|im_start|>assistant\n")["input_ids"])
        x = torch.tensor([ids], device=model.device)
        logits = model(x).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
        tot += nll.sum().item()
        n += nll.numel()
        tot_a += nll[n_prompt - 1 :].sum().item()
        n_a += nll[n_prompt - 1 :].numel()
    model.train()
    return {"loss_all_tokens": tot / n, "loss_assistant_tokens": tot_a / n_a}


@torch.no_grad()
def format_check(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int = 384, batch_size: int = 25) -> dict:
    """Greedy answers to held-out math prompts: share ending in a well-formed `#### <number>`."""
    model.eval()
    ok, outs = 0, []
    for i in range(0, len(prompts), batch_size):
        batch = [prompt_text(tokenizer, p) for p in prompts[i : i + batch_size]]
        enc = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for row in gen[:, enc["input_ids"].shape[1] :]:
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            outs.append(text)
            ok += bool(ANSWER_RE.search(text))
    model.train()
    return {"format_ok": ok / max(1, len(prompts)), "n_prompts": len(prompts), "examples": outs[:3]}


def train_lm(model, token_lists: list[list[int]], cfg: TinyTargetConfig, log=print, evaluate=None, desc: str = "lm",
             stop_key: str = "max_minutes") -> dict:
    """Packed next-token training of a causal LM, read top to bottom.

    AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then
    cosine to ``min_lr_ratio``, grad clip 1.0; runs ``max_steps`` steps.
    ``max_minutes`` is a safety stop: reaching it FAILS the job with one line
    naming ``stop_key`` (a model cut short by the clock would depend on the
    machine's load, so it is never passed on as a result). ``evaluate()``
    (optional) is called every ``eval_every`` steps and at the end; its dict
    joins the returned curve.
    """
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    device = next(model.parameters()).device  # batches follow the model (CPU or a leased GPU)
    windows, cursor, epoch, tokens_seen = pack(token_lists, cfg.seq_len, rng), 0, 0, 0
    curve, losses = [], []
    t0 = time.time()
    model.train()
    bar = tqdm(range(cfg.max_steps), desc=desc, mininterval=10)
    for step in bar:
        if cursor + cfg.batch_size > len(windows):
            windows, cursor, epoch = pack(token_lists, cfg.seq_len, rng), 0, epoch + 1
        batch = windows[cursor : cursor + cfg.batch_size].to(device)
        cursor += cfg.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        # HF shifts the labels itself; the window's last token only serves as the final label.
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone(), use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        tokens_seen += batch[:, :-1].numel()
        elapsed = time.time() - t0
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_seen / elapsed:.0f}", refresh=False)
        if elapsed > cfg.max_minutes * 60 and step + 1 < cfg.max_steps:
            raise UserError(
                f"{desc}: the {stop_key} safety stop ({cfg.max_minutes:g} min) was reached after step {step + 1} of "
                f"{cfg.max_steps} ({tokens_seen / elapsed:.0f} tok/s; the machine is slower or busier than expected); "
                f"a model cut short by the clock would depend on the machine, so nothing was saved: raise {stop_key} "
                f"or give the job more threads, and rerun"
            )
        last = step + 1 == cfg.max_steps
        if evaluate is not None and ((step + 1) % cfg.eval_every == 0 or last):
            point = {"step": step + 1, "epoch": epoch, "train_loss": losses[-1], "minutes": elapsed / 60, **evaluate()}
            curve.append(point)
            log(f"step {step + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in point.items() if isinstance(v, float))
                + f", {tokens_seen / elapsed:.0f} tok/s")
    seconds = time.time() - t0
    if not math.isfinite(losses[-1]):
        raise UserError(f"{desc}: the loss is {losses[-1]}; lower the learning rate")
    return {
        "steps": len(losses),
        "train_minutes": seconds / 60,
        "tokens_per_second": tokens_seen / seconds,
        "first_loss": losses[0],
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "curve": curve,
    }


def train_tiny_target(
    train_chats: list[list[dict]],
    heldout_chats: list[list[dict]],
    cfg: TinyTargetConfig,
    out_dir: str,
    metrics_path: str,
    log=print,
    device: str = "cpu",
) -> dict:
    """Train tokenizer + model (on ``device``), evaluate, and save an HF model directory atomically."""
    t0 = time.time()
    texts = [chat_text(c) for c in train_chats]
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    token_lists = [tokenizer(t)["input_ids"] for t in texts]
    n_tokens = sum(map(len, token_lists))
    log(f"tokenizer: vocab {len(tokenizer)}, {len(texts)} chats, {n_tokens} tokens ({time.time() - t0:.1f}s)")

    model = build_model(cfg, tokenizer).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3 {cfg.num_layers} layers, hidden {cfg.hidden_size}, {n_params / 1e6:.2f}M parameters")
    heldout = heldout_chats[: cfg.eval_rows]
    run = train_lm(model, token_lists, cfg, log, evaluate=lambda: heldout_loss(model, tokenizer, heldout), desc="tiny target",
                   stop_key="target.tiny.max_minutes")
    fmt = format_check(model, tokenizer, [c[:-1] for c in heldout_chats[: cfg.format_check_prompts]])
    log(f"format check: {fmt['format_ok']:.0%} of {fmt['n_prompts']} greedy answers end in '#### <number>'")
    metrics = {
        "config": asdict(cfg),
        "parameters": n_params,
        "train_tokens_per_epoch": n_tokens,
        **run,
        "heldout_loss": run["curve"][-1]["loss_all_tokens"],
        "heldout_loss_assistant": run["curve"][-1]["loss_assistant_tokens"],
        "format_ok": fmt["format_ok"],
        "format_examples": fmt["examples"],
        "total_minutes": (time.time() - t0) / 60,
    }
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_path(out_dir, is_dir=True) as tmp:
        model.cpu().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_saved_model(tmp)
    write_json(metrics_path, metrics)
    return metrics
