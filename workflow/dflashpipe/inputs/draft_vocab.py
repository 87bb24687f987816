"""A draft vocabulary: the tokens most frequent in the trained replies (``evaluate.draft_vocab``).

A draft reads the target's whole LM head to pick one token per block position: at Qwen3-8B's shapes
that head is 1.2 GB of the draft's 3.2 GB (docs/decoding.md). Drafting among the N tokens the training
replies use most reads N rows instead of all of them; a draft whose right token is outside them is
rejected by the verify, so decoding stays lossless and only acceptance can fall. The share of the
trained reply tokens the N cover (``coverage``) is a guide to how much: a DFlash draft the whole
vocabulary would have got right is lost only where the target's token is outside the N, which on
held-out prompts may happen more often than on the training replies.
"""

from __future__ import annotations

import numpy as np

from dflashpipe.inputs.tokenized import load_tokenized
from dflashpipe.jobs.atomic import write_json
from dflashpipe.jobs.errors import UserError


def count_reply_tokens(tokenized_dir: str) -> np.ndarray:
    """How often each token id occurs at a trained position (loss mask 1) of the tokenized dataset."""
    ds = load_tokenized(tokenized_dir)
    counts = np.zeros(0, dtype=np.int64)
    for batch in ds.data.to_batches():  # pyarrow record batches: flat numpy arrays, no Python rows
        ids = batch.column("input_ids").flatten().to_numpy()
        mask = batch.column("loss_mask").flatten().to_numpy()
        c = np.bincount(ids[mask == 1], minlength=len(counts))
        counts = np.pad(counts, (0, len(c) - len(counts))) + c
    return counts


def top_tokens(counts: np.ndarray, n: int) -> np.ndarray:
    """The ids of the ``n`` most counted tokens (ties: the lower id first; never-seen tokens left out), ascending."""
    seen = np.flatnonzero(counts)
    order = seen[np.lexsort((seen, -counts[seen]))]  # by count descending, then id ascending
    return np.sort(order[:n])


def write_draft_vocab(tokenized_dir: str, n: int, out_path: str, log=print) -> dict:
    """The draft vocabulary of ``n`` tokens (fewer if the replies use fewer) -> ``out_path`` (JSON: the ids
    ascending, the size asked and got, the trained reply tokens counted and the share they cover)."""
    counts = count_reply_tokens(tokenized_dir)
    total = int(counts.sum())
    if total == 0:
        raise UserError(f"{tokenized_dir}: no trained reply tokens to count (evaluate.draft_vocab needs the "
                        "tokenized training data); check the training datasets, or set evaluate.draft_vocab: 0")
    ids = top_tokens(counts, n)
    out = {"requested": int(n), "size": int(len(ids)), "reply_tokens": total, "distinct": int(np.count_nonzero(counts)),
           "coverage": float(counts[ids].sum() / total), "ids": [int(i) for i in ids]}
    write_json(out_path, out)
    log(f"draft vocabulary: {out['size']} of {out['distinct']} distinct reply tokens, covering "
        f"{100 * out['coverage']:.2f}% of {total} trained reply tokens")
    return out
