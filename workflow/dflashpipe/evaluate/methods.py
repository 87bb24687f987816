"""The evaluation methods: one registry, :data:`METHODS`, one entry per method.

Everything else about the methods follows from the entries:

* the names ``evaluate.methods`` accepts and its default list (the config schema is YAML and
  cannot import this, so it mirrors both; ``tests/test_eval_methods.py`` fails until they agree);
* the order in which methods run and appear in summaries, tables and plots (the registry's);
* the plots' legend labels (the workflow hands them to the plots job);
* whether the workflow trains the small AR draft and gives it to the evaluate job
  (``needs=AR_DRAFT``).

An entry's ``start`` is called once per evaluation, after the target, the drafter and the
same-harness DFlash and AR decoders are loaded and before anything is timed. It loads what the
method needs and returns a :class:`Runner`; it raises :class:`Skip` when the method cannot run
here (the reason goes to the summary's ``skipped_methods``). The runner decodes one prompt, batch
size 1, and returns a :class:`~dflashpipe.decode.speculative.DecodeResult` that times the decode only (from the
first output token: :mod:`.baselines` shows how for transformers' ``generate``).

Nothing heavy is imported here at import time: the workflow's wiring reads the registry when
Snakemake starts, so each ``start`` imports its decoding code itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from dflashpipe.jobs.errors import UserError

if TYPE_CHECKING:
    import torch

    from dflashpipe.decode.speculative import ARDecoder, DecodeResult, DFlashDecoder
    from dflashpipe.drafter.model import DrafterConfig

    from .settings import EvalSettings

#: What a method may need beyond the target: the trained DFlash drafter (loaded for every evaluation,
#: whatever the methods) or the small autoregressive draft (rule ``ar_draft``: trained, and given to the
#: evaluate job, only when a listed method needs it).
DRAFTER = "drafter"
AR_DRAFT = "ar_draft"

#: Always run, listed or not: the speed-up denominator and the lossless check's reference.
REFERENCE = "ar"


class Skip(Exception):
    """Raised by a method's ``start`` when it cannot run here; the message says why (one line)."""


@dataclass
class Harness:
    """What a method's ``start`` gets: the loaded models and the evaluation's settings."""

    settings: EvalSettings
    target: object  # the target, a transformers causal LM in eval mode
    tokenizer: object
    eos: list[int]
    drafter_dir: str
    drafter_cfg: DrafterConfig
    ar_draft_dir: str | None  # given when a listed method needs AR_DRAFT
    device: torch.device
    dtype: torch.dtype
    dflash: DFlashDecoder  # the same-harness loops, on the target step evaluate.target_step chose
    ar: ARDecoder
    draft_vocab: dict | None = None  # what DFlash drafts among (evaluate.draft_vocab; None: the whole vocabulary)

    @property
    def temperature(self) -> float:
        return self.settings.temperature


