"""Evaluate a drafter on held-out prompts: DFlash, same-harness AR, and transformers' peers.

The methods are the entries of :mod:`.methods` (all batch size 1, on the same target, prompts and
decoding settings); ``ar``, plain autoregressive decoding in this harness, always runs: it is the
speed-up denominator and the lossless check's reference.

A multi-turn prompt (MT-Bench: two user turns) is decoded turn by turn (``evaluate.turns: all``): turn
k+1's context holds the target's own reply to turn k (AR's output: the reference, which lossless DFlash
equals), every method decoding each turn from that same context; each (prompt, turn) is one sample, the
summary adds per-turn figures and, where the prompts carry a category, per-category ones.

The methods run interleaved: prompt by prompt, each prompt's methods in an order
rotated by the prompt's index, so that a machine busy for a while slows every
method alike; each speed-up carries the median of its prompts' own speed-ups and
a 95% bootstrap interval over prompts. Before any timing, every method decodes
the first prompt once, untimed (kernels, allocator and caches warm). For greedy decoding the lossless check
compares DFlash with same-harness AR token for token (and every method's
agreement with AR is recorded per sample). In reduced precision a block forward
and a one-token forward round differently, so a greedy divergence can be a
numerical near-tie of the target's top two logits rather than a bug; mode
``"ties"`` (default) excuses a divergence only when the target's logit gap
between the two tokens, at that position, is below ``tie_tolerance`` relative
to the logits, and records each excused case; any other divergence fails.
"""

from __future__ import annotations

import json
import math
import resource
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from dflashpipe.decode.cuda_graph import round_capacity
from dflashpipe.decode.speculative import ARDecoder, DecodeResult, DFlashDecoder, drafter_runner, eos_ids_of, target_runner
from dflashpipe.inputs.data import CATEGORY
from dflashpipe.jobs.atomic import atomic_path, write_json
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.runtime import Laps

from . import metrics as M
from .lossless import check_lossless, default_tie_tolerance, logit_gap
from .methods import REFERENCE, Harness, Runner, Skip, select
from .settings import EvalRun, EvalSettings


# The evaluation's static KV cache holds a multiple of this many positions. Its compiled steps' shapes
# follow the cache's size, so the held-out datasets of one run (longest prompts of a few hundred
# tokens apart) build the same graphs, and the second dataset's job loads them from the slot's compile
# cache instead of compiling again. At batch 1 the extra positions cost little: attention reads them
# masked, and the KV cache is a few percent of what a step reads (the weights are the rest).
EVAL_CAPACITY_STEP = 1024


def _peak_memory_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)), "peak_memory_kind": "cuda_max_memory_allocated"}
    # ru_maxrss is in KiB on Linux; process-wide and never reset, so it is the peak so far.
    return {"peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_memory_kind": "cpu_process_maxrss"}


def encode_prompt(tokenizer, turns, chat_template_kwargs: dict | None = None, where: str = "a prompt") -> list[int]:
    """The target's chat template with ``add_generation_prompt=True`` (as in expand)."""
    from dflashpipe.inputs.target import prompt_ids

    return prompt_ids(tokenizer, turns, chat_template_kwargs, where)


def _row(pid, method: str, r: DecodeResult, ar: DecodeResult | None, tokenizer) -> dict:
    return {
        "id": str(pid),
        "method": method,
        "prompt_tokens": r.prompt_tokens,
        "new_tokens": r.new_tokens,
        "decode_tokens": r.decode_tokens,
        "prefill_s": r.prefill_s,
        "decode_s": r.decode_s,
        "tokens_per_s": r.tokens_per_second,
        "tau": r.tau,
        "tau_uncut": r.tau_uncut if method == "dflash" else float("nan"),
        "steps": r.verify_steps,
        "target_forwards": r.target_forwards,
        "tokens_per_forward": r.decode_tokens / r.target_forwards if r.target_forwards else float("nan"),
        "accept_lengths": list(r.accepted),
        "committed": list(r.committed),
        "committed_raw": list(r.committed_raw),
        "stop_reason": r.stop_reason,
        "matches_ar": None if ar is None else r.tokens == ar.tokens,
        "output_ids": list(r.tokens),
        "output_text": tokenizer.decode(r.tokens, skip_special_tokens=False),
    }


