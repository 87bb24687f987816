"""The drafter's loss through the target's LM head, chunked: CE on the data, or KL to the target.

The [B*Q, V] logits (Q = N*bs, e.g. 8192 x 151k for Qwen3) never exist at once:
the LM head and the loss run over chunks of rows, and so does the backward.

Approach: a custom ``autograd.Function`` that, in its forward, computes per
chunk the logits, the loss and (when a gradient is needed) the gradient of the
loss w.r.t. the hidden rows (and the LM head weight, only if it requires grad),
then drops the chunk's logits. The backward only scales the stored gradients by
the incoming scalar. This is the "fused linear cross-entropy" trick: one LM head
matmul forward plus one for the gradient, no recompute, peak memory one chunk of
logits. Positions with zero weight are dropped before the LM head.

What is minimised per row (:class:`Objective`), weighted by the row's position weight:

* ``ce``: cross-entropy with the data's next token (the paper's recipe);
* ``kl``: KL(p || q) from the target's own next-token distribution p (its LM head
  on its last hidden state at the position before the label: the teacher rows,
  chunked the same way) to the drafter's q: distillation;
* ``dspark``: DSpark's (DeepSpec's recipe): 0.1 x the cross-entropy with the data's token
  + 0.9 x the L1 distance sum |p - q| to the target's p (twice the total variation);
* plus, with ``tv_weight`` > 0, that multiple of the total variation
  0.5 * sum |p - q| (p: the teacher, or the one-hot label for ``ce``), whose
  complement is the probability that speculative sampling accepts the draft.

DFlash 2's logits are scaled (``multiplier``) and soft-capped (``cap``) before the
softmax; the gradient goes through both. DSpark's Markov head adds a low-rank term to every
row's logits, ``e_i @ W2.T`` (e_i: the head's embedding of the token before the row's label):
the chunks add it, and their gradient reaches e and W2. With ``accept``, the chunks also give
each row's acceptance 1 - TV(p, q) (no gradient): DSpark's confidence head learns it
(:func:`confidence_loss`). Accuracy (top-1 = the data's label) is
counted the same way for every objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

#: DSpark's weights of its cross-entropy, L1 distance and confidence terms (DeepSpec's recipe:
#: ce_loss_alpha, l1_loss_alpha, confidence_head_alpha)
DSPARK_CE, DSPARK_L1, DSPARK_CONFIDENCE = 0.1, 0.9, 1.0


@dataclass(frozen=True)
class Objective:
    """What a row's loss is (see the module docstring); hashable, so compiled chunks can guard on it."""

    loss: str = "ce"
    tv_weight: float = 0.0
    multiplier: float = 1.0
    cap: float | None = None
    accept: bool = False  # also each row's acceptance 1 - TV(p, q) (DSpark's confidence target)

    @property
    def needs_teacher(self) -> bool:
        return self.loss in ("kl", "dspark")


CE = Objective()


class ChunkStats(NamedTuple):
    """What :func:`_chunk_stats` gives of a chunk of c rows."""

    loss: torch.Tensor  # [c] per row
    correct: torch.Tensor  # [c] 1.0 where the top-1 is the label
    grad: torch.Tensor | None  # [c, V] d loss_row / d logits, or None
    accept: torch.Tensor | None  # [c] 1 - TV(p, q), with obj.accept
    teacher_argmax: torch.Tensor | None  # [c], with a teacher
    group_max: torch.Tensor | None  # [c, V / group] the raw logits' maxima per group of columns, with group


