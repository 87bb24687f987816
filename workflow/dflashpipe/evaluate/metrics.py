"""Speculative-decoding metrics as pure functions on per-step acceptance records.

Vocabulary (one response, batch size 1):

* the **first token** comes from the prefill forward; it belongs to no verify step
  and its time is prefill time, not decode time;
* a **verify step** drafts a block ``[last, MASK x (bs-1)]``, verifies it with ONE
  target forward, and accepts ``a`` draft tokens (``0 <= a <= bs-1``, the length of
  the matching prefix), so it commits ``a + 1`` tokens (accepted + the target's
  bonus token);
* **cutting**: the output ends at the first stop token (inclusive) or at
  ``max_new_tokens``. A step's tokens past that point never reach the output.

Two conventions for tau (mean committed tokens per verify step):

* ``tau`` (this pipeline's headline): counts only tokens that reach the output,
  i.e. the LAST step is cut. The DFlash authors' benchmark counts the same way
  since z-lab/dflash commit 10129599;
* ``tau_uncut``: ``a + 1`` for every step, counted before cutting, as the
  authors' benchmark did before that commit (e.g. e763f23); it can overstate
  tau on short outputs.

Histogram and per-position acceptance use the raw accept lengths ``a`` (what the
drafter achieved; cutting is an artefact of the output length, not of drafting).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dflashpipe.decode.stop import cut_step  # the decoders' stop rule: the accounting cuts as they do


@dataclass
class Accounting:
    """Output and per-step counts of a response after cutting."""

    output: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # per step, tokens reaching the output
    committed_raw: list[int] = field(default_factory=list)  # per step, a + 1 before cutting
    stop_reason: str = "length"


def account_steps(first: Sequence[int], steps: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Iterable[int]) -> Accounting:
    """Replay a decode: ``first`` = tokens of the prefill step (usually one),
    ``steps`` = each verify step's committed tokens BEFORE cutting.

    Steps after the output has ended are ignored (a real loop would not run them).
    """
    stop_ids = list(stop_ids)
    acc = Accounting()
    kept, reason = cut_step(first, 0, max_new_tokens, stop_ids)
    acc.output.extend(kept)
    if reason is not None:
        acc.stop_reason = reason
        return acc
    for tokens in steps:
        kept, reason = cut_step(tokens, len(acc.output), max_new_tokens, stop_ids)
        acc.output.extend(kept)
        acc.committed.append(len(kept))
        acc.committed_raw.append(len(tokens))
        if reason is not None:
            acc.stop_reason = reason
            return acc
    acc.stop_reason = "unfinished"
    return acc


# ---------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------


def _nan() -> float:
    return float("nan")


def tau(committed: Sequence[int]) -> float:
    """Mean committed tokens per verify step of ONE response (NaN without steps)."""
    return sum(committed) / len(committed) if len(committed) else _nan()


def tau_mean(per_response: Sequence[Sequence[int]]) -> float:
    """tau per response, then averaged over responses that have at least one step."""
    vals = [tau(c) for c in per_response if len(c)]
    return sum(vals) / len(vals) if vals else _nan()


def tau_pooled(per_response: Sequence[Sequence[int]]) -> float:
    """All committed tokens over all verify steps of all responses."""
    steps = sum(len(c) for c in per_response)
    return sum(sum(c) for c in per_response) / steps if steps else _nan()


def acceptance_histogram(accepted: Iterable[int], block_size: int) -> list[int]:
    """Counts of steps that accepted 0, 1, ..., bs-1 draft tokens."""
    hist = [0] * int(block_size)
    for a in accepted:
        if not 0 <= a < block_size:
            raise ValueError(f"accept length {a} outside 0..{block_size - 1}")
        hist[a] += 1
    return hist


def per_position_acceptance(accepted: Iterable[int], block_size: int) -> list[float]:
    """For k = 1..bs-1: P(draft position k accepted | positions < k accepted).

    Position k is accepted iff a >= k; all earlier ones iff a >= k-1. So the
    rate is #(a >= k) / #(a >= k-1) (NaN where the denominator is 0).
    """
    accepted = list(accepted)
    out = []
    for k in range(1, int(block_size)):
        den = sum(a >= k - 1 for a in accepted)
        num = sum(a >= k for a in accepted)
        out.append(num / den if den else _nan())
    return out


# ---------------------------------------------------------------------------
# Speed
# ---------------------------------------------------------------------------


def tokens_per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else _nan()


def speedup(ar_seconds: float, ar_tokens: int, method_seconds: float, method_tokens: int) -> float:
    """AR time per output token / method time per output token (decode only)."""
    if ar_tokens <= 0 or method_tokens <= 0 or method_seconds <= 0:
        return _nan()
    return (ar_seconds / ar_tokens) / (method_seconds / method_tokens)


def speedup_spread(ar: Sequence[tuple[float, int]], method: Sequence[tuple[float, int]], resamples: int = 2000,
                   seed: int = 0, level: float = 0.95) -> dict:
    """How far a pooled speed-up can be trusted: per prompt ``(decode seconds, decode tokens)`` of AR and of the
    method, paired by prompt.

    ``median_per_prompt``: the median of the prompts' own speed-ups (one slow prompt cannot move it);
    ``ci_low``/``ci_high``: the pooled speed-up's ``level`` interval by bootstrap over prompts (the prompts
    resampled with replacement, ``resamples`` times, seeded: the same timings give the same interval).
    NaN where fewer than two prompts have timings."""
    import random

    pairs = [(a, m) for a, m in zip(ar, method) if a[1] > 0 and m[1] > 0 and m[0] > 0 and a[0] > 0]
    per_prompt = sorted(speedup(a[0], a[1], m[0], m[1]) for a, m in pairs)
    if len(pairs) < 2:
        return {"median_per_prompt": per_prompt[0] if per_prompt else _nan(), "ci_low": _nan(), "ci_high": _nan()}
    n = len(pairs)
    median = per_prompt[n // 2] if n % 2 else (per_prompt[n // 2 - 1] + per_prompt[n // 2]) / 2
    rng = random.Random(seed)
    stats = []
    for _ in range(resamples):
        pick = [pairs[rng.randrange(n)] for _ in range(n)]
        stats.append(speedup(sum(a[0] for a, _ in pick), sum(a[1] for a, _ in pick),
                             sum(m[0] for _, m in pick), sum(m[1] for _, m in pick)))
    stats.sort()
    tail = (1 - level) / 2
    return {"median_per_prompt": median, "ci_low": stats[int(tail * resamples)],
            "ci_high": stats[min(resamples - 1, int((1 - tail) * resamples))]}


def interleaved_order(methods: Sequence[str], prompt: int) -> list[str]:
    """The order the methods decode prompt ``prompt`` in: the list rotated by the prompt's index, so that every
    method runs first (and after each other method) equally often, and a slow spell of the machine falls on
    all of them alike."""
    k = prompt % len(methods) if methods else 0
    return [*methods[k:], *methods[:k]]


def other_busy_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Cores other processes kept busy between two readings of (wall seconds, the machine's busy CPU seconds,
    this process's CPU seconds): what the machine's busy time grew by beyond this process's own, over the wall
    time (never below 0). Unlike the 1-minute load average it does not lag: it covers exactly the span."""
    wall = end[0] - start[0]
    if wall <= 0:
        return 0.0
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / wall)


