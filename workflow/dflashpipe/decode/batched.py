"""Greedy AR and DFlash decoding of many prompts at once: continuous batching over a static, slotted KV cache.

The evaluation decodes one prompt at a time (:mod:`.speculative`); a server decodes many, and a
DFlash step's cost grows with the batch (B blocks of ``block_size`` tokens per verify, not B
tokens), so its speed-up over AR at concurrency B is not the batch-1 one. This module measures it
with one harness for both methods:

* the target's KV cache is ``slots`` rows of one preallocated buffer per layer (the layout of
  :class:`~.slots.SlotDecoder`); a request owns a row from its prefill to its end, and a finished
  row takes the next waiting prompt at once (continuous batching);
* a step runs every row, each at its own position: ``T = 1`` token per row for AR, the verify block
  ``[anchor, d_1..d_D]`` per row for DFlash, in ONE target forward (:class:`SlotTarget`: the layers
  written out by :mod:`.layer`, attention over the row's own cache, masked by position); the step
  returns the target's greedy tokens (argmax on the device), and for DFlash the context features
  of every position;
* DFlash: the drafter drafts a block for every row in one forward (:class:`SlotDrafter`: per-row
  static context buffers, like :class:`~.static_drafter.StaticDrafterRunner`'s; ``propose`` is
  the drafter's own, so DFlash 2's candidate selector and DSpark's Markov head run batched);
  acceptance is per row (the longest prefix of drafts equal to the target's argmax, plus the
  target's bonus token), and each row's drafter context grows by its verified positions only
  (the rejected ones stay hidden until overwritten);
* the stop rule is the evaluation's (:func:`~dflashpipe.decode.stop.cut_step`), and each
  request's result is a :class:`~.speculative.DecodeResult`, so greedy outputs compare token for
  token with the batch-1 loops (the tests do, for every row).

Every step computes all ``slots`` rows (free rows decode garbage in their own row), so its shapes
are static: on a GPU each step (target AR step, verify step, draft, context update) is captured
once as a CUDA graph and replayed; prefills (variable lengths) run uncaptured. Attention reads the
whole capacity of each row, masked (dense, grouped KV heads read once): right for the short replies the
benchmark decodes (a capacity of a few hundred positions).

``BatchSettings.forced_tau`` (benchmarks only, NOT lossless): acceptance is drawn at random with
mean accepted length ``tau`` instead of checked, so a random-weight target and drafter cost what a
trained pair with that acceptance costs (the drafts still run, and the committed tokens are drafts).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dflashpipe.decode.cuda_graph import capture, round_capacity
from dflashpipe.decode.layer import attention_dims, attention_inputs, finish_layer, fuse_projections
from dflashpipe.decode.slots import unsupported_reason
from dflashpipe.decode.speculative import DecodeResult, sync
from dflashpipe.decode.static_drafter import block_masks
from dflashpipe.decode.stop import cut_step


@dataclass
class BatchSettings:
    """How :class:`BatchedDecoder` decodes.

    ``slots``: rows of the KV cache (the concurrency). ``capacity``: positions per row (None: the
    longest prompt + ``max_new_tokens`` + two blocks, rounded up to 64). ``cuda_graphs``: None =
    on a GPU. ``forced_tau``: benchmarks only, see the module doc (None: real, lossless acceptance).
    """

    slots: int = 4
    max_new_tokens: int = 64
    capacity: int | None = None
    cuda_graphs: bool | None = None
    forced_tau: float | None = None
    seed: int = 0


@dataclass
class BatchRun:
    """One :meth:`BatchedDecoder.generate` call: a result per prompt (in order), the wall time (device
    synchronised), the batched steps taken and the rows busy in each."""

    results: list[DecodeResult]
    wall_s: float
    steps: int = 0
    busy_rows: list[int] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.results)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def tau(self) -> float:
        """Tokens per row-step that reach the output, pooled over every request (NaN for AR)."""
        steps = [c for r in self.results if r.accepted for c in r.committed]
        return sum(steps) / len(steps) if steps else float("nan")


# ---------------------------------------------------------------------------
# The target: every row a block of T tokens at its own position
# ---------------------------------------------------------------------------


class SlotTarget:
    """A Llama/Qwen2/Qwen3-layout causal LM over ``slots`` rows of a static KV cache.

    :meth:`step` runs T tokens in every row, row r at positions ``start[r] .. start[r]+T-1`` (one
    CUDA graph per (T, features) on a GPU); :meth:`prefill` writes new prompts into their rows.
    Both return the greedy token after every position (the logits' argmax) and, with features,
    the concatenated hidden states of ``layer_ids`` (as HF's ``hidden_states[i + 1]``)."""

    def __init__(self, model, slots: int, capacity: int, layer_ids=(), cuda_graphs: bool | None = None):
        why = unsupported_reason(model)
        if why:
            raise ValueError(f"batched decoding: {why}")
        fuse_projections(model)
        self.model, self.inner = model, model.model
        self.n_heads, self.n_kv, self.head_dim = attention_dims(model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.score_dtype = torch.promote_types(self.dtype, torch.float32)  # softmax in fp32 (fp64 for fp64 models)
        self.slots, self.capacity, self.layer_ids = int(slots), int(capacity), list(layer_ids)
        shape = (self.slots, self.n_kv, self.capacity, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.key_pos = torch.arange(self.capacity, device=self.device)
        self.rows = torch.arange(self.slots, device=self.device)
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        self._graphs: dict[tuple[int, bool], tuple] = {}  # (T, features) -> (graph, outputs, ids, start)
        self.mode = "slots+dense" + ("+cuda_graphs" if self.cuda_graphs else "")

    def _forward(self, ids: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, features: bool, last=None):
        """ids [n, T] in ``rows`` [n] at positions start[r].. -> (greedy tokens [n, T], features [n, T, F] or None);
        ``last`` [n] (the prefill): the greedy token after position last[j] only, [n, 1]."""
        n, T = ids.shape
        pos = start.unsqueeze(1) + torch.arange(T, device=self.device)  # [n, T]
        x = self.embed(ids)
        cos, sin = self.inner.rotary_emb(x, pos)
        visible = self.key_pos.view(1, 1, -1) <= pos.unsqueeze(-1)  # [n, T, capacity]
        mask = torch.zeros(visible.shape, dtype=self.score_dtype, device=self.device)
        mask = mask.masked_fill_(~visible, float("-inf")).view(n, 1, 1, T, self.capacity)
        wanted, feats = set(self.layer_ids) if features else set(), {}
        for i, layer in enumerate(self.inner.layers):
            x = self._layer(i, layer, x, (cos, sin), rows, pos, mask)
            if i in wanted:
                feats[i] = self.inner.norm(x) if i == len(self.inner.layers) - 1 else x
        h = self.inner.norm(x)
        if last is not None:
            h = h.gather(1, last.view(n, 1, 1).expand(n, 1, h.shape[-1]))
        tokens = self.lm_head(h).argmax(dim=-1)  # the argmax of the logits' fp32 copy: the same token
        return tokens, (torch.cat([feats[i] for i in self.layer_ids], dim=-1) if features else None)

    def _layer(self, i: int, layer, x, pe, rows, pos, mask):
        """Decoder layer i: writes the rows' keys/values at their positions, attends over each row's cache
        (written out for grouped KV heads, as :class:`~.slots.SlotDecoder`'s dense step: K/V read once)."""
        n, T = pos.shape
        q, k, v = attention_inputs(layer, layer.input_layernorm(x), *pe, self.n_heads, self.n_kv, self.head_dim)
        self.k[i][rows.unsqueeze(1), :, pos] = k.transpose(1, 2)  # [n, T, Hkv, D] at each row's positions
        self.v[i][rows.unsqueeze(1), :, pos] = v.transpose(1, 2)
        keys, values = (self.k[i], self.v[i]) if rows is self.rows else (self.k[i][rows], self.v[i][rows])
        G = self.n_heads // self.n_kv  # query head h reads kv head h // G
        qg = q.reshape(n, self.n_kv, G * T, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).to(self.score_dtype) * layer.self_attn.scaling
        scores = scores.view(n, self.n_kv, G, T, self.capacity) + mask
        p = torch.softmax(scores, dim=-1).to(self.dtype).view(n, self.n_kv, G * T, self.capacity)
        o = torch.matmul(p, values).view(n, self.n_heads, T, self.head_dim)
        return finish_layer(layer, x, o.transpose(1, 2).reshape(n, T, -1))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, start: torch.Tensor, features: bool = False):
        """Every row: ids [slots, T] at positions start [slots].. (outputs of a graph: read before the next step)."""
        if not self.cuda_graphs:
            return self._forward(ids, self.rows, start, features)
        key = (ids.shape[1], features)
        if key not in self._graphs:  # inputs copied first: the warm-ups write the step's own keys/values
            bufs = (ids.clone(), start.clone())
            self._graphs[key] = (*capture(lambda: self._forward(bufs[0], self.rows, bufs[1], features), self.device),
                                 *bufs)
        graph, out, ids_buf, start_buf = self._graphs[key]
        ids_buf.copy_(ids)
        start_buf.copy_(start)
        graph.replay()
        return out

    @torch.no_grad()
    def prefill(self, rows: list[int], prompts: list[list[int]], features: bool = False):
        """New prompts into ``rows`` (right-padded, uncaptured) -> (greedy token after each whole prompt [n],
        features [n, T, F] or None: row j's first len(prompts[j]) positions are its prompt's)."""
        T = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), T), dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p)] = torch.tensor(p)
        rows_t = torch.tensor(rows, device=self.device)
        start = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        tokens, feats = self._forward(ids.to(self.device), rows_t, start, features, last)
        return tokens[:, 0], feats


