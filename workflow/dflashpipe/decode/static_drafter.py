"""The drafter's side of a DFlash step at batch 1, captured as CUDA graphs (the target's: :mod:`.static_target`).

A DFlash step runs two drafter pieces besides the target's verify: the draft
(one forward of the block ``[last, MASK x (bs-1)]`` against the cached context,
then the LM head and argmax) and the context update (project the verified
positions' target features into every layer's keys/values). Eager, a few-layer
drafter is hundreds of small launches: at small target sizes it costs more than
the captured verify. Here both are captured once:

* the projected context lives in one buffer per layer ``[1, Hkv, capacity + bs, D]``;
  a counter ``valid`` says how many positions are context; the draft writes its block's
  keys/values into the last ``bs`` slots (no layer copies its context, as SGLang's and vLLM's
  drafters do), and its mask shows it positions ``< valid`` and its own block (bidirectional);
* an update after a verify always writes the whole verified block's positions
  (fixed shape: the anchor and the ``num_drafts`` drafts) starting at its first position, and sets ``valid`` to the
  verified prefix: the rejected positions past it are hidden, then overwritten by
  the next update, which starts exactly there.

:class:`StaticDrafterRunner` has :class:`~dflashpipe.decode.speculative.DrafterRunner`'s
interface (``new_cache``, ``extend``, ``propose``). The prompt's context (variable
length) is written uncaptured. On the CPU nothing is captured. With ``compile`` (the
target's steps compiled: ``evaluate.target_step`` auto or compiled on a GPU) both pieces
are compiled before their capture, and the draft attends as the target's steps do: with
``flex_attention`` (its main kernel, the live context blocks and the block's own keys) when
they do (:func:`~dflashpipe.decode.static_target.flex_attention_for`) and no layer has a sliding window.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflashpipe.decode.cuda_graph import capture, round_capacity
from dflashpipe.decode.layer import fuse_projections, live_block_mask
from dflashpipe.decode.static_target import FLEX_MAIN_KERNEL, KV_BLOCK, flex_attention_for


def block_masks(drafter, ctx_visible: torch.Tensor, pos: torch.Tensor, ctx_pos: torch.Tensor,
                block_visible: torch.Tensor) -> dict:
    """The masks of a drafted block, per window of the drafter's layers (None: full attention).

    ctx_visible bool [B, 1, bs, capacity] (the context each row shows), pos [B, bs] (the block's positions),
    ctx_pos [capacity], block_visible [B, 1, bs, bs] -> {window: bool [B, 1, bs, capacity + bs]}; a sliding
    layer also hides context more than ``window`` positions before each query. Shared with :mod:`.batched`."""
    masks = {}
    for window in {drafter.cfg.window_of(i) for i in range(len(drafter.layers))}:
        visible = ctx_visible
        if window is not None:  # sliding layers: only the last `window` positions before each query
            visible = visible & ((pos[:, None, :, None] - ctx_pos.view(1, 1, 1, -1)) < window)
        masks[window] = torch.cat([visible, block_visible], dim=-1)
    return masks


class StaticDrafterRunner:
    def __init__(self, drafter, embed, lm_head, mask_token_id: int, capacity: int, cuda_graphs: bool | None = None,
                 compile: bool = False, attention: str = "auto"):
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        fuse_projections(None, layers=drafter.layers)  # q/k/v and gate/up as one matmul each, as the target's
        cfg = drafter.cfg
        self.device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        compile = compile and self.cuda_graphs
        # flex only for full-attention layers (a sliding window's mask reads the query's row, which flex's decoding
        # kernel got wrong for the target's verify: static_target._layer) and a block within one key block
        windows = {cfg.window_of(i) for i in range(len(drafter.layers))}
        self.bs = int(cfg.block_size)
        self.flex = flex_attention_for(compile, self.dtype, attention) and windows == {None} and self.bs <= KV_BLOCK
        self.capacity = round_capacity(capacity, KV_BLOCK) if self.flex else int(capacity)
        if self.flex:  # flex's main kernel, as the target's verify (FLEX_MAIN_KERNEL says why)
            main = functools.partial(flex_attention, kernel_options=FLEX_MAIN_KERNEL)
            for layer in drafter.layers:
                layer.self_attn.flex_fn = main
        self.verified = cfg.num_drafts + 1  # positions of a verify: the anchor and the drafts
        shape = (1, cfg.num_key_value_heads, self.capacity + self.bs, cfg.head_dim)  # the context, then the block
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in drafter.layers]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in drafter.layers]
        self.ctx_pos = torch.arange(self.capacity, device=self.device)
        self.valid = torch.zeros((), dtype=torch.long, device=self.device)  # context positions [0, valid)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # the block's first position
        self.last = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.feats = torch.zeros((1, self.verified, len(cfg.target_layer_ids) * cfg.hidden_size), device=self.device,
                                 dtype=self.dtype)
        self.mask_ids = torch.full((1, self.bs - 1), int(mask_token_id), dtype=torch.long, device=self.device)
        self.block_visible = torch.ones((1, 1, self.bs, self.bs), dtype=torch.bool, device=self.device)
        self._live = torch.ones((1, 1, 1), dtype=torch.int32, device=self.device)  # the flex mask's blocks read
        self._flex_masks = {None: self._flex_mask()} if self.flex else {}
        self._graphs: dict[str, tuple] = {}
        # compile (with the graphs only, as the target's steps): Inductor fuses the drafter's norms, RoPE,
        # SwiGLU and the selector's elementwise work before each piece is captured
        self._pieces = {"propose": self._propose_block, "extend": self._extend_block}
        if compile:
            self._pieces = {name: torch.compile(fn, dynamic=False) for name, fn in self._pieces.items()}
        self.mode = (("static+cuda_graphs" if self.cuda_graphs else "static") + ("+compiled" if compile else "")
                     + ("+flex" if self.flex else ""))

    def _flex_mask(self):
        """The draft's BlockMask over the keys [context (capacity), block (bs)]: the context positions < valid, the
        block whole. It reads the block's key block first, then the context's live ones (``_live`` counts both)."""
        valid, C = self.valid, self.capacity

        def seen(b, h, q_idx, kv_idx):
            return (kv_idx < valid) | (kv_idx >= C)

        blocks = C // KV_BLOCK
        order = torch.cat([torch.tensor([blocks]), torch.arange(blocks)]).to(self.device, torch.int32)
        return live_block_mask(self._live, order, seen, self.bs, C + self.bs, KV_BLOCK)

    # -- the two pieces ---------------------------------------------------------------

    def _write(self, feats: torch.Tensor, positions: torch.Tensor) -> None:
        """Project feats [1, T, F] at positions [T] into every layer's context buffers."""
        ctx = self.drafter.project_context(feats.to(self.dtype))
        cos, sin = self.drafter._rope(positions.unsqueeze(0), ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            self.k[i].index_copy_(2, positions, k)
            self.v[i].index_copy_(2, positions, v)

    def _extend_block(self) -> None:
        self._write(self.feats, self.start + torch.arange(self.verified, device=self.device))

    def _propose_block(self) -> torch.Tensor:
        block = torch.cat([self.last, self.mask_ids], dim=1)  # [1, bs]
        h = self.embed(block).to(self.dtype)
        pos = (self.start + torch.arange(self.bs, device=self.device)).unsqueeze(0)
        cos, sin = self.drafter._rope(pos, h.dtype)
        if self.flex:  # the block's key block and the context's up to valid's
            self._live.copy_((1 + (self.valid + KV_BLOCK - 1) // KV_BLOCK).view(1, 1, 1))
            masks = self._flex_masks
        else:
            ctx_visible = (self.ctx_pos < self.valid).view(1, 1, 1, -1).expand(1, 1, self.bs, self.capacity)
            masks = block_masks(self.drafter, ctx_visible, pos, self.ctx_pos, self.block_visible)  # [1, 1, bs, C + bs]
        for i, layer in enumerate(self.drafter.layers):
            h = layer(h, self.k[i], self.v[i], cos, sin, masks[self.drafter.cfg.window_of(i)], block_at=self.capacity)
        hidden = self.drafter.norm(h)
        return self.drafter.propose(hidden, self.last[:, 0], self.lm_head.weight)[0]  # DFlash 2, DSpark: their heads

    def _run(self, name: str):
        fn = self._pieces[name]
        if not self.cuda_graphs:
            return fn()
        if name not in self._graphs:
            self._graphs[name] = capture(fn, self.device)
        graph, out = self._graphs[name]
        graph.replay()
        return out

    # -- DrafterRunner's interface ----------------------------------------------------

    def new_cache(self):
        return self  # one cache: ``valid`` says what is context

    @torch.no_grad()
    def extend(self, cache, feats: torch.Tensor, start: int, keep: int) -> None:
        """Context positions start..start+keep-1 from feats [1, T, F] (T >= keep; the rest is written but hidden)."""
        T = feats.shape[1]
        if start + max(T, self.verified) > self.capacity:
            raise ValueError(f"static drafter step: position {start + T} exceeds the cache capacity {self.capacity}")
        if T == self.verified:
            self.feats.copy_(feats)
            self.start.fill_(start)
            self._run("extend")
        else:  # the prompt: variable length, uncaptured
            self._write(feats[:, :keep], torch.arange(start, start + keep, device=self.device))
        self.valid.fill_(start + keep)

    @torch.no_grad()
    def propose(self, cache, n: int, last: torch.Tensor) -> torch.Tensor:
        """Drafts d_1..d_D [D = num_drafts] for the block anchored at position n-1 (token ``last`` [1, 1])."""
        if n - 1 + self.bs > self.capacity:
            raise ValueError(f"static drafter step: position {n - 1 + self.bs} exceeds the cache capacity {self.capacity}")
        self.last.copy_(last)
        self.start.fill_(n - 1)
        return self._run("propose")
