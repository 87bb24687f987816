"""What one evaluation is: its settings (:class:`EvalSettings`, the config's ``evaluate`` section) and
its models, prompts and outputs (:class:`EvalRun`), built once by the job and taken whole by
:func:`dflashpipe.evaluate.run.evaluate_dataset`.

A module of its own, importing nothing heavy: :mod:`.methods` (read by the workflow when Snakemake
starts) and :mod:`.run` both name these, and neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflashpipe.jobs.settings import schema_settings

if TYPE_CHECKING:
    import torch


@schema_settings("evaluate")
class EvalSettings:
    """How :func:`~dflashpipe.evaluate.run.evaluate_dataset` evaluates: the config's ``evaluate`` section, and a few more.

    The first fields are the ``evaluate`` section's keys and ``seed``, their defaults the schema's:
    ``settings(EvalSettings, cfg["evaluate"], seed=..., ...)``.

    ``methods``: names from :mod:`.methods` (empty: its defaults, less those whose model is not
    given). ``lossless`` (greedy only): ``"exact"`` (DFlash must equal AR token for token),
    ``"ties"`` (as exact, except divergences at numerical near-ties of the target's logits;
    tolerance ``tie_tolerance``, default :func:`default_tie_tolerance` of the dtype) or
    ``"report"`` (as ties, but never fails). ``target_step``: how the DFlash and AR loops run the
    target (:data:`dflashpipe.decode.speculative.TARGET_STEPS`): ``auto`` = a static KV cache with
    CUDA-graph-captured steps on a GPU where the model's layout allows it, HF's ``DynamicCache``
    otherwise; recorded in the summary. ``attention``: how the static steps attend
    (:data:`dflashpipe.decode.static_target.ATTENTION`; auto: flex_attention when compiled).

    ``seed`` (the config's top-level one: prompt i samples with ``seed + i``) and
    ``chat_template_kwargs`` (``expand.chat_template_kwargs``: a drafter trained with thinking
    off is evaluated with thinking off) come from other sections.

    ``cudnn_sdpa=False`` turns PyTorch's cuDNN attention backend off while the evaluation runs
    (restored afterwards): it builds an execution plan the first time it sees each (query
    length, key length) pair, which slows whichever method meets a new context length first: an
    order bias no single warm-up prompt removes (measured: docs/decoding.md). Flash /
    memory-efficient attention plan nothing per shape.
    """

    # the job's threads; the speed-up under load's keys (rule concurrency reads them: evaluate.concurrency)
    JOB_KEYS = ("threads", "concurrency", "concurrency_waves")

    # the config's `evaluate` section (defaults: the schema's)
    num_prompts: int | None
    max_new_tokens: int
    temperature: float
    methods: list
    prompt_lookup_num_tokens: int
    lossless: str
    target_step: str
    attention: str
    draft_vocab: int  # 0: draft over the whole vocabulary; else over EvalRun.draft_vocab_json's tokens
    timing_repeats: object  # "auto" or a count: see :func:`dflashpipe.evaluate.run.timing_repeats`
    turns: str  # all: every user turn of a multi-turn prompt, each after the target's reply to the one before | first
    # from other sections of the config: the top-level seed (default: the schema's), and
    # expand.chat_template_kwargs (passed by name; the decorator takes defaults of `evaluate` keys only)
    seed: int
    chat_template_kwargs: dict = field(default_factory=dict)
    # not in the config
    tie_tolerance: float | None = None
    warmup: bool = True
    cudnn_sdpa: bool = False


@dataclass(frozen=True)
class EvalRun:
    """One evaluation of a drafter on one prompt set: settings, models, prompts, outputs, device."""

    settings: EvalSettings
    # inputs
    target_dir: str
    drafter_dir: str
    prompts_parquet: str
    # outputs: per-sample parquet and summary JSON, written atomically
    samples_out: str
    summary_out: str
    ar_draft_dir: str | None = None  # the small AR draft model, for the methods that need it (assisted)
    draft_vocab_json: str | None = None  # rule draft_vocab's ids (evaluate.draft_vocab > 0)
    device: str = "cpu"
    dtype: torch.dtype | None = None  # None: bfloat16 on CUDA, float32 on the CPU
