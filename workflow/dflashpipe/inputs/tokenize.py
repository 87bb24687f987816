"""Tokenization: chat template of the target, loss mask on the target's replies only.

The loss mask covers the tokens of the final assistant turn (the one the target
regenerated), including its end-of-turn token, and nothing of the prompt. It is
found without template-specific markers: the tokens of the prompt rendered with
``add_generation_prompt=True`` are a prefix of the whole chat's tokens; what
follows the longest common prefix is the reply. This works for any chat
template, including ones that insert extra tokens (Qwen3's empty think block).
A chat the target answered turn by turn (``expand.turns: all``: the expanded
row's ``turns``) has each of its earlier replies in the loss too, found the same
way inside the whole chat, one loss segment per reply; a reply the template
renders otherwise there (one that drops the thinking of past turns) stays out
of the loss, counted.

A reply the target did not finish (``finish_reason`` ``length``: cut at
``expand.max_new_tokens``) must not teach the drafter a stop the target never
made, yet the chat template closes every assistant turn. ``cut_replies``:
``mask_end`` (default) keeps the row and takes the closing tokens out of the
loss (they are what follows the reply rendered with
``continue_final_message``); ``drop`` drops the row; ``cut_loop`` keeps a reply
that was cut because it repeats itself up to the first occurrence of its loop
(:func:`loop_start`: the target wrote those tokens, the repetitions teach nothing
but copying) with the closing tokens out of the loss, and a cut reply without a
loop as ``mask_end`` does. All three are counted.

Samples are truncated to ``max_length``; those left with fewer than
:data:`MIN_LOSS_TOKENS` loss tokens are dropped (and counted, by reason). The
tokenized data does not depend on the drafter: a run's training leaves out the
samples too short for its blocks (:func:`dflashpipe.training.data.run_data`). Each
kept sample records the smallest length bucket it fits, so training can pad to a
few fixed shapes.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dflashpipe.inputs.data import read_parquet
from dflashpipe.inputs.tokenized import save_tokenized
from dflashpipe.jobs.atomic import write_json
from dflashpipe.jobs.errors import UserError


def _ids(tokenizer, messages, add_generation_prompt, kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(out["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _reply_end(tokenizer, messages, full, kwargs) -> tuple[int, int]:
    """(where the reply's own tokens end in ``full``, length of the open reply's rendering): what follows
    the first is the template's closing of the turn."""
    open_reply = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                    continue_final_message=True, **kwargs)["input_ids"])
    return _common_prefix(open_reply, full), len(open_reply)


