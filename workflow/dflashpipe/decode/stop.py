"""The decoders' stop rule: which of a step's tokens reach the output, and why the output ends.

Every decoder in :mod:`dflashpipe.decode` and the evaluation's accounting
(:mod:`dflashpipe.evaluate.metrics`) cut by this one function, so a speculative step and an
autoregressive one end an output at the same token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cut_step(step_tokens: Sequence[int], n_out: int, max_new_tokens: int, stop_ids: Iterable[int]) -> tuple[list[int], str | None]:
    """Tokens of one step that reach the output, and why the output ends (or None).

    ``n_out``: tokens already in the output. The step's tokens are cut at the
    first stop token (kept, like HF ``generate``) and at ``max_new_tokens``.
    Returns ``(kept, reason)`` with reason ``"eos"``, ``"length"`` or None.
    """
    stop = set(int(t) for t in stop_ids)
    budget = max(0, int(max_new_tokens) - int(n_out))
    kept: list[int] = []
    for t in step_tokens:
        if len(kept) >= budget:
            return kept, "length"
        kept.append(int(t))
        if int(t) in stop:
            return kept, "eos"
    if n_out + len(kept) >= max_new_tokens:
        return kept, "length"
    return kept, None