def _summarise(method: str, results: list[DecodeResult], ar: list[DecodeResult], block_size: int, extra: dict,
               verify_len: int) -> dict:
    """``verify_len``: tokens of one verify, the anchor and the drafts (block_size; DSpark: block_size + 1)."""
    dec_tokens = sum(r.decode_tokens for r in results)
    forwards = sum(r.target_forwards for r in results)
    per_prompt_speedup = [
        M.speedup(a.decode_s, a.decode_tokens, r.decode_s, r.decode_tokens) for r, a in zip(results, ar)
    ]
    per_prompt_speedup = [s for s in per_prompt_speedup if math.isfinite(s)]
    # tau, tokens/s, the speed-up pooled with its spread (median per prompt, 95% interval), outputs equal to AR's
    pooled = _group_figures(results, ar, len(results))
    del pooled["n_samples"]
    out = {
        **pooled,
        "output_tokens": sum(r.new_tokens for r in results),
        "decode_tokens": dec_tokens,
        "decode_s": sum(r.decode_s for r in results),
        "prefill_s": sum(r.prefill_s for r in results),
        "tokens_per_s_mean_per_response": _mean([r.tokens_per_second for r in results]),
        "speedup_vs_ar_mean_per_prompt": _mean(per_prompt_speedup),
        "target_forwards": forwards,
        "tokens_per_target_forward": dec_tokens / forwards if forwards else float("nan"),
        "stop_reasons": pd.Series([r.stop_reason for r in results]).value_counts().to_dict(),
    }
    if method == "dflash":
        accepted = [a for r in results for a in r.accepted]
        out.update(
            {
                "tau_convention": "tau_mean/tau_pooled count only tokens that reach the output (last step cut at the "
                "stop token / length limit; the authors' benchmark since z-lab/dflash 10129599); tau_uncut_* count "
                "accepted+1 for every step before cutting (the authors' benchmark before that commit)",
                "tau_uncut_mean": M.tau_mean([r.committed_raw for r in results]),
                "tau_uncut_pooled": M.tau_pooled([r.committed_raw for r in results]),
                "block_size": block_size,
                "acceptance_histogram": M.acceptance_histogram(accepted, verify_len),
                "per_position_acceptance": M.per_position_acceptance(accepted, verify_len),
            }
        )
    out.update(extra)
    return M.finite_or_none(out)


def _mean(xs) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def evaluate_dataset(run: EvalRun, log=print) -> dict:
    """Run every method on the first ``run.settings.num_prompts`` prompts; write per-sample parquet and summary JSON atomically.

    A failed lossless check raises a :class:`UserError` naming the prompt, after the outputs are
    written. Returns the summary dict.
    """
    dev = torch.device(run.device)
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    if dev.type == "cuda" and not run.settings.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return _evaluate(run, dev, log)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_before)