def _chunk_stats(logits, y, teacher, obj: Objective, grad: torch.dtype | None, group: int = 0) -> ChunkStats:
    """One chunk of rows (:class:`ChunkStats`).

    logits [c, V] (the drafter's, before any transform) in the LM head's dtype; y [c]
    long; teacher [c, V] (the target's logits) or None. The math runs in fp32; the gradient
    is returned in dtype ``grad`` (None: not computed). ``group`` (dividing V, or 0): also the
    maxima of each ``group`` columns (:func:`top_k_by_groups`). Compiled (see
    :func:`compiled_chunk_ce`), this is a few fused passes over the logits instead of a dozen
    eager kernels.
    """
    group_max = logits.view(logits.shape[0], -1, group).amax(-1) if group else None
    raw = logits.float()
    x = raw * obj.multiplier if obj.multiplier != 1.0 else raw
    if obj.cap is not None:
        x = torch.tanh(x / obj.cap) * obj.cap
    lse = torch.logsumexp(x, dim=-1)
    correct = (x.argmax(dim=-1) == y).float()
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == y[:, None]
    ce = lse - x.gather(1, y[:, None])[:, 0]
    teacher_argmax = None
    if teacher is None:
        p = onehot.float()
    else:
        log_p = torch.log_softmax(teacher.float(), dim=-1)
        p = log_p.exp()
        teacher_argmax = teacher.argmax(dim=-1)  # fused with the softmax's pass over the teacher
    q = torch.exp(x - lse[:, None])
    l1 = (q - p).abs().sum(-1) if obj.loss == "dspark" or obj.tv_weight > 0 or obj.accept else None
    if obj.loss == "ce":
        per_row = ce
    elif obj.loss == "dspark":
        per_row = DSPARK_CE * ce + DSPARK_L1 * l1
    else:
        per_row = (p * (log_p - (x - lse[:, None]))).sum(-1)
    l1_weight = (DSPARK_L1 if obj.loss == "dspark" else 0.0) + 0.5 * obj.tv_weight
    if obj.tv_weight > 0:
        per_row = per_row + obj.tv_weight * 0.5 * l1
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0) if obj.accept else None
    if grad is None:
        return ChunkStats(per_row, correct, None, accept, teacher_argmax, group_max)
    g = DSPARK_CE * (q - onehot.float()) if obj.loss == "dspark" else q - p  # d(CE, KL or its CE part)/dx
    if l1_weight > 0:
        s = torch.sign(q - p)
        g = g + l1_weight * q * (s - (s * q).sum(-1, keepdim=True))
    if obj.cap is not None:
        g = g * (1.0 - (x / obj.cap) ** 2)
    if obj.multiplier != 1.0:
        g = g * obj.multiplier
    return ChunkStats(per_row, correct, g.to(grad), accept, teacher_argmax, group_max)


@dataclass(frozen=True)
class ChunkCE:
    """How a chunk is reduced: ``fn`` (eager or compiled :func:`_chunk_stats`); with
    ``static_shape`` the last chunk is padded with weight-0 rows to the chunk size, so
    every chunk has one shape (one compiled graph, no recompiles)."""

    fn: Callable = _chunk_stats
    static_shape: bool = False


EAGER_CE = ChunkCE()


def compiled_chunk_ce() -> ChunkCE:
    """The per-chunk loss compiled, at one static chunk shape."""
    return ChunkCE(torch.compile(_chunk_stats, dynamic=False), static_shape=True)


#: columns per group of :func:`top_k_by_groups`
TOP_K_GROUP = 128


def top_k_by_groups(x: torch.Tensor, k: int, group: int = TOP_K_GROUP,
                    group_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values, indices) of x [c, V] in two small steps instead of one over V: the k
    groups of ``group`` columns with the largest maxima hold every one of the k largest values, so the
    top k of those groups' columns are the top k of the row (the same values; among equal values the
    indices may differ, as topk's own order among ties is unspecified). ``group_max``: the groups'
    maxima [c, V / group] when already known (:class:`ChunkStats`)."""
    c, V = x.shape
    if V <= 2 * k * group:
        return x.topk(k, dim=-1)
    if V % group:
        x = torch.nn.functional.pad(x, (0, group - V % group), value=float("-inf"))
    blocks = x.view(c, -1, group)
    best = (blocks.amax(-1) if group_max is None else group_max).topk(k, dim=-1).indices  # [c, k] groups
    values, at = blocks.gather(1, best[..., None].expand(-1, -1, group)).reshape(c, k * group).topk(k, dim=-1)
    return values, best.gather(1, at // group) * group + at % group


def _pad_rows(t, n):
    return torch.cat([t, t.new_zeros(n, *t.shape[1:])]) if n else t


@dataclass(frozen=True)
class _Rows:
    """What :class:`_ChunkedLinearLoss` scores, besides the tensors that take a gradient: labels [M], weights
    [M]; the teacher's hidden rows [T, H] (or None) and which of them each chunk needs (the rows sorted by
    their teacher row, so that a chunk's rows share few and the LM head runs once per distinct one)."""

    idx: torch.Tensor  # the rows of h (and e) scored: those of weight > 0
    labels: torch.Tensor
    w: torch.Tensor
    teacher_h: torch.Tensor | None = None
    teacher_plan: _TeacherPlan | None = None