@dataclass
class Runner:
    """A started method. ``decode(prompt_ids, max_new_tokens, seed)`` decodes one prompt;
    ``summary`` holds the method's own settings, added to its entry in the summary."""

    decode: Callable[[list[int], int, int], DecodeResult]
    summary: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One evaluation method."""

    name: str  # in evaluate.methods, the summary's `methods` and the samples' and tables' `method` column
    label: str  # the plots' legend
    start: Callable[[Harness], Runner]  # load what it needs (untimed), return its runner
    needs: str | None = None  # DRAFTER, AR_DRAFT or None (the target only)
    default: bool = True  # in evaluate.methods' default list


# -- the runners ------------------------------------------------------------------------------------


def _dflash(h: Harness) -> Runner:
    """DFlash speculative decoding (:class:`dflashpipe.decode.speculative.DFlashDecoder`)."""
    return Runner(lambda prompt, n, seed: h.dflash.generate(prompt, n, h.temperature, seed))


def _ar(h: Harness) -> Runner:
    """Plain autoregressive decoding in the same harness: the speed-up denominator."""
    return Runner(lambda prompt, n, seed: h.ar.generate(prompt, n, h.temperature, seed))


def _hf_generate(h: Harness) -> Runner:
    """transformers ``generate``."""
    from .baselines import hf_generate

    return Runner(lambda prompt, n, seed: hf_generate(h.target, h.tokenizer, prompt, n, h.temperature, seed, h.eos))


def _prompt_lookup(h: Harness) -> Runner:
    """transformers prompt-lookup decoding (``evaluate.prompt_lookup_num_tokens`` candidates)."""
    from .baselines import prompt_lookup_generate

    k = h.settings.prompt_lookup_num_tokens
    return Runner(
        lambda prompt, n, seed: prompt_lookup_generate(h.target, h.tokenizer, prompt, n, h.temperature, seed, h.eos, num_tokens=k),
        summary={"prompt_lookup_num_tokens": k},
    )


def _assisted(h: Harness) -> Runner:
    """transformers assisted generation with the small AR draft (``ar_draft``)."""
    from transformers import AutoModelForCausalLM

    from .baselines import assisted_generate, assistant_settings

    try:
        draft = AutoModelForCausalLM.from_pretrained(h.ar_draft_dir, dtype=h.dtype).to(h.device).eval().requires_grad_(False)
    except Exception as err:
        raise UserError(f"evaluate.ar_draft: cannot load a causal LM from {h.ar_draft_dir}: {str(err).splitlines()[0]}") from None
    return Runner(
        lambda prompt, n, seed: assisted_generate(h.target, h.tokenizer, draft, prompt, n, h.temperature, seed, h.eos),
        summary={"assistant": assistant_settings(draft), "assistant_parameters": sum(p.numel() for p in draft.parameters())},
    )


def _hf_dflash(h: Harness) -> Runner:
    """transformers' own DFlash speculative generation (``speculation_type="dflash"``) with the same
    drafter, loaded as its ``MuseGlimmerAssistantModel``. Skipped where the installed transformers
    lacks it (before 5.15) or cannot run this drafter (e.g. DFlash 2: it runs plain DFlash only). It drafts
    over the whole vocabulary, also where ``evaluate.draft_vocab`` has this harness's DFlash draft among fewer."""
    import transformers

    from .baselines import hf_dflash_generate
    from .hf_assistant import load_hf_assistant, unavailable_reason, unsupported_reason

    reason = unavailable_reason() or unsupported_reason(h.drafter_cfg)
    if reason:
        raise Skip(reason)
    assistant = load_hf_assistant(h.drafter_dir, device=h.device, dtype=h.dtype)
    return Runner(
        lambda prompt, n, seed: hf_dflash_generate(h.target, h.tokenizer, assistant, prompt, n, h.temperature, seed, h.eos),
        summary={
            "assistant": type(assistant).__name__,
            "speculation_type": "dflash",
            "transformers": transformers.__version__,
            "tau_convention": "tau_mean/tau_pooled: tokens per verify forward that reach the output (as for dflash)",
        },
    )


# -- the registry -----------------------------------------------------------------------------------

METHODS: tuple[Method, ...] = (
    Method("dflash", "DFlash", _dflash, needs=DRAFTER),
    Method("ar", "autoregressive (same harness)", _ar),
    Method("hf_generate", "HF generate", _hf_generate),
    Method("prompt_lookup", "prompt lookup", _prompt_lookup),
    Method("assisted", "assisted (small AR draft)", _assisted, needs=AR_DRAFT),
    Method("hf_dflash", "transformers DFlash", _hf_dflash, needs=DRAFTER, default=False),
)

BY_NAME = {m.name: m for m in METHODS}
NAMES = tuple(BY_NAME)
#: what runs when a config does not say (the schema's default mirrors it)
DEFAULT_METHODS = tuple(m.name for m in METHODS if m.default)


def needs_ar_draft(names) -> bool:
    """Whether any of the methods ``names`` needs the small AR draft."""
    return any(BY_NAME[n].needs == AR_DRAFT for n in names)


def select(names, ar_draft_given: bool) -> list[Method]:
    """The methods to run, in registry order: ``names`` and the reference.

    Empty ``names``: the default methods whose models are given (no AR draft: none that needs it).
    An unknown name, or one that needs the AR draft when none is given, is a one-line UserError.
    """
    names = list(names or [m.name for m in METHODS if m.default and (m.needs != AR_DRAFT or ar_draft_given)])
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UserError(f"evaluate.methods: unknown {unknown}; choose from {list(NAMES)}")
    for n in names:
        if BY_NAME[n].needs == AR_DRAFT and not ar_draft_given:
            raise UserError(f"evaluate.methods includes {n!r} but no AR draft model directory is given")
    wanted = {*names, REFERENCE}
    return [m for m in METHODS if m.name in wanted]