#: cores other processes may keep busy beyond those this job leaves free before the machine counts as busy
BUSY_SLACK_CORES = 0.5


def machine_busy(others: float, cores: int, own_threads: int) -> bool:
    """Whether other processes competed with the timed decodes: they kept busy more than the cores this job
    leaves free (``cores - own_threads``: another evaluation job on its own core is no competition) plus
    :data:`BUSY_SLACK_CORES`."""
    return others > max(0, cores - own_threads) + BUSY_SLACK_CORES


#: evaluate.timing_repeats: auto: a prompt's decodes are timed again while all its rounds take at most this long
AUTO_ROUNDS_BUDGET_S = 0.5
#: ... and in at most this many rounds
AUTO_ROUNDS_MOST = 3


def auto_rounds(first_round_s: float, budget_s: float = AUTO_ROUNDS_BUDGET_S, most: int = AUTO_ROUNDS_MOST) -> int:
    """How many rounds a prompt's decodes are timed in (``evaluate.timing_repeats: auto``), given its first
    round's seconds (every method once): as many as fit the budget, 1 to ``most``. Repeating costs at most the
    budget per prompt, so it happens where decodes are cheap (a small target on a GPU), not where they take
    seconds (the CPU, eager peers)."""
    if first_round_s <= 0:
        return most
    return max(1, min(most, int(budget_s // first_round_s)))


def median_run(runs: Sequence, seconds) -> object:
    """The run of median time ``seconds(run)`` among a prompt's repeated decodes (the lower middle of an even
    count): one real run, so that its tokens, prefill and decode times belong together."""
    return sorted(runs, key=seconds)[(len(runs) - 1) // 2]


def finite_or_none(x):
    """JSON-friendly: NaN/inf -> None (recursively through lists and dicts)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    return x