@dataclass(frozen=True)
class _How:
    """How :class:`_ChunkedLinearLoss` reduces: chunk size, the chunk function, the objective, ``reweight``
    and ``collect`` (see :func:`block_loss`)."""

    chunk_size: int
    ce: ChunkCE
    obj: Objective
    reweight: Callable | None = None
    collect: dict | None = None


@dataclass(frozen=True)
class _TeacherPlan:
    """Which teacher rows each chunk needs, found for all chunks at once (:class:`RowPlan`): the chunk from
    row s of chunk i runs the LM head on ``teacher_h[distinct[bounds[i]:bounds[i + 1]]]``, and its row r
    takes that result's row ``local[r]``."""

    distinct: torch.Tensor
    local: torch.Tensor
    bounds: list[int]

    @staticmethod
    def of(teacher_idx: torch.Tensor, chunk_size: int) -> "_TeacherPlan":
        """For rows sorted by their teacher row ``teacher_idx`` [M]."""
        pos = torch.arange(teacher_idx.numel(), device=teacher_idx.device)
        first = pos % chunk_size == 0  # a chunk's first row opens a new distinct row
        first[1:] |= teacher_idx[1:] != teacher_idx[:-1]
        d = first.cumsum(0) - 1  # each row's index into ``distinct``
        distinct = teacher_idx[first]
        starts = d[::chunk_size]
        return _TeacherPlan(distinct, d - starts.repeat_interleave(chunk_size)[: d.numel()],
                            starts.tolist() + [distinct.numel()])

    def to(self, device: torch.device) -> "_TeacherPlan":
        return _TeacherPlan(self.distinct.to(device, non_blocking=True), self.local.to(device, non_blocking=True),
                            self.bounds)


@dataclass(frozen=True)
class RowPlan:
    """The rows :func:`block_loss` scores (weight > 0 on the flat [B*Q] grid), in the order it scores them
    (by their teacher row, with a teacher), and the :class:`_TeacherPlan` of its chunks. Finding them takes
    data-dependent shapes (a ``nonzero``, a ``tolist``): made from the batch's host tensors
    (:meth:`of`, then :meth:`to`), the GPU is never waited for."""

    idx: torch.Tensor
    teacher_plan: _TeacherPlan | None = None

    @staticmethod
    def of(weights: torch.Tensor, chunk_size: int, teacher_rows: torch.Tensor | None = None,
           teacher_len: int | None = None, needs_teacher: bool = False) -> "RowPlan":
        """``weights`` [B, Q]; with a teacher, ``teacher_rows`` [B, Q] (or None: row i's teacher is row i)
        index positions of a [B, ``teacher_len``] teacher grid (see :func:`block_loss`)."""
        w = weights.reshape(-1)
        idx = (w > 0).nonzero(as_tuple=True)[0]
        if not needs_teacher or idx.numel() == 0:
            return RowPlan(idx)
        teacher_idx = torch.arange(w.shape[0], device=w.device)
        if teacher_rows is not None:  # rows sorted by their teacher row: a chunk's rows share theirs
            offsets = torch.arange(weights.shape[0], device=w.device)[:, None] * int(teacher_len)
            teacher_idx = (teacher_rows + offsets).reshape(-1)
            idx = idx[torch.argsort(teacher_idx[idx], stable=True)]
        return RowPlan(idx, _TeacherPlan.of(teacher_idx[idx], int(chunk_size)))

    def to(self, device: torch.device) -> "RowPlan":
        """On ``device``, copied without waiting (from host tensors the copy does not wait for the GPU)."""
        return RowPlan(self.idx.to(device, non_blocking=True),
                       self.teacher_plan.to(device) if self.teacher_plan is not None else None)


def _teacher_logits(rows: _Rows, i: int, s: int, n: int, pad: int, weight: torch.Tensor) -> torch.Tensor | None:
    """The teacher's logits of chunk i (rows s..s+n, padded by ``pad`` rows): the LM head once per distinct
    teacher row."""
    if rows.teacher_h is None:
        return None
    plan = rows.teacher_plan
    lo, hi = plan.bounds[i], plan.bounds[i + 1]
    logits = rows.teacher_h[plan.distinct[lo:hi]].to(weight.dtype) @ weight.t()
    if hi - lo == n and not pad:
        return logits
    return logits[_pad_rows(plan.local[s : s + n], pad)]  # padding rows reuse the first row (their weight is 0)


