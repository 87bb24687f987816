"""The evaluation's lossless check: greedy DFlash must decode what greedy AR decodes, token for token.

:func:`check_lossless` compares the two loops' outputs (:mod:`dflashpipe.decode.speculative`) prompt by
prompt; in reduced precision a divergence can be a numerical near-tie of the target's top two logits,
which :func:`logit_gap` measures and :func:`default_tie_tolerance` bounds (the ``ties`` mode of
:func:`dflashpipe.evaluate.run.evaluate_dataset`).
"""

from __future__ import annotations

import torch

from dflashpipe.decode.speculative import DecodeResult
from dflashpipe.jobs.errors import UserError


def check_lossless(prompts, dflash_outputs, ar_outputs, near_tie=None) -> list[dict]:
    """Raise :class:`UserError` naming the first prompt whose greedy DFlash output differs from greedy AR.

    ``prompts``: prompt ids (or dicts / objects with an ``id``), in the same order
    as the outputs; outputs: token lists or :class:`DecodeResult`.

    ``near_tie`` (optional): ``near_tie(index, position, dflash_token, ar_token)
    -> dict | None``; a dict excuses that divergence as a numerical near-tie of
    the target's top logits (reduced precision: a block forward and a one-token
    forward round differently) and is returned in the list of excused
    divergences. Without it the check is exact.
    """

    def _id(p):
        if isinstance(p, dict):
            return p.get("id")
        return getattr(p, "id", p)

    def _toks(o):
        return list(o.tokens if isinstance(o, DecodeResult) else o)

    prompts, dflash_outputs, ar_outputs = list(prompts), list(dflash_outputs), list(ar_outputs)
    if not len(prompts) == len(dflash_outputs) == len(ar_outputs):
        raise ValueError(f"check_lossless: {len(prompts)} prompts, {len(dflash_outputs)} DFlash and {len(ar_outputs)} AR outputs")
    excused = []
    for i, (p, d, a) in enumerate(zip(prompts, dflash_outputs, ar_outputs)):
        d, a = _toks(d), _toks(a)
        if d == a:
            continue
        pos = next((k for k, (x, y) in enumerate(zip(d, a)) if x != y), min(len(d), len(a)))
        got = d[pos] if pos < len(d) else None
        want = a[pos] if pos < len(a) else None
        if near_tie is not None and got is not None and want is not None:
            tie = near_tie(i, pos, got, want)
            if tie is not None:
                excused.append({"id": _id(p), "position": pos, "dflash_token": got, "ar_token": want, **tie})
                continue
        raise UserError(
            f"lossless check failed: prompt id {_id(p)!r}: greedy DFlash output differs from greedy autoregressive "
            f"decoding at output position {pos} (DFlash {'<end>' if got is None else got}, AR {'<end>' if want is None else want}; "
            f"lengths {len(d)} vs {len(a)})"
        )
    return excused


def logit_gap(target_model, prompt_ids: list[int], prefix: list[int], tok_a: int, tok_b: int) -> dict:
    """Target logits after ``prompt + prefix`` (one full forward, no cache): gap between two tokens.

    Returns {gap: l[a] - l[b], scale: max(|l[a]|, |l[b]|, 1), top: max logit}.
    """
    dev = next(target_model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(prefix)], device=dev)
    with torch.no_grad():
        logits = target_model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    la, lb = float(logits[tok_a]), float(logits[tok_b])
    return {"gap": la - lb, "scale": max(abs(la), abs(lb), 1.0), "top": float(logits.max())}


def default_tie_tolerance(dtype: torch.dtype) -> float:
    """Relative logit gap below which a greedy divergence counts as a numerical near-tie.

    bf16/fp16: 2**-5 (a few bf16 ulps after dozens of layers); fp32/fp64: 1e-4.
    """
    return 2.0**-5 if dtype in (torch.bfloat16, torch.float16) else 1e-4