def _evaluate(run: EvalRun, dev: torch.device, log) -> dict:
    s = run.settings
    methods = _checked_methods(run, dev)
    laps = Laps()
    h, (prompts, skipped), capacity = _harness(run, dev, laps, log)
    runners, skipped_methods = _start(methods, h, log)
    laps.lap("methods")
    log(f"set up in {sum(laps.seconds.values()):.1f} s ({laps}); each method's first decode (compiling, capturing) follows")
    multi = any(p.turns > 1 for p in prompts)
    log(
        f"evaluate: {len(prompts)} prompts"
        + (f" ({sum(p.turns for p in prompts)} user turns, each decoded after the target's reply to the one before)"
           if multi else "")
        + f", max_new_tokens {s.max_new_tokens}, temperature {s.temperature}, block size "
        f"{h.drafter_cfg.block_size}, methods {list(runners)}, device {dev}, dtype {str(h.dtype).removeprefix('torch.')}"
    )
    log(f"target step: {h.dflash.target.mode}, drafter step: {h.dflash.draft.mode} (evaluate.target_step: {s.target_step})")
    skipped_turns, later = Counter(), []
    more = _next_context(h, prompts, capacity, skipped_turns, later) if multi else None
    results, measured = _decode_all(runners, [p.encoded for p in prompts], s, dev, log, more)
    # what was decoded, in the order it was (prompt, then turn): (prompt index, turn, encoding)
    units = sorted([(i, 1, p.encoded) for i, p in enumerate(prompts)] + later, key=lambda u: u[:2])
    if skipped_turns:
        log(f"later turns not decoded: {dict(skipped_turns)}")

    ar, dcfg = results[REFERENCE], h.drafter_cfg
    rows = [{**_row(prompts[i].id, m, results[m][u], ar[u], h.tokenizer), "turn": turn,
             **({CATEGORY: prompts[i].category} if _has_categories(prompts) else {})}
            for m in runners for u, (i, turn, _) in enumerate(units)]
    summary = {
        **_summary_head(run, h, len(prompts), skipped, capacity),
        "methods": {
            m: _summarise(m, results[m], ar, dcfg.block_size, {**runners[m].summary, **measured[m]}, dcfg.num_drafts + 1)
            for m in runners
        },
        # listed in evaluate.methods but not run, with the reason (e.g. hf_dflash on an older transformers)
        "skipped_methods": skipped_methods,
    }
    if multi:  # the pooled figures are over every decoded (prompt, turn); n_prompts counts the prompts
        for m in runners:
            summary["methods"][m].update(n_prompts=len(prompts), n_samples=len(units))
        summary.update(_turn_summary(units, results, skipped_turns))
    if _has_categories(prompts):
        summary["categories"] = _groups([prompts[i].category for i, _, _ in units], results, [i for i, _, _ in units])
    labels = [prompts[i].id if not multi else f"{prompts[i].id} turn {turn}" for i, turn, _ in units]
    summary["lossless"], failure = _lossless(s, labels, [e for _, _, e in units], results, h.target, h.dtype, log)
    if multi and summary["lossless"].get("checked"):
        summary["lossless"]["exact_matches_per_turn"] = {
            str(t): sum(d.tokens == a.tokens for (_, turn, _), d, a in zip(units, results["dflash"], ar) if turn == t)
            for t in sorted({turn for _, turn, _ in units})}
    return _write(rows, summary, run.samples_out, run.summary_out, failure, keep_failed=s.lossless != "report")


def _has_categories(prompts: list[EvalPrompt]) -> bool:
    return any(p.category is not None for p in prompts)


def _group_figures(results: list[DecodeResult], ar: list[DecodeResult], n_prompts: int) -> dict:
    """One group's figures for one method: tau, decode tokens/s, the speed-up over AR pooled, with the median of
    its samples' own and the pooled one's 95% bootstrap interval (:func:`~.metrics.speedup_spread`)."""
    dec_tokens, dec_s = sum(r.decode_tokens for r in results), sum(r.decode_s for r in results)
    spread = M.speedup_spread([(a.decode_s, a.decode_tokens) for a in ar], [(r.decode_s, r.decode_tokens) for r in results])
    return M.finite_or_none({
        "n_samples": len(results),
        "n_prompts": n_prompts,
        "tau_mean": M.tau_mean([r.committed for r in results]),
        "tau_pooled": M.tau_pooled([r.committed for r in results]),
        "tokens_per_s": M.tokens_per_second(dec_tokens, dec_s),
        "speedup_vs_ar": M.speedup(sum(a.decode_s for a in ar), sum(a.decode_tokens for a in ar), dec_s, dec_tokens),
        **{f"speedup_vs_ar_{k}": v for k, v in spread.items()},
        "matches_ar": sum(r.tokens == a.tokens for r, a in zip(results, ar)) / max(1, len(results)),
    })


def _groups(keys: list, results: dict[str, list[DecodeResult]], prompts_of=None) -> dict:
    """Per group (``keys``: each decoded sample's group, in the results' order; groups in order of first
    appearance), each method's :func:`_group_figures`. ``prompts_of``: each sample's prompt (to count them)."""
    ar, out = results[REFERENCE], {}
    for key in dict.fromkeys(k for k in keys if k is not None):
        idx = [u for u, k in enumerate(keys) if k == key]
        n_prompts = len({prompts_of[u] for u in idx}) if prompts_of else len(idx)
        out[str(key)] = {m: _group_figures([res[u] for u in idx], [ar[u] for u in idx], n_prompts)
                         for m, res in results.items()}
    return out


def _turn_summary(units, results: dict[str, list[DecodeResult]], skipped_turns: Counter) -> dict:
    """A multi-turn set's entries: its figures per user turn (``turns``: ``"1"``, ``"2"``, ...: per method), how
    many (prompt, turn) samples were decoded, and the later turns left out (``skipped_turns``, by reason)."""
    return {"n_samples": len(units), "skipped_turns": dict(skipped_turns),
            "turns": _groups([turn for _, turn, _ in units], results, [i for i, _, _ in units])}


