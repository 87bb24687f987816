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
* ``hf_dflash``: transformers' own DFlash speculative generation with the
  trained drafter (``assistant_model=<MuseGlimmerAssistantModel>,
  speculation_type="dflash"``; transformers 5.15 and later).

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

import time

import torch

from dflashpipe.inputs.target import generation_arguments
from dflashpipe.jobs.errors import UserError

from dflashpipe.decode.speculative import DecodeResult, eos_ids_of, sync


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
    # the one builder of every backend's arguments: nothing of the target's generation_config applies
    return generation_arguments(getattr(target_model, "generation_config", None), max_new_tokens, temperature, 1.0,
                                list(eos_ids), pad)[0]


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
    **lookup: int,
) -> DecodeResult:
    """Prompt-lookup decoding: candidates copied from n-gram matches in the context.

    ``lookup``: more of ``generate``'s prompt-lookup settings, e.g. ``max_matching_ngram_size=3``."""
    extra = {"prompt_lookup_num_tokens": int(num_tokens), **{k: int(v) for k, v in lookup.items()}}
    return hf_decode(target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids, **extra)


class _DropInternalDeprecation:
    """transformers' assisted generation calls the assistant's ``generate`` with its own
    ``generation_config`` AND generation arguments, then warns about it (transformers 5.x, in
    ``candidate_generator``): not this code's call, so not this log's business."""

    def filter(self, record) -> bool:
        return not record.getMessage().startswith("Passing `generation_config` together with generation-related")


def assisted_generate(
    target_model, tokenizer, assistant_model, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None,
    **draft_length: float,
) -> DecodeResult:
    """Assisted generation with a small AR draft model sharing the target's vocabulary.

    ``draft_length``: the assistant's ``generation_config`` values to set first, by name
    (``num_assistant_tokens``, ``assistant_confidence_threshold``)."""
    tv = target_model.config.get_text_config().vocab_size
    av = assistant_model.config.get_text_config().vocab_size
    if tv != av:
        raise UserError(f"assisted generation: the draft model's vocab_size {av} differs from the target's {tv}; train it with train_ar_draft")
    import logging

    log = logging.getLogger("transformers.generation.utils")
    if not any(isinstance(f, _DropInternalDeprecation) for f in log.filters):
        log.addFilter(_DropInternalDeprecation())
    unknown = set(draft_length) - {"num_assistant_tokens", "assistant_confidence_threshold"}
    if unknown:
        raise TypeError(f"assisted_generate: unknown draft-length settings {sorted(unknown)}")
    gc = assistant_model.generation_config
    if draft_length.get("num_assistant_tokens") is not None:
        gc.num_assistant_tokens = int(draft_length["num_assistant_tokens"])
    if draft_length.get("assistant_confidence_threshold") is not None:
        gc.assistant_confidence_threshold = float(draft_length["assistant_confidence_threshold"])
    return hf_decode(target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids, assistant_model=assistant_model)


def hf_dflash_generate(
    target_model, tokenizer, assistant_model, prompt_ids, max_new_tokens, temperature=0.0, seed=0, eos_ids=None,
) -> DecodeResult:
    """transformers' own DFlash speculative generation (``speculation_type="dflash"``).

    ``assistant_model``: a ``MuseGlimmerAssistantModel``, e.g. from
    :func:`dflashpipe.evaluate.hf_assistant.load_hf_assistant`. Each decode
    forward of the target verifies one drafted block, so ``committed`` holds the
    tokens per verify step (cut at the stop token / length limit, as this
    harness counts them) and ``target_forwards`` the verify steps.
    """
    return hf_decode(
        target_model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, eos_ids,
        assistant_model=assistant_model, speculation_type="dflash",
    )


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