# ---------------------------------------------------------------------------
# The drafter: every row a block against its own context
# ---------------------------------------------------------------------------


class SlotDrafter:
    """A :class:`~dflashpipe.drafter.model.DFlashDrafter` over ``slots`` rows of static context buffers.

    Row r's context is positions ``< valid[r]`` of its buffers; :meth:`extend` writes a verified
    block's positions in every row and moves ``valid`` to the accepted prefix (the rest hidden,
    then overwritten by the next block, which starts there)."""

    def __init__(self, drafter, embed, lm_head, slots: int, capacity: int, cuda_graphs: bool | None = None):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        cfg = self.cfg = drafter.cfg
        self.bs, self.slots, self.capacity = int(cfg.block_size), int(slots), int(capacity)
        self.device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        shape = (self.slots, cfg.num_key_value_heads, self.capacity + self.bs, cfg.head_dim)  # context, then the block
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in drafter.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in drafter.layers]
        self.ctx_pos = torch.arange(self.capacity, device=self.device)
        self.rows = torch.arange(self.slots, device=self.device)
        self.valid = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # context: positions < valid
        self.mask_ids = torch.full((self.slots, self.bs - 1), int(cfg.mask_token_id), dtype=torch.long,
                                   device=self.device)
        self.block_visible = torch.ones((self.slots, 1, self.bs, self.bs), dtype=torch.bool, device=self.device)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        self._graphs: dict[str, tuple] = {}

    def _write(self, feats: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Project feats [n, T, F] at positions pos [n, T] into ``rows``' context buffers."""
        ctx = self.drafter.project_context(feats.to(self.dtype))
        cos, sin = self.drafter._rope(pos, ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            self.k[i][rows.unsqueeze(1), :, pos] = k.transpose(1, 2)
            self.v[i][rows.unsqueeze(1), :, pos] = v.transpose(1, 2)

    def _propose(self, last: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Every row's block [last, MASK x (bs-1)] at positions start.. -> drafts [slots, num_drafts]."""
        h = self.embed(torch.cat([last.unsqueeze(1), self.mask_ids], dim=1)).to(self.dtype)
        pos = start.unsqueeze(1) + torch.arange(self.bs, device=self.device)  # [slots, bs]
        cos, sin = self.drafter._rope(pos, h.dtype)
        ctx_visible = (self.ctx_pos.view(1, 1, 1, -1) < self.valid.view(-1, 1, 1, 1)).expand(-1, 1, self.bs, -1)
        masks = block_masks(self.drafter, ctx_visible, pos, self.ctx_pos, self.block_visible)  # [slots, 1, bs, C + bs]
        for i, layer in enumerate(self.drafter.layers):
            h = layer(h, self.k[i], self.v[i], cos, sin, masks[self.cfg.window_of(i)], block_at=self.capacity)
        return self.drafter.propose(self.drafter.norm(h), last, self.lm_head.weight)

    def _extend(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        self._write(feats, self.rows, start.unsqueeze(1) + torch.arange(feats.shape[1], device=self.device))

    def _run(self, name: str, fn, *inputs):
        """fn(*inputs), replayed from a graph on a GPU (captured on its first call, inputs copied first)."""
        if not self.cuda_graphs:
            return fn(*inputs)
        if name not in self._graphs:
            bufs = tuple(t.clone() for t in inputs)
            self._graphs[name] = (*capture(lambda: fn(*bufs), self.device), bufs)
        graph, out, bufs = self._graphs[name]
        for b, t in zip(bufs, inputs):
            b.copy_(t)
        graph.replay()
        return out

    @torch.no_grad()
    def prefill(self, rows: list[int], feats: torch.Tensor, lengths: list[int]) -> None:
        """Prompt contexts: row rows[j] gets the first lengths[j] positions of feats [n, T, F]."""
        rows_t = torch.tensor(rows, device=self.device)
        T = feats.shape[1]
        self._write(feats, rows_t, torch.arange(T, device=self.device).expand(len(rows), T))
        self.valid[rows_t] = torch.tensor(lengths, device=self.device)

    @torch.no_grad()
    def propose(self, last: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """last [slots] anchor tokens at positions start [slots] -> drafts [slots, num_drafts]."""
        return self._run("propose", self._propose, last, start)

    @torch.no_grad()
    def extend(self, feats: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> None:
        """Every row: the verified block's features [slots, T, F] at positions start..; context up to ``valid``."""
        self._run("extend", self._extend, feats, start)
        self.valid.copy_(valid)


# ---------------------------------------------------------------------------
# The loop: rows, requests, steps
# ---------------------------------------------------------------------------


def forced_acceptance(n_drafts: int, tau: float) -> float:
    """The per-draft acceptance probability p (each draft accepted with p while the ones before it were)
    whose mean accepted length ``1 + sum_k p^k`` (k = 1..n_drafts) is ``tau``."""
    if not 1.0 <= tau <= n_drafts + 1:
        raise ValueError(f"forced tau {tau} outside 1 .. {n_drafts + 1} (the block's bounds)")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if 1 + sum(p**k for k in range(1, n_drafts + 1)) < tau else (lo, p)
    return (lo + hi) / 2


def _accepted(drafts: list[int], greedy: list[int]) -> int:
    """Length of the prefix of drafts equal to the target's greedy tokens after the anchor and each draft."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return a


class _Book:
    """Host-side state of one generate call: the queue, each row's request, sequence length and last token."""

    def __init__(self, prompts, slots: int, max_new: int, eos_ids):
        self.prompts, self.max_new, self.eos = prompts, int(max_new), list(eos_ids)
        self.queue = deque(range(len(prompts)))
        self.owner = [-1] * slots  # request of each row, -1: free
        self.nseq = [1] * slots  # tokens of the row's sequence (prompt + output); the anchor sits at nseq - 1
        self.last = [0] * slots
        self.results = [DecodeResult(tokens=[], prompt_tokens=len(p)) for p in prompts]
        self.t_first = [0.0] * len(prompts)

    def busy(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o >= 0]

    def free(self) -> list[int]:
        return [r for r, o in enumerate(self.owner) if o < 0]

    def admit(self, rows: list[int], first: list[int], t_admit: float, now: float) -> None:
        for r, tok in zip(rows, first):
            req = self.queue.popleft()
            res = self.results[req]
            res.tokens, reason = cut_step([tok], 0, self.max_new, self.eos)
            res.prefill_s, self.t_first[req] = now - t_admit, now
            self.owner[r], self.nseq[r], self.last[r] = req, len(self.prompts[req]) + 1, tok
            if reason:
                self._finish(r, reason, now)

    def commit(self, r: int, step_tokens: list[int], accepted: int | None, now: float) -> None:
        """Row r's step: its tokens (drafts accepted + the bonus, or AR's one token) reach its request."""
        res = self.results[self.owner[r]]
        kept, reason = cut_step(step_tokens, len(res.tokens), self.max_new, self.eos)
        res.tokens.extend(kept)
        res.target_forwards += 1
        res.committed.append(len(kept))
        res.committed_raw.append(len(step_tokens))
        if accepted is not None:
            res.accepted.append(accepted)
        self.nseq[r] += len(step_tokens)
        self.last[r] = step_tokens[-1]
        if reason:
            self._finish(r, reason, now)

    def _finish(self, r: int, reason: str, now: float) -> None:
        req = self.owner[r]
        res = self.results[req]
        res.stop_reason, res.decode_s = reason, now - self.t_first[req]
        self.owner[r], self.nseq[r] = -1, 1  # a free row decodes garbage at position 0 of its own row


class BatchedDecoder:
    """Greedy AR (``drafter=None``) or DFlash decoding of many prompts, ``settings.slots`` at a time.

    ``generate(prompts)`` -> :class:`BatchRun`: each prompt's :class:`DecodeResult` (tokens, per-step
    committed / accepted counts, ``prefill_s``: its admission to its first token, ``decode_s``: its
    first token to its last), in the prompts' order. The static buffers (and graphs) are made on the
    first call and kept while later calls fit them (a warm-up call makes the timed one capture nothing).
    """

    def __init__(self, target_model, settings: BatchSettings, eos_ids=(), drafter=None):
        if drafter is not None and drafter.cfg.mask_token_id >= int(target_model.config.vocab_size):
            raise ValueError("batched decoding: the drafter's mask token is not a row of the target's embedding")
        self.model, self.s, self.eos, self.drafter = target_model, settings, list(eos_ids), drafter
        self.method = "ar" if drafter is None else "dflash"
        self.target: SlotTarget | None = None
        self.draft: SlotDrafter | None = None
        self.block = 1 if drafter is None else drafter.cfg.num_drafts + 1  # target tokens per row and step
        self._rng, self._p = None, 0.0
        self.mode: str | None = None  # the target step's (after the first generate)

    def _ensure(self, prompts) -> None:
        bs = 0 if self.drafter is None else self.drafter.cfg.block_size
        need = max(len(p) for p in prompts) + self.s.max_new_tokens + 2 * max(bs, self.block)
        if self.s.capacity is not None and need > self.s.capacity:
            raise ValueError(f"batched decoding: a prompt of {max(len(p) for p in prompts)} tokens + "
                             f"{self.s.max_new_tokens} new tokens + two blocks exceed the capacity {self.s.capacity}")
        if self.target is not None and need <= self.target.capacity:
            return
        capacity = self.s.capacity or round_capacity(need, 64)
        layer_ids = [] if self.drafter is None else self.drafter.cfg.target_layer_ids
        self.target = SlotTarget(self.model, self.s.slots, capacity, layer_ids, self.s.cuda_graphs)
        if self.drafter is not None:
            self.draft = SlotDrafter(self.drafter, self.target.embed, self.target.lm_head, self.s.slots, capacity,
                                     self.target.cuda_graphs)
        self.mode = self.target.mode

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | None = None) -> BatchRun:
        """Decode every prompt (``max_new_tokens``: settings' by default; a warm-up may ask fewer)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("batched decoding: needs prompts of at least one token")
        self._ensure(prompts)
        self._rng = random.Random(self.s.seed)
        if self.s.forced_tau is not None and self.drafter is not None:
            self._p = forced_acceptance(self.block - 1, self.s.forced_tau)
        new = self.s.max_new_tokens if max_new_tokens is None else min(int(max_new_tokens), self.s.max_new_tokens)
        book = _Book(prompts, self.s.slots, new, self.eos)
        run = BatchRun(results=book.results, wall_s=0.0)
        dev = self.target.device
        sync(dev)
        t0 = time.perf_counter()
        while book.queue or book.busy():
            free = book.free()
            if book.queue and free:
                self._admit(book, free[: len(book.queue)])
                continue
            run.busy_rows.append(len(book.busy()))
            run.steps += 1
            (self._ar_step if self.drafter is None else self._dflash_step)(book)
        sync(dev)
        run.wall_s = time.perf_counter() - t0
        return run

    def _admit(self, book: _Book, rows: list[int]) -> None:
        t_admit = time.perf_counter()
        prompts = [book.prompts[q] for q in list(book.queue)[: len(rows)]]
        first, feats = self.target.prefill(rows, prompts, features=self.drafter is not None)
        if self.drafter is not None:
            self.draft.prefill(rows, feats, [len(p) for p in prompts])
        first = first.tolist()
        book.admit(rows, first, t_admit, time.perf_counter())

    def _inputs(self, book: _Book):
        """Each row's anchor token and its position (free rows: token 0 at position 0), on the device."""
        dev = self.target.device
        start = [n - 1 for n in book.nseq]
        return torch.tensor(book.last, device=dev), torch.tensor(start, device=dev), start

    def _ar_step(self, book: _Book) -> None:
        last, start, _ = self._inputs(book)
        tokens, _ = self.target.step(last.unsqueeze(1), start)
        tokens = tokens[:, 0].tolist()
        now = time.perf_counter()
        for r in book.busy():
            book.commit(r, [tokens[r]], None, now)

    def _dflash_step(self, book: _Book) -> None:
        last, start, start_list = self._inputs(book)
        drafts = self._propose(book, last, start)  # [slots, D]
        greedy, feats = self.target.step(torch.cat([last.unsqueeze(1), drafts], dim=1), start, features=True)
        both = torch.cat([drafts, greedy], dim=1).tolist()  # one device -> host copy
        D = drafts.shape[1]
        busy = book.busy()
        acc = [0] * self.s.slots
        for r in busy:
            acc[r] = self._accept(both[r][:D], both[r][D:])
        valid = [start_list[r] + acc[r] + 1 if r in busy else 0 for r in range(self.s.slots)]
        self.draft.extend(feats, start, torch.tensor(valid, device=self.target.device))
        now = time.perf_counter()
        for r in busy:
            d, y = both[r][:D], both[r][D:]
            book.commit(r, d[: acc[r]] + [y[acc[r]]], acc[r], now)

    def _propose(self, book: _Book, last: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Every row's drafts [slots, D] (a method of its own: tests substitute an oracle drafter)."""
        return self.draft.propose(last, start)

    def _accept(self, drafts: list[int], greedy: list[int]) -> int:
        if self.s.forced_tau is None:
            return _accepted(drafts, greedy)
        a = 0
        while a < len(drafts) and self._rng.random() < self._p:
            a += 1
        return a