def _checked_methods(run: EvalRun, dev: torch.device) -> list:
    """The methods to run; one line for a setting or a device that cannot work."""
    s = run.settings
    if s.max_new_tokens < 1:
        raise UserError(f"evaluate.max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if s.temperature < 0:
        raise UserError(f"evaluate.temperature must be >= 0, got {s.temperature}")
    if s.lossless not in ("exact", "ties", "report"):
        raise UserError(f"evaluate.lossless must be 'exact', 'ties' or 'report', got {s.lossless!r}")
    methods = select(s.methods, ar_draft_given=bool(run.ar_draft_dir))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"evaluate.device is {str(dev)!r} but CUDA is not available")
    return methods


def use_draft_vocab(drafter, target, path: str | None, log) -> dict | None:
    """Has ``drafter`` draft among rule draft_vocab's tokens (``path``; None: the whole vocabulary) -> what the
    summary records of it (the size asked and got, the share of trained reply tokens they cover)."""
    if path is None:
        return None
    vocab = json.loads(Path(path).read_text())
    try:
        drafter.use_draft_vocab(torch.tensor(vocab["ids"], dtype=torch.long), target.get_output_embeddings().weight)
    except ValueError as err:  # fewer tokens than DFlash 2's selector takes
        raise UserError(f"{path}: {err}; raise evaluate.draft_vocab") from None
    log(f"drafting among {vocab['size']} tokens ({100 * vocab['coverage']:.2f}% of the trained reply tokens)")
    return {k: vocab[k] for k in ("requested", "size", "coverage")}


def _harness(run: EvalRun, dev: torch.device, laps: Laps, log) -> tuple[Harness, tuple, int]:
    """The loaded target and drafter, the prompts, and the same-harness DFlash and AR decoders; with
    the prompts read (:func:`eval_prompts`: the prompts, skipped) and the static KV cache's capacity."""
    from dflashpipe.export.write import load_drafter
    from dflashpipe.inputs.target import load_target

    s = run.settings
    dtype = run.dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    target, tok = load_target(run.target_dir, device=str(dev), dtype=dtype)
    laps.lap("target")
    drafter, dcfg = load_drafter(run.drafter_dir, device=dev, dtype=dtype)
    vocab = use_draft_vocab(drafter, target, run.draft_vocab_json, log)
    laps.lap("drafter")
    eos = eos_ids_of(tok, target)
    if not eos:
        raise UserError(f"{run.target_dir}: neither the tokenizer nor the generation config names an eos token")
    prompts = eval_prompts(run.prompts_parquet, tok, target, dcfg.block_size, s, log)
    laps.lap("prompts")

    # the static step needs its cache's size up front: the longest prompt (a multi-turn one: with the target's
    # replies, EvalPrompt.bound), the reply and one verify block, rounded up to EVAL_CAPACITY_STEP positions (see there)
    need = max(p.bound for p in prompts[0]) + s.max_new_tokens + 2 * dcfg.block_size
    capacity = round_capacity(need, EVAL_CAPACITY_STEP)
    verify = target_runner(target, s.target_step, dcfg.target_layer_ids, capacity, graph_sizes=(dcfg.num_drafts + 1,),
                           attention=s.attention)
    dflash = DFlashDecoder(target, drafter, dcfg, eos, runner=verify,
                           draft_runner=drafter_runner(drafter, verify, s.target_step, capacity))
    ar_dec = ARDecoder(target, eos, runner=target_runner(target, s.target_step, None, capacity, graph_sizes=(1,),
                                                         attention=s.attention))
    harness = Harness(settings=s, target=target, tokenizer=tok, eos=eos, drafter_dir=run.drafter_dir, drafter_cfg=dcfg,
                      ar_draft_dir=run.ar_draft_dir, device=dev, dtype=dtype, dflash=dflash, ar=ar_dec, draft_vocab=vocab)
    laps.lap("static steps")
    return harness, prompts, capacity