def _ids_fit(tokenizer, messages, full, start, reply_ids, cut, kwargs) -> int | None:
    """Where the reply ``messages[-1]`` (its tokens start at ``start`` of ``full``) ends when its generated
    ``reply_ids`` can stand for it: the template renders the reply text verbatim and the ids decode to it; else None."""
    content = messages[-1]["content"]
    try:
        content_end, open_len = _reply_end(tokenizer, messages, full, kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render an open reply: keep the text
        return None
    verbatim = (content_end >= start and (not cut or content_end == open_len)
                and tokenizer.decode(full[start:content_end], skip_special_tokens=True) == content
                and tokenizer.decode(reply_ids, skip_special_tokens=True) == content)
    return content_end if verbatim else None


def _earlier_reply(tokenizer, messages, m, full, kwargs, reply_ids, use_reply_ids, cut):
    """The target's earlier reply ``messages[m]`` inside the whole chat's ids ``full``: (full, its loss span or None,
    outcome). The span runs from the end of the chat before it (rendered to be answered) to the end of its turn
    (``cut``: to the end of the reply; the closing of the turn was never generated); None (outcome
    ``not_maskable``) when the template does not render the reply there as written. Outcomes otherwise as
    :func:`encode_chat`'s ``ids``; with ``use_reply_ids`` the generated ids may replace the text."""
    head, content = messages[: m + 1], str(messages[m]["content"])
    start = _common_prefix(_ids(tokenizer, messages[:m], True, kwargs), full)
    end = _common_prefix(_ids(tokenizer, head, False, kwargs), full)
    span = tokenizer.decode(full[start:end], skip_special_tokens=True).strip()
    if end <= start or not span.startswith(content.strip()):
        return full, None, "not_maskable"
    if cut:
        try:
            end = _reply_end(tokenizer, head, full, kwargs)[0]
        except Exception:  # noqa: BLE001 - a template that cannot render an open reply
            return full, None, "not_maskable"
        span = tokenizer.decode(full[start:end], skip_special_tokens=False)
        if end <= start or "".join(span.split()) != "".join(content.split()):
            return full, None, "not_maskable"
    if reply_ids is None:
        return full, (start, end), "none"
    reply_ids = [int(t) for t in reply_ids]
    if full[start : start + len(reply_ids)] == reply_ids:
        return full, (start, end), "same"
    content_end = _ids_fit(tokenizer, head, full, start, reply_ids, cut, kwargs)
    if content_end is None or not use_reply_ids:
        return full, (start, end), "retokenized"
    full = full[:start] + reply_ids + full[content_end:]
    return full, (start, end + len(reply_ids) - (content_end - start)), "generated"


def encode_chat(tokenizer, messages: list[dict], max_length: int, chat_template_kwargs: dict | None = None,
                cut: bool = False, reply_ids: list[int] | None = None, info: dict | None = None,
                use_reply_ids: bool = True, earlier: list[tuple[int, list[int] | None, bool]] | None = None):
    """Return (input_ids, loss_mask, untruncated_length) for a chat ending in the assistant reply.

    ``cut``: the reply was cut at the length limit; the tokens the template adds
    after it (end of turn) get no loss. Raises ValueError if the template renders
    the open reply differently from the closed one (then it cannot be masked).
    ``reply_ids``: the ids the target generated for the reply, if known; with
    ``use_reply_ids`` they replace the re-tokenized reply when the two differ and
    the template renders the reply text verbatim (without, they are only compared).
    ``info`` (a dict, optional) gets ``ids``: ``none`` (no generated ids),
    ``same``, ``generated`` (differed: the generated ids are used) or
    ``retokenized`` (differed; the re-tokenized text is kept).
    ``earlier``: the target's earlier replies in the chat, (index in ``messages``, generated ids or None, cut):
    each in the loss too, a segment of its own (:func:`_earlier_reply`); ``info`` then gets ``turns``, their
    outcomes (those of ``ids``, or ``not_maskable``: out of the loss).
    """
    kwargs = chat_template_kwargs or {}
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the last turn must be the assistant reply")
    prompt = _ids(tokenizer, messages[:-1], True, kwargs)
    full = _ids(tokenizer, messages, False, kwargs)
    start, end = _common_prefix(prompt, full), len(full)
    outcome = "none"
    if reply_ids is not None:
        reply_ids = [int(t) for t in reply_ids]
        outcome = "same" if full[start : start + len(reply_ids)] == reply_ids else "retokenized"
        if outcome == "retokenized":
            content_end = _ids_fit(tokenizer, messages, full, start, reply_ids, cut, kwargs)
            if content_end is not None and use_reply_ids:
                full = full[:start] + reply_ids + full[content_end:]
                # a cut reply: the closing of the turn was never generated, so it gets no loss
                end = start + len(reply_ids) if cut else len(full)
                outcome = "generated"
    if info is not None:
        info["ids"] = outcome
    if cut and outcome != "generated":
        end, open_len = _reply_end(tokenizer, messages, full, kwargs)
        # the loss span must be the reply and nothing else (e.g. Qwen3 renders a reply cut inside its
        # thinking as an empty think block followed by the reply: that block was never generated)
        span = tokenizer.decode(full[start:end], skip_special_tokens=False)
        if end < open_len or end <= start or "".join(span.split()) != "".join(messages[-1]["content"].split()):
            raise ValueError("the chat template renders a cut reply differently from a finished one")
    segments, turns = [(start, end)], []
    for m, gen, turn_cut in reversed(earlier or []):  # the latest first: replacing a reply's ids moves what follows
        before = len(full)
        full, span, turn_outcome = _earlier_reply(tokenizer, messages, m, full, kwargs, gen, use_reply_ids, turn_cut)
        turns.insert(0, turn_outcome)
        if span is not None:
            shift = len(full) - before
            segments = [span] + [(a + shift, b + shift) for a, b in segments]
    if info is not None and earlier:
        info["turns"] = turns
    ids = full[:max_length]
    mask = np.zeros(len(ids), dtype=np.int64)
    for a, b in segments:
        mask[a:b] = 1
    return ids, mask.tolist(), len(full)


def loop_start(ids, max_period: int = 256, min_span: int = 16) -> tuple[int, int] | None:
    """(start, period) of the repetition a reply ends in, or None.

    The reply ``ids[start:]`` is periodic with ``period`` tokens, repeated at least twice and over
    at least ``min_span`` tokens; of all periods the one whose repetition starts earliest wins (the
    shortest on a tie). A reply cut at the length limit by a greedy loop ends this way.
    """
    a = np.asarray(ids, dtype=np.int64)
    n, best = len(a), None
    for p in range(1, min(max_period, n // 2) + 1):
        differ = np.flatnonzero(a[:-p] != a[p:])
        start = int(differ[-1]) + 1 if len(differ) else 0  # a[start:] repeats with period p
        if n - start >= max(2 * p, min_span) and (best is None or start < best[0]):
            best = (start, p)
    return best


def bucket_for(length: int, buckets: list[int]) -> int:
    """The smallest bucket length >= length (buckets are sorted ascending)."""
    return buckets[bisect.bisect_left(buckets, length)]


CUT_REPLIES = ("mask_end", "drop", "cut_loop")  # tokenize.cut_replies (the schema's enum; a test binds them)


@dataclass(frozen=True)
class _Rules:
    """How a row becomes a training sample (tokenize_expanded's settings, resolved)."""

    buckets: list[int]  # sorted: the largest is the maximum length
    min_loss_tokens: int  # MIN_LOSS_TOKENS
    chat_template_kwargs: dict | None
    cut_replies: str
    reply_ids: str

    @property
    def max_length(self) -> int:
        return self.buckets[-1]


@dataclass
class _Tally:
    """What happened to the rows: counted as they are tokenized, reported in the stats."""

    dropped: Counter = field(default_factory=Counter)  # by reason
    truncated: int = 0
    cut_masked: int = 0  # cut replies kept, their end of turn out of the loss
    loops_cut: int = 0
    id_outcomes: Counter = field(default_factory=Counter)  # encode_chat's info["ids"] per tokenized reply
    turns: Counter = field(default_factory=Counter)  # the target's replies: regenerated, trained, not_maskable, ...
    unanswered: Counter = field(default_factory=Counter)  # user turns without a reply of the target, by reason


#: the fewest loss tokens a sample is kept with: an anchor and the token after it (a run's training asks
#: for 2 x drafter.block_size of them: dflashpipe.training.data.run_data)
MIN_LOSS_TOKENS = 2


# reason: tokenize's keys, one keyword each (the script passes them by name), beside the inputs and outputs
def tokenize_expanded(
    expanded_paths: dict[str, str],
    target_path: str,
    buckets: list[int],
    out_dir: str,
    stats_path: str,
    chat_template_kwargs: dict | None = None,
    cut_replies: str = "mask_end",
    reply_ids: str = "text",
    log=print,
) -> dict:
    """Tokenize every expanded dataset into ONE ``datasets`` dataset on disk, plus a stats JSON.

    ``reply_ids`` (``tokenize.reply_ids``): ``text`` trains on the re-tokenized reply text and
    counts the replies whose generated ids differ; ``generated`` uses the generated ids for them
    where the template renders the reply verbatim. ``text`` is the default because it trained the
    better drafter (measured: docs/design.md).
    """
    from tqdm import tqdm

    from dflashpipe.inputs.target import load_tokenizer

    rules = _Rules(sorted(buckets), MIN_LOSS_TOKENS, chat_template_kwargs, cut_replies, reply_ids)
    tokenizer = load_tokenizer(target_path)
    if cut_replies not in CUT_REPLIES:
        raise UserError(f"tokenize.cut_replies: {cut_replies!r} is not one of {', '.join(CUT_REPLIES)}")
    if reply_ids not in ("text", "generated"):
        raise UserError(f"tokenize.reply_ids: {reply_ids!r} is not one of text, generated")
    records, tally, per_dataset = [], _Tally(), {}
    for name, path in expanded_paths.items():
        df = read_parquet(path)
        kept_before = len(records)
        for row in tqdm(df.itertuples(index=False), total=len(df), desc=f"tokenize {name}", mininterval=5):
            record = _sample(row, name, tokenizer, rules, tally)
            if record is not None:
                records.append(record)
        per_dataset[name] = {"rows": len(df), "kept": len(records) - kept_before}
    if not records:
        raise UserError(
            f"tokenize: no sample left after filtering ({dict(tally.dropped)}); every reply needs >= "
            f"{rules.min_loss_tokens} loss tokens within tokenize.buckets' largest length {rules.max_length}: "
            "raise expand.max_new_tokens or the largest bucket"
        )
    save_tokenized(records, out_dir)
    stats = _stats(records, rules, tally, per_dataset, target_path)
    write_json(stats_path, stats)
    log(f"tokenized: {stats['samples']} samples, {stats['tokens']} tokens, {stats['loss_tokens']} loss tokens, "
        f"dropped {dict(tally.dropped)}")
    return stats


def _sample(row, name: str, tokenizer, rules: _Rules, tally: _Tally) -> dict | None:
    """One expanded row as a training sample, or None (dropped, and counted by reason)."""
    dropped = tally.dropped
    messages = [dict(t) for t in row.messages]
    reason = str(getattr(row, "finish_reason", ""))
    earlier = _earlier_turns(row, rules, tally)
    if reason.startswith("skipped_"):  # the expansion could not use the prompt
        dropped[reason] += 1
        return None
    if not messages[-1]["content"].strip():
        dropped["empty_response"] += 1
        return None
    cut = reason == "length"
    if cut and rules.cut_replies == "drop":
        dropped["cut_reply"] += 1
        return None
    gen = getattr(row, "token_ids", None)  # absent (an older expansion) or null: the text only
    gen = None if gen is None or isinstance(gen, float) else gen
    if cut and rules.cut_replies == "cut_loop":
        reply = list(gen) if gen is not None else tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        loop = loop_start(reply)
        if loop is not None:  # keep the reply up to its loop's first occurrence
            kept = reply[: loop[0] + loop[1]]
            messages[-1]["content"] = tokenizer.decode(kept, skip_special_tokens=True)
            gen = kept if gen is not None else None  # a reply without generated ids stays without
            tally.loops_cut += 1
    info = {}
    try:
        ids, mask, full_len = encode_chat(tokenizer, messages, rules.max_length, rules.chat_template_kwargs, cut=cut,
                                          reply_ids=None if gen is None else list(gen), info=info,
                                          use_reply_ids=rules.reply_ids == "generated", earlier=earlier)
    except ValueError:
        dropped["cut_reply_not_maskable"] += 1
        return None
    tally.id_outcomes[info["ids"]] += 1
    for (_, _, turn_cut), outcome in zip(earlier, info.get("turns", [])):  # the earlier replies
        tally.id_outcomes[outcome] += outcome != "not_maskable"
        tally.turns["not_maskable"] += outcome == "not_maskable"
        tally.turns["cut_end_out_of_the_loss"] += turn_cut and outcome != "not_maskable"
    tally.truncated += full_len > rules.max_length
    n_loss = sum(mask)
    if n_loss == 0 and len(ids) == rules.max_length:
        dropped["prompt_fills_max_length"] += 1
        return None
    if n_loss < rules.min_loss_tokens:
        dropped[f"fewer_than_{rules.min_loss_tokens}_loss_tokens"] += 1
        return None
    tally.cut_masked += cut
    segments = int(mask[0]) + sum(b > a for a, b in zip(mask, mask[1:]))
    tally.turns["trained"] += segments
    tally.turns["samples_with_several"] += segments > 1
    return {
        "dataset": name,
        "id": str(row.id),
        "sample": int(getattr(row, "sample", 0)),
        "input_ids": ids,
        "loss_mask": mask,
        "length": len(ids),
        "num_loss_tokens": n_loss,
        "bucket": bucket_for(len(ids), rules.buckets),
    }


def _earlier_turns(row, rules: _Rules, tally: _Tally) -> list[tuple[int, list[int] | None, bool]]:
    """The target's replies before the last one in an expanded row (``turns``: expand.turns all), as
    :func:`encode_chat` takes them (``cut_replies: drop`` leaves a cut one out of the loss, counted); counts
    the row's replies and its unanswered user turns."""
    turns = getattr(row, "turns", None)  # absent: an expansion of one reply per row
    if turns is None or isinstance(turns, float):
        return []
    turns = list(turns)
    tally.turns["regenerated"] += len(turns)
    why = getattr(row, "unanswered", None)
    if isinstance(why, str) and row.user_turns > len(turns):
        tally.unanswered[why] += int(row.user_turns - len(turns))
    earlier = []
    for t in turns[:-1]:
        cut = t["finish_reason"] == "length"
        if cut and rules.cut_replies == "drop":
            tally.turns["cut_left_out"] += 1
            continue
        earlier.append((int(t["message"]), None if t["token_ids"] is None else list(t["token_ids"]), cut))
    return earlier


def _stats(records: list[dict], rules: _Rules, tally: _Tally, per_dataset: dict, target_path: str) -> dict:
    dropped, id_outcomes = tally.dropped, tally.id_outcomes
    lengths = [r["length"] for r in records]
    return {
        "samples": len(records),
        "tokens": int(sum(lengths)),
        "loss_tokens": int(sum(r["num_loss_tokens"] for r in records)),
        "dropped": dict(dropped),
        "dropped_total": int(sum(dropped.values())),
        "truncated": int(tally.truncated),
        "cut_replies": {"rule": rules.cut_replies, "kept_with_end_of_turn_out_of_the_loss": int(tally.cut_masked),
                        "cut_at_their_loop": int(tally.loops_cut),
                        "dropped": int(dropped["cut_reply"] + dropped["cut_reply_not_maskable"])},
        "chat_template_kwargs": dict(rules.chat_template_kwargs or {}),
        "generated_ids": {
            "rule": ("a reply whose re-tokenized text differs from the ids the target generated gets the generated "
                     "ids when the chat template renders the reply verbatim; otherwise the re-tokenized text is kept"
                     if rules.reply_ids == "generated" else
                     "the re-tokenized reply text is trained on; replies whose generated ids differ are counted"),
            "tokenize.reply_ids": rules.reply_ids,
            "replies_with_ids": int(sum(v for k, v in id_outcomes.items() if k != "none")),
            "replies_without_ids": int(id_outcomes["none"]),
            "retokenized_differently": int(id_outcomes["generated"] + id_outcomes["retokenized"]),
            "used_generated_ids": int(id_outcomes["generated"]),
            "kept_retokenized_text": int(id_outcomes["retokenized"]),
        },
        "turns": {
            "rule": ("every reply the target wrote is in the loss, one segment each, where the chat template renders "
                     "it as written inside the whole chat (expand.turns: all answers a chat turn by turn)"),
            "regenerated": int(tally.turns["regenerated"]),
            "trained": int(tally.turns["trained"]),
            "not_maskable": int(tally.turns["not_maskable"]),
            "cut_end_out_of_the_loss": int(tally.turns["cut_end_out_of_the_loss"]),
            "cut_left_out": int(tally.turns["cut_left_out"]),
            "samples_with_several": int(tally.turns["samples_with_several"]),
            "unanswered": dict(tally.unanswered),
        },
        "min_loss_tokens": rules.min_loss_tokens,
        "max_length": rules.max_length,
        "buckets": {str(b): sum(r["bucket"] == b for r in records) for b in rules.buckets},
        "per_dataset": per_dataset,
        "mean_length": sum(lengths) / len(lengths),
        "target_path": str(target_path),
    }
