"""The target's decode step near the hardware at batch 1: a static KV cache and CUDA graphs.

At batch 1 a target forward reads every weight once, but an eager forward with a
growing ``DynamicCache`` launches a few hundred kernels from Python and spends several
times the weights' read time (docs/decoding.md). Here:

* the KV cache is one preallocated buffer per layer (:class:`StaticKV`), written
  in place at the step's positions; the attention mask lets position ``p`` see
  keys ``<= p``, so entries past the verified prefix (rejected drafts) are never
  read and need no cropping: the next step overwrites them;
* the step for a fixed number of new tokens (1 for AR decoding, ``block_size``
  for a DFlash verify) is captured once as a CUDA graph and replayed, so a step
  costs one launch;
* compiled, those steps attend with ``flex_attention`` (``attention="flex"``, the default
  with ``compile``) over the cache's live blocks only (positions up to the step's last); one
  token runs its decoding kernel, which splits the keys over the GPU's cores. SDPA's kernels at
  batch 1 split no keys, and with cuDNN's off (as the evaluation runs) none takes a mask with
  grouped heads: Inductor then writes it out in float32 (measured: docs/real-target.md).

The layers are the model's own modules: Llama, Qwen2 and Qwen3 layers are written out
(:mod:`.layer`) with their q/k/v and gate/up projections fused into one matmul each (the
same weights, views of one matrix), any other decoder with the standard layout and full
attention runs its HF layer modules; only the cache object differs, so the numbers are
the model's. With ``compile`` the captured steps are compiled first (Inductor fuses each
layer's elementwise work: fewer, larger kernels in the graph; the time per token of each:
docs/decoding.md). The prefill (variable length) runs the same step
uncaptured. On the CPU nothing is captured (the static cache still runs, which is
how the tests compare it with the dynamic path).

:class:`StaticTargetRunner` has :class:`~dflashpipe.decode.speculative.TargetRunner`'s
interface (``new_cache``, ``forward``, ``keep``), so both decoders use either.
Outputs of a captured step live in static buffers: read them before the next call.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dflashpipe.decode.cuda_graph import capture, round_capacity
from dflashpipe.decode.layer import (
    attention_dims,
    attention_inputs,
    finish_layer,
    fuse_projections,
    live_block_mask,
    written_out_reason,
)
from dflashpipe.drafter.features import has_standard_layout, layer_types_of

#: attention of the captured steps ("auto": flex when they are compiled, SDPA otherwise)
ATTENTION = ("auto", "flex", "sdpa")
#: positions per key block of the flex path (a static cache's capacity is a multiple of it)
KV_BLOCK = 128
#: flex_attention's kernel_options for its main kernel. Flex picks its decoding kernel for a few queries, which
#: with grouped query heads and these masks decoded other tokens than the eager loop in a verify (torch 2.11, an
#: H200: benchmarks/results/smollm2_h200_s19/) and drafted others in the static drafter (an H100, the tiny
#: target: held-out math tau 1.44 against 3.62; h100_eval_modes/); one token it decodes right. Its tiles: 16 queries
#: (a verify or a draft has 8-16; the default 128 were mostly padding) by 64 keys (32 computed wrong drafts):
#: benchmarks/flex_blocks.py, benchmarks/results/h100_train_ab/
FLEX_MAIN_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4}


def flex_attention_for(compiled: bool, dtype, attention: str = "auto") -> bool:
    """Whether captured steps attend with flex_attention: ``auto`` when compiled (eager flex writes the
    scores out: the CPU tests' check of the masks) and the dtype is one flex has (not float64);
    ``flex`` / ``sdpa`` as said."""
    if attention not in ATTENTION:
        raise ValueError(f"static decoding: attention {attention!r} (one of {', '.join(ATTENTION)})")
    if attention == "auto":
        return compiled and dtype != torch.float64
    return attention == "flex"


class StaticKV:
    """Per-layer K/V buffers [1, Hkv, capacity, D]; ``update`` writes at ``self.pos`` and returns the whole buffer."""

    def __init__(self, model, capacity: int, device, dtype):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.n_heads, self.n_kv, self.head_dim = attention_dims(cfg)
        shape = (1, self.n_kv, int(capacity), self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.model.layers]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.model.layers]
        self.capacity = int(capacity)
        self.pos: torch.Tensor | None = None  # [T] positions of the tokens being written
        if torch.device(device).type == "cuda":
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k[layer_idx].index_copy_(2, self.pos, key_states.to(self.k[layer_idx].dtype))
        self.v[layer_idx].index_copy_(2, self.pos, value_states.to(self.v[layer_idx].dtype))
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # asked by some attention paths; the buffer is always full
        return self.capacity


def supports_static(model) -> str | None:
    """None if :class:`StaticTargetRunner` can drive ``model``; else why not (one phrase)."""
    if not has_standard_layout(model):
        return f"{type(model).__name__} does not have the standard HF decoder layout"
    types = set(layer_types_of(model.model))
    if types != {"full_attention"}:
        return f"layer types {sorted(types)} (only full attention is supported)"
    from dflashpipe.decode.slots import host_synced_rope

    return host_synced_rope(model.config)


class StaticTargetRunner:
    """An HF causal LM with a static KV cache; steps of ``graph_sizes`` tokens captured as CUDA graphs.

    ``fused``: a Llama-layout model's layers run written out with fused projections (:mod:`.layer`);
    False runs HF's layer modules (the comparison in ``benchmarks/decode_speed.py``). ``attention``
    (one of :data:`ATTENTION`): how the steps of ``graph_sizes`` tokens attend (the prefill: SDPA)."""

    def __init__(self, model, layer_ids: list[int] | None = None, capacity: int = 2048,
                 graph_sizes: tuple[int, ...] = (1,), cuda_graphs: bool | None = None, compile: bool = False,
                 fused: bool = True, attention: str = "auto"):
        why = supports_static(model)
        if why:
            raise ValueError(f"static target step: {why}")
        self.model = model
        self.inner = model.model
        self.layer_ids = list(layer_ids or [])
        self.device = next(model.parameters()).device
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        params = inspect.signature(type(self.inner.layers[0]).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.last_layer = int(self.inner.config.num_hidden_layers) - 1
        dtype = next(model.parameters()).dtype
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        # compile: Inductor fuses each layer's norms, RoPE and SwiGLU before the capture (fewer, larger kernels);
        # only for the captured steps (uncaptured calls have varying lengths: the prefill, and the CPU)
        self.compiled = compile = compile and self.cuda_graphs
        # the Llama-layout models' layers written out with their projections fused (fewer, larger
        # matmuls: :mod:`.layer`); other layouts run HF's layer modules on the same cache
        self.written_out = fused and written_out_reason(model) is None
        self.graph_sizes = tuple(sorted(set(int(t) for t in graph_sizes)))
        # flex: the masks hold one block of queries
        flex = self.written_out and max(self.graph_sizes) <= KV_BLOCK and flex_attention_for(compile, dtype, attention)
        self.attention = "flex" if flex else "sdpa"
        self.cache = StaticKV(model, round_capacity(capacity, KV_BLOCK) if flex else capacity, self.device, dtype)
        if self.written_out:
            fuse_projections(model)
        self.key_pos = torch.arange(self.cache.capacity, device=self.device)
        # the positions of each step size's tokens: one buffer per size, which its graphs (and flex mask) read
        self.step_pos = {t: torch.zeros(t, dtype=torch.long, device=self.device) for t in self.graph_sizes}
        self._graphs: dict[tuple[int, bool], list] = {}  # (T, features) -> [graph, ids, outputs]
        self._flex = {t: self._flex_mask(t) for t in self.graph_sizes} if self.attention == "flex" else {}
        self._captured_step = torch.compile(self._step, dynamic=False) if compile else self._step
        if compile:  # room for a frame per layer should a model's HF layers break the graph (guarded on its
            # index); the written-out layers and Qwen3's HF layers (torch 2.11, transformers 5.17) trace as one graph
            n = len(self.inner.layers)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * n + 8)
        self.mode = (("static+cuda_graphs" if self.cuda_graphs else "static") + ("+compiled" if compile else "")
                     + ("+fused" if self.written_out else "") + ("+flex" if self.attention == "flex" else ""))

    def _flex_mask(self, T: int):
        """(live blocks [1, 1, 1], BlockMask) of the T-token step: key j seen by query i iff j <= its position."""
        pos = self.step_pos[T]
        live = torch.ones((1, 1, 1), dtype=torch.int32, device=self.device)
        order = torch.arange(self.cache.capacity // KV_BLOCK, dtype=torch.int32, device=self.device)

        def up_to_own_position(b, h, q_idx, kv_idx):
            return kv_idx <= pos[q_idx]

        return live, live_block_mask(live, order, up_to_own_position, T, self.cache.capacity, KV_BLOCK)

    # -- the step ------------------------------------------------------------

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, features: bool, last_only: bool):
        """ids [1, T], pos [T] (device) -> (logits fp32 [T or 1, V], features [1, T, nT*H] or None)."""
        x = self.embed(ids)
        position_ids = pos.unsqueeze(0)
        pe = self.inner.rotary_emb(x, position_ids)
        flex = self._flex.get(ids.shape[1])  # pos is then step_pos[T], which its mask reads
        if flex:  # the blocks up to the last position's
            live, mask = flex
            live.copy_((pos[-1:] // KV_BLOCK + 1).view(1, 1, 1))
        else:  # additive, in the activations' dtype: right for every attention implementation (sdpa, eager)
            visible = self.key_pos.unsqueeze(0) <= pos.unsqueeze(1)  # [T, capacity]
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))[None, None]
        self.cache.pos = pos
        wanted, feats = set(self.layer_ids) if features else set(), {}
        for i, layer in enumerate(self.inner.layers):
            if self.written_out:
                x = self._layer(i, layer, x, pe, mask)
            else:
                out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pe,
                            use_cache=True, **{self.cache_kw: self.cache})
                x = out[0] if isinstance(out, tuple) else out
            if i in wanted:
                feats[i] = self.inner.norm(x) if i == self.last_layer else x  # as HF's hidden_states
        h = self.inner.norm(x)
        logits = self.lm_head(h[:, -1:] if last_only else h)[0].float()
        return logits, (torch.cat([feats[i] for i in self.layer_ids], dim=-1) if features else None)

    def _layer(self, i: int, layer, x, pe, mask):
        """Decoder layer i written out (:mod:`.layer`: fused projections), attending over the static cache."""
        c = self.cache
        q, k, v = attention_inputs(layer, layer.input_layernorm(x), *pe, c.n_heads, c.n_kv, c.head_dim)
        k, v = c.update(k, v, i)
        if isinstance(mask, torch.Tensor):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.self_attn.scaling,
                                               enable_gqa=c.n_kv != c.n_heads)
        else:  # the flex path's BlockMask; a verify (T > 1) on flex's main kernel (FLEX_MAIN_KERNEL says why)
            o = flex_attention(q, k, v, block_mask=mask, scale=layer.self_attn.scaling, enable_gqa=c.n_kv != c.n_heads,
                               kernel_options=FLEX_MAIN_KERNEL if q.shape[2] > 1 else None)
        return finish_layer(layer, x, o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def _replay(self, ids: torch.Tensor, start: int, features: bool):
        """The captured step of T = ids.shape[1] tokens at positions start.. (captured at its first call).

        The inputs are copied into the graph's buffers first, also before the capture: its warm-up
        runs then write exactly the keys/values the step must write, never a placeholder's.
        """
        T, key = ids.shape[1], (ids.shape[1], features)
        new = key not in self._graphs
        if new:
            self._graphs[key] = [None, torch.zeros((1, T), dtype=torch.long, device=self.device), None]
        entry, pos = self._graphs[key], self.step_pos[T]
        entry[1].copy_(ids)
        pos.copy_(torch.arange(start, start + T, device=self.device))
        if new:
            entry[0], entry[2] = capture(lambda: self._captured_step(entry[1], pos, features, last_only=False),
                                         self.device, warmups=3)
        entry[0].replay()
        return entry[2]

    # -- TargetRunner's interface ------------------------------------------------

    def new_cache(self) -> StaticKV:
        return self.cache  # nothing to reset: the mask hides every position not yet written

    def keep(self, cache, n: int) -> None:
        """Verified prefix of ``n`` positions: nothing to do (later positions are masked, then overwritten)."""

    @torch.no_grad()
    def forward(self, cache, ids: torch.Tensor, start: int, features: bool = False, last_only: bool = False):
        T = ids.shape[1]
        if start + T > self.cache.capacity:
            raise ValueError(f"static target step: positions up to {start + T} exceed the cache capacity {self.cache.capacity}")
        if self.cuda_graphs and T in self.graph_sizes:
            logits, feats = self._replay(ids, start, features)
            return (logits[-1:] if last_only else logits), feats
        pos = torch.arange(start, start + T, device=self.device)
        if T in self._flex:  # uncaptured (the CPU's tests): the step's own positions, which its mask reads
            pos = self.step_pos[T].copy_(pos)
        return self._step(ids, pos, features, last_only)
