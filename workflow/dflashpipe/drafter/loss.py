"""Decay-weighted cross-entropy through the target's LM head, chunked.

The [B*Q, V] logits (Q = N*bs, e.g. 8192 x 151k for Qwen3) never exist at once:
the LM head + CE run over chunks of rows, and so does the backward.

Approach: a custom ``autograd.Function`` that, in its forward, computes per
chunk the logits, the loss and (when a gradient is needed) the gradient of the
loss w.r.t. the hidden rows (and the LM head weight, only if it requires grad),
then drops the chunk's logits. The backward only scales the stored gradients by
the incoming scalar. This is the "fused linear cross-entropy" trick: one LM head
matmul forward plus one for the gradient, no recompute, peak memory one chunk of
logits. Positions with zero weight are dropped before the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def _chunk_stats(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor, need_grad: bool, fp32_grad: bool = False):
    """One chunk: (sum w*CE, sum w*correct, d(sum w*CE)/d logits or None).

    logits [c, V] in the LM head's dtype, y [c] long, w [c] fp32; the math runs in
    fp32 and the gradient comes back in the logits' dtype (fp32 with
    ``fp32_grad``, for accumulating an LM-head weight gradient). Compiled (see
    :func:`compiled_chunk_ce`), this is one or two fused passes over the logits
    instead of a dozen eager kernels each reading or writing a [c, V] fp32 tensor.
    """
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    tgt = x.gather(1, y[:, None])[:, 0]
    loss_sum = ((lse - tgt) * w).sum()
    correct = ((x.argmax(dim=-1) == y).float() * w).sum()
    if not need_grad:
        return loss_sum, correct, None
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y[:, None]
    g = (torch.exp(x - lse[:, None]) - onehot.float()) * w[:, None]  # w * (softmax - onehot)
    return loss_sum, correct, g if fp32_grad else g.to(logits.dtype)


@dataclass(frozen=True)
class ChunkCE:
    """How a chunk is reduced: ``fn`` (eager or compiled :func:`_chunk_stats`); with
    ``static_shape`` the last chunk is padded with weight-0 rows to the chunk size, so
    every chunk has one shape (one compiled graph, no recompiles)."""

    fn: Callable = _chunk_stats
    static_shape: bool = False


EAGER_CE = ChunkCE()


def compiled_chunk_ce() -> ChunkCE:
    """The per-chunk CE compiled, at one static chunk shape."""
    return ChunkCE(torch.compile(_chunk_stats, dynamic=False), static_shape=True)


class _ChunkedLinearCE(torch.autograd.Function):
    """(h [M, H], W [V, H], labels [M], w [M] float, chunk, ChunkCE) -> (sum_i w_i*CE_i, sum_i w_i*[argmax_i == label_i])."""

    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk_size, ce):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, h.shape[0], chunk_size):
            hc = h[s : s + chunk_size].to(weight.dtype)  # the LM head runs in its own dtype
            yc, wc = labels[s : s + chunk_size], w[s : s + chunk_size].float()
            n = hc.shape[0]
            if ce.static_shape and n < chunk_size:  # one static shape for the compiled chunk
                pad = chunk_size - n
                hc = torch.cat([hc, hc.new_zeros(pad, hc.shape[1])])
                yc, wc = torch.cat([yc, yc.new_zeros(pad)]), torch.cat([wc, wc.new_zeros(pad)])
            logits = hc @ weight.t()  # [c, V]
            lsum, csum, g = ce.fn(logits, yc, wc, need_h or need_w, need_w)
            loss_sum += lsum
            correct += csum
            del logits
            if g is not None:
                if need_h:
                    grad_h[s : s + n] = (g[:n].to(weight.dtype) @ weight).to(h.dtype)
                if need_w:
                    grad_w += g[:n].t() @ hc[:n].float()
                del g
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (need_h, need_w)
        ctx.w_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        gh = gw = None
        if need_h:
            grad_h = saved.pop(0)
            gh = grad_h * grad_loss.to(grad_h.dtype)
        if need_w:
            gw = (saved.pop(0) * grad_loss).to(ctx.w_dtype)
        return gh, gw, None, None, None, None


def decayed_ce(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 1024,
    reduction: str = "mean",
    ce: ChunkCE = EAGER_CE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted-mean CE and weighted top-1 accuracy of the drafter's predictions.

    hidden [B, Q, H] (final-normed drafter output), lm_head_weight [V, H] (the
    target's, usually frozen), labels [B, Q] long, weights [B, Q] float.
    Returns (loss, acc), both 0-dim float32 tensors; loss carries the gradient.
    Rows with weight 0 are skipped; if every weight is 0 both are 0 (and the
    loss stays connected to ``hidden`` so backward still works). Skipping uses a
    data-dependent ``nonzero`` (one host sync): call this outside any
    ``torch.compile``d region. Logits and CE are computed in fp32.

    ``reduction="sum"`` returns the weighted SUMS (sum w*CE, sum w*correct)
    instead; data-parallel training divides them by the all-reduced weight sum
    so the loss is normalised over the global batch. ``ce``: how a chunk is
    reduced (eager by default; :func:`compiled_chunk_ce`).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"decayed_ce: reduction must be 'mean' or 'sum', got {reduction!r}")
    H = hidden.shape[-1]
    h = hidden.reshape(-1, H)
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    idx = (w > 0).nonzero(as_tuple=True)[0]
    total = w.sum()
    if idx.numel() == 0:
        zero = (hidden.sum() * 0.0).float()
        return zero, zero.detach()
    loss_sum, correct = _ChunkedLinearCE.apply(h[idx], lm_head_weight, y[idx], w[idx], int(chunk_size), ce)
    if reduction == "sum":
        return loss_sum, correct
    return loss_sum / total, correct / total