class _ChunkedLinearLoss(torch.autograd.Function):
    """(h [N, H], W [V, H], e [N, r] or None, W2 [V, r] or None, :class:`_Rows`, :class:`_How`)
    -> (sum_i w_i*loss_i, sum_i w_i*[argmax_i == label_i], sum_i w_i) over the M rows ``rows.idx`` of h.

    The rows are picked inside (the other rows' gradient is 0), so autograd needs no index backward.

    The logits of row i are ``h_i @ W.T`` (+ ``e_i @ W2.T``: DSpark's Markov head).
    ``reweight`` (optional, no gradient): per-row losses [M] -> the weights [M] the loss
    uses instead of ``w`` (D-PACE); the accuracy keeps ``w``. The per-row gradients are
    computed unweighted and scaled once every weight is known, so it costs no second
    pass; an LM head weight that needs a gradient then cannot be trained (it is frozen).
    """

    @staticmethod
    def forward(ctx, h_all, weight, e_all, w2, rows: _Rows, how: _How):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_e, need_w2 = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        obj, collect, chunk_size, labels, w = how.obj, how.collect, how.chunk_size, rows.labels, rows.w
        if (need_w or need_w2) and how.reweight is not None:
            raise ValueError("block_loss: a re-weighted loss (D-PACE) cannot train the LM head or Markov head weight")
        h = h_all.index_select(0, rows.idx)
        e = e_all.index_select(0, rows.idx) if e_all is not None else None
        M = h.shape[0]
        row_loss = torch.empty(M, dtype=torch.float32, device=h.device)
        row_correct = torch.empty(M, dtype=torch.float32, device=h.device)
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_e = torch.empty(e.shape, dtype=torch.float32, device=h.device) if need_e else None
        grad_w2 = torch.zeros(w2.shape, dtype=torch.float32, device=w2.device) if need_w2 else None
        if obj.accept:
            collect["accept"] = torch.empty(M, dtype=torch.float32, device=h.device)
        top_k = collect.get("top_k", 0) if collect is not None else 0
        if top_k:  # the logits' top k, for DFlash 2's selector loss (no second LM-head pass there)
            collect["candidates"] = torch.empty(M, top_k, dtype=torch.long, device=h.device)
            collect["candidate_logits"] = torch.empty(M, top_k, dtype=torch.float32, device=h.device)
            collect["chosen_logit"] = torch.empty(M, dtype=torch.float32, device=h.device)
        if collect is not None and rows.teacher_h is not None:
            collect["teacher_argmax"] = torch.empty(M, dtype=torch.long, device=h.device)
        # the gradient leaves the chunk in the dtype its matmul reads (fp32 where a weight's gradient needs it)
        grad_dtype = None
        if need_h or need_w or need_e or need_w2:
            grad_dtype = torch.float32 if (need_w or need_e or need_w2) else weight.dtype
        group = TOP_K_GROUP if top_k and weight.shape[0] % TOP_K_GROUP == 0 else 0  # the selector's top-k groups
        for s in range(0, M, chunk_size):
            hc, yc = h[s : s + chunk_size].to(weight.dtype), labels[s : s + chunk_size]  # the LM head's dtype
            ec = e[s : s + chunk_size].to(w2.dtype) if e is not None else None
            n = hc.shape[0]
            pad = chunk_size - n if how.ce.static_shape else 0  # one static shape for the compiled chunk
            hc, yc = _pad_rows(hc, pad), _pad_rows(yc, pad)
            teacher = _teacher_logits(rows, s // chunk_size, s, n, pad, weight)
            logits = hc @ weight.t()  # [c, V]
            if ec is not None:
                logits = logits + (_pad_rows(ec, pad) @ w2.t()).to(logits.dtype)
            out = how.ce.fn(logits, yc, teacher, obj, grad_dtype, group)
            lrow, crow, g, arow = out.loss, out.correct, out.grad, out.accept
            row_loss[s : s + n], row_correct[s : s + n] = lrow[:n], crow[:n]
            if arow is not None:
                collect["accept"][s : s + n] = arow[:n]
            chosen = yc[:n]
            if "teacher_argmax" in (collect or {}):
                chosen = collect["teacher_argmax"][s : s + n] = out.teacher_argmax[:n]
            if top_k:  # the multiplier (> 0) and the soft cap are monotone: the raw logits' order is theirs
                values, indices = top_k_by_groups(logits[:n], top_k, group_max=out.group_max[:n] if group else None)
                collect["candidates"][s : s + n], collect["candidate_logits"][s : s + n] = indices, values
                collect["chosen_logit"][s : s + n] = logits[:n].gather(1, chosen[:, None])[:, 0]
            del logits, teacher
            if g is not None:
                g = g[:n]
                if need_h:
                    grad_h[s : s + n] = g.to(weight.dtype) @ weight  # unweighted: scaled below (g: in its dtype)
                if need_w:
                    grad_w += (g * w[s : s + n, None].float()).t() @ hc[:n].float()
                if need_e:
                    grad_e[s : s + n] = g.to(w2.dtype) @ w2  # unweighted: scaled below
                if need_w2:
                    grad_w2 += (g * w[s : s + n, None].float()).t() @ ec.float()
                del g
        wf = w.float()
        lw = how.reweight(row_loss).float() if how.reweight is not None else wf
        if grad_h is not None:  # onto every row of h: 0 where not scored
            grad_h = h_all.new_zeros(h_all.shape).index_copy_(0, rows.idx, (grad_h * lw[:, None]).to(h.dtype))
        if grad_e is not None:
            grad_e = e_all.new_zeros(e_all.shape).index_copy_(0, rows.idx, (grad_e * lw[:, None]).to(e.dtype))
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_e, grad_w2) if t is not None))
        ctx.has = (need_h, need_w, need_e, need_w2)
        ctx.dtypes = (weight.dtype, w2.dtype if w2 is not None else None)
        correct, lw_sum = (row_correct * wf).sum(), lw.sum()
        ctx.mark_non_differentiable(correct, lw_sum)
        return (row_loss * lw).sum(), correct, lw_sum

    @staticmethod
    def backward(ctx, grad_loss, grad_correct, grad_wsum):
        saved = list(ctx.saved_tensors)
        need_h, need_w, need_e, need_w2 = ctx.has
        gh = gw = ge = gw2 = None
        if need_h:
            grad_h = saved.pop(0)
            gh = grad_h * grad_loss.to(grad_h.dtype)
        if need_w:
            gw = (saved.pop(0) * grad_loss).to(ctx.dtypes[0])
        if need_e:
            grad_e = saved.pop(0)
            ge = grad_e * grad_loss.to(grad_e.dtype)
        if need_w2:
            gw2 = (saved.pop(0) * grad_loss).to(ctx.dtypes[1])
        return gh, gw, ge, gw2, None, None


