"""Peers on the same target and prompts, and a small autoregressive draft model for assisted generation.

Peers (all through transformers' ``model.generate``, batch size 1, DynamicCache):

* ``hf_generate``: plain autoregressive ``generate``;
* ``prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens=N``;
  n-gram size ``max_matching_ngram_size`` default 2);
* ``assisted``: assisted generation with a small AR draft model
  (``assistant_model=...``; it must share the target's vocabulary, which
  :func:`train_ar_draft` guarantees). Draft length and confidence threshold are
  the assistant's ``generation_config`` values (transformers 5 defaults:
  ``num_assistant_tokens=20``, schedule ``"constant"``,
  ``assistant_confidence_threshold=0.4``) unless given.

Decode-only timing: a streamer records when ``generate`` hands over tokens. Its
first call is the prompt; the second carries the tokens of the FIRST target
forward (the prefill; with prompt lookup / assisted generation that forward also
verifies the first candidates, so it may yield several tokens). Decode time runs
from that second call to the end of ``generate``, and decode tokens are the
output tokens after those of the first forward. So the first-token step is timed
separately inside the same run (nothing is subtracted). Target forwards are
counted with a forward pre-hook on the target; the decode count excludes the
first (prefill) forward. Sampling uses plain temperature (top_k=0, top_p=1,
repetition_penalty=1), overriding any defaults in the target's generation
config, so all methods sample from the same distribution as the DFlash harness.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass

import torch

from dflashpipe.errors import UserError

from .spec_decode import DecodeResult, eos_ids_of, sync


def _streamer_base():
    from transformers.generation.streamers import BaseStreamer

    return BaseStreamer


class _TimingStreamer(_streamer_base()):
    """Records (time, number of tokens) for every ``put`` from ``generate``."""

    def __init__(self, device):
        self.device = device
        self.events: list[tuple[float, int]] = []

    def put(self, value):
        # Values arrive on the CPU (``.cpu()`` in generate), so the device has caught up.
        self.events.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


class _ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1

    def remove(self):
        self.handle.remove()


def generation_kwargs(
    tokenizer,
    target_model,
    max_new_tokens: int,
    temperature: float,
    eos_ids: list[int] | None = None,
) -> dict:
    """Arguments for ``generate`` that reproduce the harness's decoding exactly."""
    eos_ids = eos_ids if eos_ids is not None else eos_ids_of(tokenizer, target_model)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos_ids[0] if eos_ids else None
    kw = dict(
        max_new_tokens=int(max_new_tokens),
        min_new_tokens=0,
        eos_token_id=list(eos_ids),
        pad_token_id=pad,
        repetition_penalty=1.0,
        num_beams=1,
    )
    if temperature > 0:
        kw.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    return kw


@torch.no_grad()
def hf_decode(
    target_model,
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = 0,
    eos_ids: list[int] | None = None,
    **extra,
) -> DecodeResult:
    """One ``generate`` call (``extra``: e.g. ``prompt_lookup_num_tokens=10`` or ``assistant_model=m``).

    Returns a :class:`DecodeResult`: ``committed`` holds the tokens per decode
    forward as ``generate`` streamed them (already cut at the stop token / length
    limit by transformers), ``committed_raw`` the same (transformers does not
    expose the uncut counts), ``accepted`` is empty.
    """
    dev = next(target_model.parameters()).device
    ids = torch.tensor([prompt_ids], device=dev)
    kwargs = generation_kwargs(tokenizer, target_model, max_new_tokens, temperature, eos_ids)
    kwargs.update(extra)
    streamer = _TimingStreamer(dev)
    counter = _ForwardCounter(target_model)
    if temperature > 0 and seed is not None:
        torch.manual_seed(int(seed))
    try:
        sync(dev)
        t0 = time.perf_counter()
        out = target_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
        sync(dev)
        t_end = time.perf_counter()
    finally:
        counter.remove()
    tokens = out[0, len(prompt_ids) :].tolist()
    ev = streamer.events
    if len(ev) < 2:
        raise RuntimeError(f"generate streamed {len(ev)} chunks; expected the prompt and at least one token")
    steps = [n for _, n in ev[2:]]
    res = DecodeResult(
        tokens=tokens,
        committed=steps,
        committed_raw=list(steps),
        prefill_s=ev[1][0] - t0,
        decode_s=t_end - ev[1][0],
        target_forwards=counter.calls - 1,
        prompt_tokens=len(prompt_ids),
        first_tokens=ev[1][1],
    )
    stops = set(kwargs["eos_token_id"])
    res.stop_reason = "eos" if tokens and tokens[-1] in stops else "length"
    if sum(steps) + ev[1][1] != len(tokens):
        raise RuntimeError(f"generate streamed {sum(steps) + ev[1][1]} tokens but returned {len(tokens)}")
    return res


def hf_generate(target_model, tokenizer, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None) -> DecodeResult:
    """Plain autoregressive ``generate``."""
    return hf_decode(target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids)


def prompt_lookup_generate(
    target_model, tokenizer, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None, num_tokens: int = 10,
    max_matching_ngram_size: int | None = None,
) -> DecodeResult:
    """Prompt-lookup decoding: candidates copied from n-gram matches in the context."""
    extra = {"prompt_lookup_num_tokens": int(num_tokens)}
    if max_matching_ngram_size is not None:
        extra["max_matching_ngram_size"] = int(max_matching_ngram_size)
    return hf_decode(target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids, **extra)


def assisted_generate(
    target_model, tokenizer, assistant_model, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None,
    num_assistant_tokens: int | None = None, assistant_confidence_threshold: float | None = None,
) -> DecodeResult:
    """Assisted generation with a small AR draft model sharing the target's vocabulary."""
    tv = target_model.config.get_text_config().vocab_size
    av = assistant_model.config.get_text_config().vocab_size
    if tv != av:
        raise UserError(f"assisted generation: the draft model's vocab_size {av} differs from the target's {tv}; train it with train_ar_draft")
    gc = assistant_model.generation_config
    if num_assistant_tokens is not None:
        gc.num_assistant_tokens = int(num_assistant_tokens)
    if assistant_confidence_threshold is not None:
        gc.assistant_confidence_threshold = float(assistant_confidence_threshold)
    return hf_decode(target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids, assistant_model=assistant_model)


def assistant_settings(assistant_model) -> dict:
    """The draft-length settings assisted generation will use (for the summary)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig()._get_default_generation_params()
    gc = assistant_model.generation_config
    out = {}
    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        val = getattr(gc, key, None)
        out[key] = val if val is not None else defaults.get(key)
    return out


# ---------------------------------------------------------------------------
# A small AR draft model for assisted generation
# ---------------------------------------------------------------------------


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
