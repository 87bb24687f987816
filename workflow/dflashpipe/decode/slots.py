"""Batched regeneration near the GPU's limit: continuous batching over a static, slotted KV cache.

Today's embedded backend runs static ``generate`` batches: a batch runs to its
longest member, so most rows decode padding, and every step is launched from
Python. Here (the ``batched`` expansion backend):

* the KV cache is ``slots`` rows of one preallocated buffer per layer
  ``[slots, Hkv, capacity, D]``; a request owns a row from its prefill to its end
  token, and a finished row is given to the next waiting prompt at once
  (continuous batching), so every decode step does useful work for (nearly)
  every row;
* the decode step of all rows (one token each, each at its own position) is
  captured once as a CUDA graph and replayed: one launch per step. When few rows
  are busy (the tail of a run, when no prompt is waiting) a step computes only
  those, padded to a power-of-two count (slots/2, slots/4, ... >= 8), each count
  its own graph;
* attention reads only the live part of each row's cache (``attention="flex"``,
  the default on a GPU): compiled ``flex_attention`` (its decoding kernel) with a
  block mask of ``kv_block``-position blocks, row r reading blocks 0 .. pos[r] //
  kv_block and no others, so a step's KV traffic is the rows' live lengths, not
  the cache capacity; rows outside a partial step read nothing. ``"dense"`` (the
  CPU default) writes attention out for grouped KV heads over the whole capacity
  with a per-row length mask;
* new prompts are prefilled in groups (right-padded, causal SDPA), writing their
  keys/values into their rows; padding positions are masked until overwritten.

The weights are the model's own modules (embedding, norms, projections, MLP, LM
head); the attention and RoPE are the standard Llama/Qwen2/Qwen3 formulas, so
greedy outputs equal transformers' (a CPU test checks token for token). Token
choice happens outside the graph: greedy argmax, or temperature / top-p sampling
from a seeded generator (the same prompts, rows and seed draw the same samples;
a chunk generated again after a kill is a valid sample, not necessarily the same
one when the number of rows differs).
"""

from __future__ import annotations

from collections import Counter, deque

import torch
import torch.nn.functional as F

from dflashpipe.decode.cuda_graph import capture, round_capacity
from dflashpipe.decode.layer import (
    attention_dims,
    attention_inputs,
    finish_layer,
    fuse_projections,
    live_block_mask,
    written_out_reason,
)

#: attention implementations of the decode step ("auto": flex on a GPU, dense elsewhere)
ATTENTION_MODES = ("auto", "flex", "dense")


def unsupported_reason(model) -> str | None:
    """None if :class:`SlotDecoder` can run ``model``; else why not (one phrase)."""
    cfg = model.config
    why = written_out_reason(model)
    if why:
        return why
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(cfg, "use_sliding_window", False):
        return "sliding-window layers"
    return host_synced_rope(cfg)