def _summary_head(run: EvalRun, h: Harness, n_prompts: int, skipped: Counter, capacity: int) -> dict:
    """The summary's entries before the methods': what was evaluated, and how."""
    from dflashpipe.inputs.target import describe_target

    s, dev, dflash = run.settings, h.device, h.dflash
    return {
        "target": describe_target(run.target_dir),
        "drafter": {"path": str(run.drafter_dir), **{k: v for k, v in h.drafter_cfg.to_dict().items() if k in ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id")}},
        # the tokens DFlash drafted among (evaluate.draft_vocab; None: the whole vocabulary)
        "draft_vocab": h.draft_vocab,
        "prompts": str(run.prompts_parquet),
        "n_prompts": n_prompts,
        "skipped_prompts": dict(skipped),
        # one setting (expand.chat_template_kwargs) for expansion, tokenization and evaluation: a drafter
        # trained with thinking off is evaluated with thinking off
        "chat_template_kwargs": dict(s.chat_template_kwargs or {}),
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "seed": s.seed,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(h.dtype).removeprefix("torch."),
        "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled() if dev.type == "cuda" else None,
        # how the DFlash and AR loops ran the target: static+cuda_graphs, static or dynamic (DynamicCache)
        "target_step": dflash.target.mode,
        "kv_capacity": capacity,
        "drafter_step": dflash.draft.mode,
        "torch": torch.__version__,
        "warmup": "each method decoded the first prompt once, untimed, before any timing" if s.warmup else None,
        "timing": "decode only: from the first output token (produced by the prefill forward) to the last; "
        "speed-up = AR time per decode token / method time per decode token, AR = same-harness autoregressive",
    }


@dataclass
class EvalPrompt:
    """One prompt of an evaluation and the user turns it decodes, in order (``evaluate.turns``).

    ``chat``: the row's turns; ``points``: the indices in ``chat`` of the user turns decoded (the expansion's
    :func:`~dflashpipe.inputs.turns.turn_plan`: a single-turn row has one); ``context``: the turns up to the
    one decoded now (the first, then each earlier user turn followed by the target's own reply to it);
    ``encoded``: the first turn's context under the chat template; ``bound``: at most how many tokens any of
    its turns' contexts can take (the static KV cache is sized for it)."""

    id: str
    chat: list[dict]
    points: list[int]
    context: list[dict]
    encoded: list[int]
    category: str | None = None
    bound: int = 0

    @property
    def turns(self) -> int:
        return len(self.points)


def eval_prompts(prompts_parquet, tok, target, block_size: int, s: EvalSettings, log) -> tuple[list[EvalPrompt], Counter]:
    """The first ``s.num_prompts`` usable prompts (:class:`EvalPrompt`), and why the others were skipped.

    In a set whose rows carry a category (MT-Bench's 8, in blocks of 10) the rows are taken in turn from each
    category (:func:`category_order`), so that a cut such as 32 of MT-Bench's 80 questions covers all 8 and not
    the first 3; the prompts kept are returned in file order. A row's user turns are those the expansion answers (:func:`~dflashpipe.inputs.turns.turn_plan`): a
    multi-turn row (MT-Bench: two user turns with the target's reply between them) decodes every one in order
    (``evaluate.turns: all``) or its first only (``first``); a prompt is usable when its first turn is."""
    from dflashpipe.inputs.data import CATEGORY, read_prompts, screen_prompt, target_context
    from dflashpipe.inputs.turns import next_turns, turn_plan

    df = read_prompts(prompts_parquet)
    # every method must decode max_new_tokens (plus one verify block) within the target's context
    context, reserve = target_context(target), s.max_new_tokens + block_size
    categories = df[CATEGORY] if CATEGORY in df.columns else None
    keep, skipped = [], Counter()
    order = category_order(list(categories)) if categories is not None else range(len(df))
    for i in order:
        if s.num_prompts is not None and len(keep) >= int(s.num_prompts):
            break
        chat = df["prompt"].iloc[i]
        points = turn_plan(chat, "all")[0]
        points = points[:1] if s.turns == "first" else points
        first = next_turns(chat, points, 0)
        where = f"{prompts_parquet} row id {df['id'].iloc[i]!r}"
        ids_ = encode_prompt(tok, first, s.chat_template_kwargs, where)
        reason = screen_prompt(first, len(ids_), context, reserve)
        if reason:
            skipped[reason] += 1
            continue
        bound = len(ids_)
        if len(points) > 1:  # the whole chat, its replies empty, and room for the target's own replies
            whole = [dict(t, content="") if t["role"] == "assistant" else t for t in chat[: points[-1] + 1]]
            bound = len(encode_prompt(tok, whole, s.chat_template_kwargs, where)) + (len(points) - 1) * REPLY_ROOM * s.max_new_tokens
            if context:
                bound = min(bound, context - reserve)
        category = categories.iloc[i] if categories is not None else None
        keep.append((i, EvalPrompt(str(df["id"].iloc[i]), chat, points, first, ids_,
                                   None if category is None or pd.isna(category) else str(category), bound)))
    keep = [p for _, p in sorted(keep, key=lambda kp: kp[0])]
    if skipped:
        log(f"skipped prompts: {dict(skipped)} (context {context}, {reserve} tokens reserved after the prompt)")
    if not keep:
        raise UserError(
            f"{prompts_parquet}: no prompt to evaluate ({len(df)} rows; skipped {dict(skipped)}): prompts must be "
            f"non-empty and fit the target's context ({context}) with evaluate.max_new_tokens + block size ({reserve})"
        )
    return keep, skipped


def category_order(categories: list) -> list[int]:
    """Row indices taken one from each category in turn (categories in order of first appearance, rows in file
    order within one; a row without a category is a category of its own kind): the first n of them spread a
    cut over every category as evenly as the set allows."""
    groups: dict = {}
    for i, c in enumerate(categories):
        groups.setdefault(None if c is None or pd.isna(c) else str(c), []).append(i)
    queues = list(groups.values())
    order = []
    for k in range(max((len(q) for q in queues), default=0)):
        order += [q[k] for q in queues if k < len(q)]
    return order


#: the KV cache of a multi-turn prompt keeps this many times ``max_new_tokens`` for each earlier reply of the
#: target: the reply's text, encoded again in the next turn's context, may take other (rarely more) tokens
REPLY_ROOM = 2


def read_eval_prompts(prompts_parquet, tok, target, block_size: int, s: EvalSettings, log) -> tuple[list[str], list[list[int]], Counter]:
    """The first ``s.num_prompts`` usable prompts: their ids, their first turn's encodings (:func:`eval_prompts`),
    and why the others were skipped."""
    prompts, skipped = eval_prompts(prompts_parquet, tok, target, block_size, s, log)
    return [p.id for p in prompts], [p.encoded for p in prompts], skipped


def reply_text(tokenizer, tokens: list[int], eos: list[int]) -> str:
    """A reply as the next turn's context holds it: its text up to the stop token, special tokens left out (as
    the expansion writes a reply)."""
    stop = next((k for k, t in enumerate(tokens) if t in set(eos)), len(tokens))
    return tokenizer.decode(tokens[:stop], skip_special_tokens=True)


def _next_context(h: Harness, prompts: list[EvalPrompt], capacity: int, skipped_turns: Counter, decoded: list):
    """``more`` of :func:`_decode_all`: prompt ``i``'s next user turn after the reference's reply to turn ``turn``
    (its context: the turns so far, that reply, the next user turn), encoded; None after its last turn, or when
    the context does not fit (counted in ``skipped_turns`` for that turn and any after it). ``decoded`` gets
    ``(prompt index, turn, encoding)`` of each turn it hands on."""
    from dflashpipe.inputs.data import screen_prompt, target_context
    from dflashpipe.inputs.turns import next_turns

    s = h.settings
    reserve = s.max_new_tokens + h.drafter_cfg.block_size

    def more(i: int, turn: int, ar: DecodeResult):
        p = prompts[i]
        if turn >= p.turns:
            return None
        p.context = p.context + [{"role": "assistant", "content": reply_text(h.tokenizer, ar.tokens, h.eos)}] \
            + next_turns(p.chat, p.points, turn)
        ids_ = encode_prompt(h.tokenizer, p.context, s.chat_template_kwargs, f"prompt id {p.id!r} turn {turn + 1}")
        reason = screen_prompt(p.context, len(ids_), target_context(h.target), reserve)
        if reason is None and len(ids_) + s.max_new_tokens + 2 * h.drafter_cfg.block_size > capacity:
            reason = SKIP_OVER_CAPACITY
        if reason:
            skipped_turns[reason] += p.turns - turn
            return None
        decoded.append((i, turn + 1, ids_))
        return ids_

    return more


#: a later turn's context longer than the KV cache sized for it (:data:`REPLY_ROOM`): not decoded, counted
SKIP_OVER_CAPACITY = "skipped_context_over_kv_capacity"


def _start(methods, harness: Harness, log) -> tuple[dict[str, Runner], dict[str, str]]:
    """Each method's runner (registry order), and the reasons of those that cannot run here."""
    runners, skipped = {}, {}
    for method in methods:
        try:
            runners[method.name] = method.start(harness)
        except Skip as why:
            skipped[method.name] = str(why)
            log(f"skipping method {method.name}: {why}")
    return runners, skipped




def _cpu_reading() -> tuple[float, float, float] | None:
    """(wall seconds, the machine's busy CPU seconds from /proc/stat, this process's CPU seconds); None where
    there is no /proc/stat."""
    import os

    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = os.times()
    return (time.monotonic(), (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system)


def _decode_all(runners: dict[str, Runner], encoded, s: EvalSettings, dev, log,
                more=None) -> tuple[dict[str, list[DecodeResult]], dict[str, dict]]:
    """Every method over every prompt, interleaved: prompt by prompt, each prompt's methods in a rotated order
    (:func:`~.metrics.interleaved_order`), so that the methods compared meet the same conditions (a machine busy
    for a while slows them alike). Each method first decodes the first prompt once, untimed. Returns the
    results, and each method's peak memory and wall time (the sum of its decodes); the load average at the
    start and the end is logged and kept.

    ``more(i, turn, ar_result)`` (multi-turn prompts): the context of prompt ``i``'s next user turn, encoded,
    given the reference's (AR's) reply to user turn ``turn`` (1-based), or None when there is none; every
    method then decodes that turn from that same context, before the next prompt. The results list one entry
    per decoded (prompt, turn) in that order (prompt, then turn); the rotation and the seed follow that count."""
    import os

    from tqdm import tqdm

    if s.warmup:
        laps = Laps()
        for method, runner in runners.items():
            runner.decode(encoded[0], s.max_new_tokens, s.seed)
            laps.lap(method)
        log(f"first decodes (untimed: compiling, capturing, allocating): {laps}")
    fixed = None if s.timing_repeats == "auto" else int(s.timing_repeats)
    load_start, cpu_start = os.getloadavg(), _cpu_reading()
    results = {m: [] for m in runners}
    wall, peak, unsteady, rounds_done = dict.fromkeys(runners, 0.0), {}, set(), []
    bar = tqdm(range(len(encoded)), desc=f"evaluate {len(runners)} methods, interleaved", mininterval=5)
    u = k = 0  # decoded (prompt, turn) pairs so far (a single-turn set's prompt index); rounds so far
    for i in bar:
        context, turn = encoded[i], 1
        while context is not None:
            runs = {m: [] for m in runners}
            rounds, rnd = fixed or M.AUTO_ROUNDS_MOST, 0
            while rnd < rounds:
                started = time.perf_counter()
                for method in M.interleaved_order(list(runners), k):
                    _peak_memory_reset(dev)
                    t0 = time.perf_counter()
                    runs[method].append(runners[method].decode(context, s.max_new_tokens, s.seed + u))
                    wall[method] += time.perf_counter() - t0
                    mem = _peak_memory(dev)
                    if method not in peak or mem["peak_memory_bytes"] > peak[method]["peak_memory_bytes"]:
                        peak[method] = mem
                k, rnd = k + 1, rnd + 1
                if fixed is None and rnd == 1:  # auto: more rounds only where one is cheap
                    rounds = M.auto_rounds(time.perf_counter() - started)
            rounds_done.append(rnd)
            for method, out in runs.items():
                if any(r.tokens != out[0].tokens for r in out[1:]):
                    unsteady.add(method)
                results[method].append(M.median_run(out, lambda r: r.decode_s))
            u += 1
            context = None if more is None else more(i, turn, results[REFERENCE][-1])
            turn += 1
        out = results.get("dflash") or next(iter(results.values()))
        bar.set_postfix(tau=f"{M.tau_pooled([x.committed for x in out]):.2f}", refresh=False)
    load_end, cpu_end = os.getloadavg(), _cpu_reading()
    mean_rounds = sum(rounds_done) / max(1, len(rounds_done))
    measured = {m: {**peak[m], "wall_s": wall[m], "timing_repeats": s.timing_repeats, "timing_rounds_mean": mean_rounds}
                for m in runners}
    if max(rounds_done, default=1) > 1:
        log(f"each prompt's decodes timed in {min(rounds_done)}-{max(rounds_done)} rounds (mean {mean_rounds:.2f}, "
            f"evaluate.timing_repeats: {s.timing_repeats}); its run of median time counts"
            + (f"; {', '.join(sorted(unsteady))} gave other tokens on a repeat (the median run's count)"
               if unsteady else ""))
    for method, out in results.items():
        log(
            f"{method}: {sum(r.new_tokens for r in out)} tokens, tau {M.tau_pooled([r.committed for r in out]):.3f} (pooled), "
            f"{M.tokens_per_second(sum(r.decode_tokens for r in out), sum(r.decode_s for r in out)):.1f} decode tok/s"
        )
    cores = os.cpu_count() or 1
    others = None if cpu_start is None or cpu_end is None else M.other_busy_cores(cpu_start, cpu_end)
    if others is not None:  # measured over the timed decodes exactly
        own = torch.get_num_threads() if dev.type == "cpu" else 1
        busy = M.machine_busy(others, cores, own)
        seen = (f"other processes kept {others:.2f} of {cores} cores busy while the decodes were timed (this job "
                f"runs {own} thread{'s' if own > 1 else ''})")
    else:  # no /proc/stat: the 1-minute load average, which lags
        busy = max(load_start[0], load_end[0]) > cores
        seen = f"load average (1 min) {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end, on {cores} cores"
    log(seen + (": the machine was busy, speed-ups are less certain (tau is not affected; see their interval)"
                if busy else ""))
    for m in measured:
        measured[m]["load_average"] = {"start": list(load_start), "end": list(load_end), "cores": cores}
        measured[m]["other_busy_cores"] = others
    return results, measured


def _lossless(s: EvalSettings, ids, encoded, results, target, dtype, log) -> tuple[dict, UserError | None]:
    """The summary's ``lossless`` entry, and the failure of the check (None when it passed or did not run)."""
    if not (s.temperature == 0 and "dflash" in results):
        return {"checked": False, "reason": "sampling (temperature > 0)" if s.temperature > 0 else "dflash not run"}, None
    ar = results[REFERENCE]
    tol = float(s.tie_tolerance) if s.tie_tolerance is not None else default_tie_tolerance(dtype)

    def near_tie(i, pos, d_tok, a_tok):
        g = logit_gap(target, encoded[i], ar[i].tokens[:pos], a_tok, d_tok)
        rel = abs(g["gap"]) / g["scale"]
        return {**g, "relative_gap": rel} if rel <= tol else None

    info = {
        "checked": True,
        "mode": s.lossless,
        "tie_tolerance": tol if s.lossless != "exact" else None,
        "n_prompts": len(ids),
        "exact_matches": sum(d.tokens == a.tokens for d, a in zip(results["dflash"], ar)),
    }
    try:
        excused = check_lossless(ids, results["dflash"], ar, near_tie if s.lossless != "exact" else None)
    except UserError as err:
        info.update(passed=False, error=str(err))
        log(f"WARNING: {err}")
        return info, err
    info.update(passed=True, near_tie_divergences=excused)
    if excused:
        log(f"lossless: {len(excused)} greedy divergence(s) at numerical near-ties of the target's logits (excused)")
    return info, None


def _write(rows, summary: dict, samples_out, summary_out, failure: UserError | None, keep_failed: bool) -> dict:
    """Write the samples and the summary; on a failure to keep, under ``failed/`` instead, then raise it."""
    kept = Path(summary_out).parent / "failed"
    failed = failure is not None and keep_failed
    if failed:
        # the job fails and Snakemake removes its outputs: keep what is needed to inspect the failure
        samples_out, summary_out = kept / Path(samples_out).name, kept / Path(summary_out).name
    else:  # a failure kept by an earlier run is out of date now
        for old in (kept / Path(samples_out).name, kept / Path(summary_out).name):
            old.unlink(missing_ok=True)
    with atomic_path(samples_out) as tmp:
        pd.DataFrame(rows).to_parquet(tmp, index=False)
    write_json(summary_out, summary)
    if failed:
        raise UserError(f"{failure}; samples and summary kept for inspection: {samples_out}, {summary_out}")
    return summary