# reason: each keyword is one loss option of the recipes, defaulted for callers
def block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    chunk_size: int = 1024,
    reduction: str = "mean",
    ce: ChunkCE = EAGER_CE,
    objective: Objective = CE,
    teacher_hidden: torch.Tensor | None = None,
    reweight: Callable | None = None,
    collect: dict | None = None,
    markov: tuple[torch.Tensor, torch.Tensor] | None = None,
    teacher_rows: torch.Tensor | None = None,
    row_plan: RowPlan | None = None,
):
    """Weighted loss and weighted top-1 accuracy of the drafter's predictions.

    hidden [B, Q, H] (final-normed drafter output), lm_head_weight [V, H] (the
    target's, usually frozen), labels [B, Q] long, weights [B, Q] float;
    ``teacher_hidden`` [B, Q, H]: the target's last (normed) hidden state at the
    position before each label, for a teacher objective (``kl``, ``dspark``); with ``teacher_rows``
    [B, Q] long, ``teacher_hidden`` is [B, S, H] instead and row (b, q)'s teacher is
    ``teacher_hidden[b, teacher_rows[b, q]]``: overlapping blocks share a position's teacher row, and
    the LM head runs once per distinct row of a chunk.
    Returns (loss, acc), both 0-dim float32 tensors; loss carries the gradient.
    Rows with weight 0 are skipped; if every weight is 0 both are 0 (and the
    loss stays connected to ``hidden`` so backward still works). Finding them (:class:`RowPlan`) takes
    data-dependent shapes: call this outside any ``torch.compile``d region; ``row_plan``, the same plan made
    from the batch's host tensors beforehand, spares the GPU the host's waits. Logits and losses are computed in fp32.

    ``reduction="sum"`` returns the weighted SUMS (sum w*loss, sum w*correct,
    sum w') instead, w' being the loss's weights; data-parallel training divides
    them by the all-reduced weight sums so the loss is normalised over the global
    batch. ``ce``: how a chunk is reduced (eager by default;
    :func:`compiled_chunk_ce`). ``reweight``: see :class:`_ChunkedLinearLoss`; it gets
    the per-row losses of the rows with w > 0 and their indices into the flat
    [B*Q] grid (``reweight(row_loss, idx) -> weights``). ``collect`` (optional dict): filled with what
    the chunks' logits already give, so no caller runs the LM head again: ``teacher_argmax`` [B, Q]
    (the target's greedy token after each row, with a teacher; the label where w = 0) and, if it
    holds ``top_k``, ``candidates`` [B, Q, top_k] (the drafter's top-k tokens; 0 where w = 0) and, with
    ``objective.accept``, ``accept`` [B, Q] (each row's 1 - TV(p, q); 0 where w = 0). ``markov``: DSpark's
    (e [B, Q, r], W2 [V, r]): every row's logits get ``e @ W2.T`` added (the Markov head's bias).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"block_loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    if objective.needs_teacher and teacher_hidden is None:
        raise ValueError(f"block_loss: loss {objective.loss!r} needs the target's hidden states (teacher_hidden)")
    if objective.accept and collect is None:
        raise ValueError("block_loss: objective.accept needs a collect dict to return the acceptance in")
    H = hidden.shape[-1]
    h = hidden.reshape(-1, H)
    y = labels.reshape(-1)
    w = weights.reshape(-1).float()
    if row_plan is None:
        row_plan = RowPlan.of(weights, int(chunk_size), teacher_rows,
                              teacher_hidden.shape[1] if teacher_hidden is not None else None, objective.needs_teacher)
    idx = row_plan.idx
    total = w.sum()
    if idx.numel() == 0:
        zero = (hidden.sum() * 0.0).float()
        if objective.accept:
            collect["accept"] = w.new_zeros(labels.shape)
        return (zero, zero.detach(), zero.detach()) if reduction == "sum" else (zero, zero.detach())
    teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]) if objective.needs_teacher else None
    rows = _Rows(idx, y[idx], w[idx], teacher, row_plan.teacher_plan)
    how = _How(int(chunk_size), ce, objective, (lambda row_loss: reweight(row_loss, idx)) if reweight else None,
               collect)
    e, w2 = (markov[0].reshape(-1, markov[0].shape[-1]), markov[1]) if markov is not None else (None, None)
    loss_sum, correct, loss_weight = _ChunkedLinearLoss.apply(h, lm_head_weight, e, w2, rows, how)
    if collect is not None:  # back onto the [B, Q] grid of the inputs
        grid = labels.shape
        if "teacher_argmax" in collect:
            collect["teacher_argmax"] = y.clone().index_copy_(0, idx, collect["teacher_argmax"]).view(grid)
        if "accept" in collect:
            collect["accept"] = w.new_zeros(y.shape[0]).index_copy_(0, idx, collect["accept"]).view(grid)
        for key in ("candidates", "candidate_logits", "chosen_logit"):
            if key in collect:
                c = collect[key]
                collect[key] = c.new_zeros(y.shape[0], *c.shape[1:]).index_copy_(0, idx, c).view(*grid, *c.shape[1:])
    if reduction == "sum":
        return loss_sum, correct, loss_weight
    return loss_sum / loss_weight.clamp(min=1e-12), correct / total


class _CandidateLogits(torch.autograd.Function):
    """(h [c, H], W [V, H] frozen, candidates [c, k], their raw logits [c, k]) -> the logits, whose gradient
    reaches h as sum_j g_j W[candidate_j] (an embedding bag: no [c, k, H] gather is made or kept)."""

    @staticmethod
    def forward(ctx, h, weight, candidates, logits):
        ctx.save_for_backward(weight, candidates)
        ctx.h_dtype = h.dtype
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        weight, candidates = ctx.saved_tensors
        gh = torch.nn.functional.embedding_bag(candidates, weight, per_sample_weights=grad.to(weight.dtype), mode="sum")
        return gh.to(ctx.h_dtype), None, None, None


def selector_loss(
    selector,
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    previous: torch.Tensor,
    target_tokens: torch.Tensor,
    weights: torch.Tensor,
    objective: Objective,
    chunk_size: int = 1024,
    found: dict | None = None,
) -> torch.Tensor:  # reason for 9 parameters: the selector's inputs, each a tensor of the step
    """DFlash 2's candidate-selector objective: sum of w * CE over each position's top-k candidates.

    hidden [B, Q, H] (the drafter's final-normed output), previous [B, Q] (the token
    before each position: the anchor for position 1, else the data's token at the
    position before), target_tokens [B, Q] (the token the selector should pick: the
    target's own argmax when a teacher is available, else the data's label), weights
    [B, Q] (the loss's position weights). Candidates are the drafter's own top-k
    (scaled and capped as ``objective`` says; no gradient through the choice); a
    target token outside them replaces the k-th. The gradient reaches the drafter through
    the candidates' logits and the selector. ``found``: :func:`block_loss`'s ``collect`` of the
    same rows (``candidates``, ``candidate_logits``, ``chosen_logit``: the logits its chunks
    already computed, the chosen token being ``target_tokens``); without it the LM head runs
    here once more, chunked. Returns the weighted sum (0-dim, fp32).
    """
    H, k = hidden.shape[-1], selector.top_k
    h, prev, tgt, w = hidden.reshape(-1, H), previous.reshape(-1), target_tokens.reshape(-1), weights.reshape(-1).float()

    def transform(z):
        z = z.float() * objective.multiplier
        return torch.tanh(z / objective.cap) * objective.cap if objective.cap is not None else z

    def loss(hc, cand, raw, tc, pc, wc):  # cand holds tc (raw: the candidates' logits, carrying the gradient)
        label = (cand == tc[:, None]).float().argmax(-1)
        scores = selector.scores(hc, transform(raw), cand, pc)
        return (torch.nn.functional.cross_entropy(scores, label, reduction="none") * wc).sum()

    if found is not None and "candidate_logits" in found:  # one pass over every row (weight 0: adds 0)
        cand, raw = found["candidates"].reshape(-1, k).clone(), found["candidate_logits"].reshape(-1, k).clone()
        miss = (cand != tgt[:, None]).all(-1)
        # where, not a boolean index: an index by a mask waits for the GPU to count it
        cand[:, -1] = torch.where(miss, tgt, cand[:, -1])
        raw[:, -1] = torch.where(miss, found["chosen_logit"].reshape(-1).to(raw.dtype), raw[:, -1])
        return loss(h, cand, _CandidateLogits.apply(h, lm_head_weight, cand, raw), tgt, prev, w)
    idx = (w > 0).nonzero(as_tuple=True)[0]
    total = (hidden.sum() * 0.0).float()
    h, prev, tgt, w = h[idx], prev[idx], tgt[idx], w[idx]
    for s in range(0, h.shape[0], chunk_size):
        hc, tc = h[s : s + chunk_size], tgt[s : s + chunk_size]
        with torch.no_grad():
            cand = transform(hc.to(lm_head_weight.dtype) @ lm_head_weight.t()).topk(k, dim=-1).indices  # [c, k]
            miss = (cand != tc[:, None]).all(-1)
            cand[miss, -1] = tc[miss]
        raw = torch.einsum("ch,ckh->ck", hc.to(lm_head_weight.dtype), lm_head_weight[cand])
        total = total + loss(hc, cand, raw, tc, prev[s : s + chunk_size], w[s : s + chunk_size])
    return total


def confidence_loss(head, hidden: torch.Tensor, previous_embeds: torch.Tensor, accept: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """DSpark's confidence objective: sum of w x BCE(head's logit, the row's acceptance 1 - TV(p, q)).

    hidden [B, Q, H] (the drafter's final-normed output), previous_embeds [B, Q, r] (the Markov head's
    embedding of the token before each label), accept [B, Q] (no gradient: :func:`block_loss`'s
    ``collect``), weights [B, Q] (the loss's position weights). Returns the weighted sum (0-dim, fp32).
    """
    logits = head(hidden, previous_embeds).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, accept.detach().float(), reduction="none")
    return (bce * weights.float()).sum()