def host_synced_rope(cfg) -> str | None:
    """RoPE types whose frequencies are updated from the host by position (no CUDA-graph capture)."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    return f"RoPE type {kind!r} (its frequencies depend on the sequence length)" if kind in ("dynamic", "longrope") else None


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    _, n_kv, head_dim = attention_dims(cfg)
    return 2 * cfg.num_hidden_layers * n_kv * head_dim * next(model.parameters()).element_size()


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [n, V] with all but the smallest set of most likely tokens reaching ``top_p`` zeroed
    (at least one token kept: transformers' top-p rule)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p  # everything after the set has reached top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


class SlotDecoder:
    """Greedy or sampled decoding of many prompts through ``slots`` rows of a static KV cache."""

    # reason: each keyword is one decoding option, defaulted (benchmarks vary them)
    def __init__(self, model, slots: int, capacity: int, cuda_graphs: bool | None = None, prefill_tokens: int = 8192,
                 attention: str = "auto", kv_block: int = 128, compile: bool = False, fused: bool = True):
        why = unsupported_reason(model)
        if why:
            raise ValueError(f"batched decoding: {why}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"batched decoding: attention {attention!r} (one of {', '.join(ATTENTION_MODES)})")
        self.model, self.inner = model, model.model
        self.fused = bool(fused)  # q/k/v and gate/up: one matmul each (the same weights, no copy kept)
        if self.fused:
            fuse_projections(model)
        cfg = model.config
        self.n_heads, self.n_kv, self.head_dim = attention_dims(cfg)
        self.scaling = self.head_dim**-0.5
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.score_dtype = torch.promote_types(self.dtype, torch.float32)  # softmax in fp32 (fp64 for fp64 models)
        if attention == "auto":
            attention = "flex" if self.device.type == "cuda" else "dense"
        self.attention, self.kv_block = attention, int(kv_block)
        if attention == "flex":  # whole blocks
            capacity = round_capacity(capacity, self.kv_block)
        self.slots, self.capacity, self.prefill_tokens = int(slots), int(capacity), int(prefill_tokens)
        shape = (self.slots, self.n_kv, self.capacity, self.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.inner.layers]
        self.key_pos = torch.arange(self.capacity, device=self.device)
        self.rows = torch.arange(self.slots, device=self.device)
        self.ids = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # each row's last token
        self.pos = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # ... and its position
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        self.active = torch.zeros(self.slots, dtype=torch.long, device=self.device)  # rows of a partial step
        self._graphs: dict[int, tuple] = {}
        self.step_counts: Counter = Counter()  # decode steps of the last generate call, by rows computed
        if attention == "flex":
            self._init_flex()
        # compile: Inductor fuses each layer's norms, RoPE, SwiGLU and residuals before a step is captured
        # (a step of few rows costs its kernel launches more than its bytes). One decoder layer is compiled,
        # as one graph for every layer (its weights and cache are inputs), once per row count a step
        # computes. Tracing one layer, not the unrolled model, keeps the compile short (the tiny CPU
        # benchmark: 19 s instead of 128), and a warm compile cache (the slot's) shortens it again
        self._layer_fn = torch.compile(self._layer, dynamic=False) if compile else self._layer
        if compile or attention == "flex":  # each decoder is new guards on the same code objects: past the
            # recompile limit Dynamo would run them uncompiled (flex reading every position), so leave room
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.mode = (f"slots+{attention}" + ("+cuda_graphs" if self.cuda_graphs else "") + ("+compiled" if compile else "")
                     + ("+fused" if self.fused else ""))

    def _init_flex(self) -> None:
        """The block mask (one object, updated in place each step) and the compiled attention."""
        from torch.nn.attention.flex_attention import flex_attention

        blocks = self.capacity // self.kv_block
        # live blocks per row: written by each step (0 for rows outside a partial step)
        self._live_blocks = torch.zeros((self.slots, 1, 1), dtype=torch.int32, device=self.device)
        order = torch.arange(blocks, dtype=torch.int32, device=self.device)
        pos = self.pos

        def upto_own_position(b, h, q_idx, kv_idx):  # within a row's last live block
            return kv_idx <= pos[b]

        self._block_mask = live_block_mask(self._live_blocks, order, upto_own_position, 1, self.capacity, self.kv_block)
        self._q_all = torch.zeros((self.slots, self.n_heads, 1, self.head_dim), dtype=self.dtype, device=self.device)
        self._flex = torch.compile(flex_attention, dynamic=False)

    # -- one layer, written out (dflashpipe.decode.layer) ---------------------------------

    def _qkv(self, layer, h, cos, sin):
        return attention_inputs(layer, h, cos, sin, self.n_heads, self.n_kv, self.head_dim, self.fused)

    # -- decode: every row one token -------------------------------------------------

    def _decode_step(self, n: int) -> torch.Tensor:
        """One token for ``n`` rows: all rows (n == slots), or ``self.active[:n]`` (their caches gathered)."""
        if n == self.slots:
            rows, ids, pos = self.rows, self.ids, self.pos
        else:
            rows = self.active[:n]
            ids, pos = self.ids[rows], self.pos[rows]
        x = self.inner.embed_tokens(ids.unsqueeze(1))  # [n, 1, H]
        cos, sin = self.inner.rotary_emb(x, pos.unsqueeze(1))
        mask = None
        if self.attention == "flex":
            live = (pos // self.kv_block + 1).to(torch.int32).view(n, 1, 1)
            if n == self.slots:
                self._live_blocks.copy_(live)
            else:
                self._live_blocks.zero_().index_copy_(0, rows, live)
        else:  # additive mask: a row sees the keys at positions <= its own
            mask = torch.zeros((n, self.capacity), dtype=self.score_dtype, device=self.device)
            mask.masked_fill_(self.key_pos.unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
            mask = mask[:, None, None, :]
        for i, layer in enumerate(self.inner.layers):
            x = self._layer_fn(layer, x, cos, sin, rows, pos, self.k[i], self.v[i], mask)
        return self.model.get_output_embeddings()(self.inner.norm(x))[:, 0].to(self.score_dtype)  # [n, V]

    # reason: the hot per-layer step: its tensors passed as they are, no wrapper
    def _layer(self, layer, x, cos, sin, rows, pos, keys, values, mask):
        """One decoder layer for the step's rows: writes their K/V at their positions, attends, returns x."""
        n = x.shape[0]
        q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
        keys[rows, :, pos] = k[:, :, 0]
        values[rows, :, pos] = v[:, :, 0]
        if self.attention == "flex":  # every row's own cache in place; rows outside the step read nothing
            q_all = q if n == self.slots else self._q_all.index_copy_(0, rows, q)
            o = self._flex(q_all, keys, values, block_mask=self._block_mask, scale=self.scaling,
                           enable_gqa=self.n_kv != self.n_heads)
            o = (o if n == self.slots else o[rows]).transpose(1, 2).reshape(n, 1, self.n_heads * self.head_dim)
        else:
            if n != self.slots:
                keys, values = keys[rows], values[rows]
            qg = q.reshape(n, self.n_kv, self.n_heads // self.n_kv, self.head_dim)  # query head h: kv head h // G
            scores = torch.matmul(qg, keys.transpose(-1, -2)).to(self.score_dtype) * self.scaling + mask
            p = torch.softmax(scores, dim=-1).to(self.dtype)
            o = torch.matmul(p, values).reshape(n, 1, self.n_heads * self.head_dim)
        return finish_layer(layer, x, o, self.fused)

    def _step(self, n: int) -> torch.Tensor:
        """The decode step for ``n`` rows (one captured graph per row count)."""
        if not self.cuda_graphs:
            return self._decode_step(n)
        if n not in self._graphs:  # the warm-ups decode the real rows: writing their K/V twice is harmless
            self._graphs[n] = capture(lambda: self._decode_step(n), self.device)
        graph, logits = self._graphs[n]
        graph.replay()
        return logits

    def _bucket(self, busy: int) -> int:
        """Rows a step computes for ``busy`` busy rows: all, or the smallest of slots/2, slots/4, ... (>= 8) that holds them."""
        n = self.slots
        while n // 2 >= max(busy, 8) and n // 2 >= 1:
            n //= 2
        return n

    # -- prefill: a group of new prompts into their rows --------------------------------

    def _prefill(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Write the prompts' keys/values into ``rows``; returns the logits after each prompt [n, V]."""
        n, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((n, T), dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        rows_t = torch.tensor(rows, device=self.device)
        x = self.inner.embed_tokens(ids)
        position_ids = torch.arange(T, device=self.device).unsqueeze(0).expand(n, T)
        cos, sin = self.inner.rotary_emb(x, position_ids)
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.k[i][rows_t, :, :T] = k  # right padding: masked by position until overwritten
            self.v[i][rows_t, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads)
            x = finish_layer(layer, x, o.transpose(1, 2).reshape(n, T, self.n_heads * self.head_dim), self.fused)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        h = self.inner.norm(x[torch.arange(n, device=self.device), last])
        return self.model.get_output_embeddings()(h).to(self.score_dtype)

    # -- the loop ---------------------------------------------------------------------

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, top_p: float, gen) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(top_p_filter(probs, top_p), 1, generator=gen)[:, 0]

    # reason: one scheduling loop over slots; cut, it would pass its state around
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int], end_ids, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, progress=lambda prompts, tokens: None) -> list[tuple[list[int], str]]:
        """Decode every prompt; returns (generated ids incl. the end token if any, "stop" | "length") per prompt.

        ``max_new_tokens``: one limit, or one per prompt. A prompt plus its limit must fit the cache
        capacity. ``progress(prompts, tokens)`` is called as prompts finish, with the tokens
        generated since the last call.
        """
        end_ids = set(int(e) for e in end_ids)
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [int(max_new_tokens)] * len(prompts)
        too_long = [i for i, p in enumerate(prompts) if len(p) + limits[i] > self.capacity]
        if too_long:
            raise ValueError(f"batched decoding: prompt {too_long[0]} ({len(prompts[too_long[0]])} tokens) + "
                             f"{limits[too_long[0]]} new tokens exceed the cache capacity {self.capacity}")
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(int(seed))
        out: list[list[int]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        owner = [-1] * self.slots  # request of each row, -1: free
        queue, free = deque(range(len(prompts))), list(range(self.slots))
        refill_at = max(1, self.slots // 8)  # prefill in groups: fewer, larger prefills
        pending_tokens = 0
        self.step_counts = Counter()

        def add(row: int, token: int) -> bool:
            """Append ``token`` to the request in ``row``; True if the request is finished."""
            nonlocal pending_tokens
            req = owner[row]
            out[req].append(token)
            pending_tokens += 1
            if token in end_ids:
                finish[req] = "stop"
                return True
            return len(out[req]) >= limits[req]

        released: list[int] = []  # rows freed since the last step: their position goes back to 0

        def release(row: int) -> None:
            nonlocal pending_tokens
            owner[row] = -1
            free.append(row)
            released.append(row)
            progress(1, pending_tokens)
            pending_tokens = 0

        while queue or any(o >= 0 for o in owner):
            if released:  # a free row decodes garbage from position 0 on: it reads one block, not its old reply
                self.pos[torch.tensor(released, device=self.device)] = 0
                released.clear()
            if queue and (len(free) >= min(refill_at, len(queue)) or all(o < 0 for o in owner)):
                take, longest = [], 0  # a group costs (its size) x (its longest prompt): padding included
                while queue and free and (not take or (len(take) + 1) * max(longest, len(prompts[queue[0]]))
                                          <= self.prefill_tokens):
                    req = queue.popleft()
                    take.append((free.pop(), req))
                    longest = max(longest, len(prompts[req]))
                rows = [r for r, _ in take]
                first = self._choose(self._prefill(rows, [prompts[q] for _, q in take]), temperature, top_p, gen)
                first_list = first.tolist()
                for (row, req), tok in zip(take, first_list):
                    owner[row] = req
                    if add(row, tok):
                        release(row)
                rows_t = torch.tensor(rows, device=self.device)
                self.ids[rows_t] = first
                self.pos[rows_t] = torch.tensor([len(prompts[q]) for _, q in take], device=self.device)
                continue
            busy = [r for r in range(self.slots) if owner[r] >= 0]
            n = self._bucket(len(busy))
            self.step_counts[n] += 1
            if n == self.slots:
                rows = list(range(self.slots))
                nxt = self._choose(self._step(n), temperature, top_p, gen)
                self.ids.copy_(nxt)
                self.pos.add_(1).clamp_(max=self.capacity - 1)  # free rows decode garbage in their own row
            else:  # few busy rows (the tail): compute only them, padded with a free row
                rows = busy + [free[0]] * (n - len(busy))
                idx = torch.tensor(rows, device=self.device)
                self.active[:n] = idx
                nxt = self._choose(self._step(n), temperature, top_p, gen)
                self.ids[idx] = nxt
                self.pos[idx] = (self.pos[idx] + 1).clamp_(max=self.capacity - 1)
            for row, tok in zip(rows, nxt.tolist()):
                if owner[row] >= 0 and add(row, tok):
                    release(row)
        return list(zip(out, finish))
