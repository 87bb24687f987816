"""The exported drafter as transformers remote code: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``.

``save_drafter`` copies this file into every export as ``dflash.py``; the
export's ``config.json`` names it in ``auto_map`` (``dflash.DFlashDraftModel``
or ``dflash.DFlash2DraftModel``), the way z-lab's published drafters are
loaded. It is self-contained on purpose: it imports only torch and
transformers, never the pipeline, so an export directory works on its own.

The network is the pipeline's drafter (``dflashpipe.drafter.model``), written
again for inference only, with the same parameter names as the export:

* context: ``hidden_norm(fc(concat of the target's hidden states of
  target_layer_ids))``, projected to keys/values in every layer (k_norm, RoPE)
  and kept in a :class:`DraftCache`; the context has no query or residual path;
* block: ``[last token, MASK x (block_size-1)]`` (the target's embedding),
  queries and keys/values of its own, bidirectional inside the block; a
  ``sliding_attention`` layer sees context position j from block position p
  only if ``p - j < sliding_window``;
* DFlash 2 (``DFlash2DraftModel``): per layer a grouped dynamic causal
  convolution over the block around attention and one around the MLP, logits
  scaled by ``output_multiplier`` and soft-capped (``final_logit_softcapping``),
  and a low-rank candidate selector choosing each position's token among the
  top ``selector_top_k`` given the token chosen before it (``propose``);
* DSpark (``Qwen3DSparkModel``): every block position drafts, position k the token after
  position k (``block_size`` drafts per block), each with a low-rank Markov bias
  ``markov_w2(markov_w1[token before])`` on its logits, position by position (``propose``); its
  confidence head (``confidence_head.proj``) is loaded but not used by greedy decoding.

The drafter has no embedding or LM head: both are the target's, passed in.
:meth:`DFlashDraftModel.spec_generate` runs greedy speculative decoding with a
transformers target (prefill; per step draft one block, verify it with one
target forward, accept the matching prefix plus the target's next token).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _setting(config, name, default=None):
    """A drafter setting: ``dflash_config[name]``, else the top-level key, else ``default``."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested and nested[name] is not None:
        return nested[name]
    value = getattr(config, name, None)
    return default if value is None else value


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", None) or 10000.0)


def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (unscaled RoPE, computed in fp32)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    angles = positions.float()[..., None] / (theta**exponents)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class DraftCache:
    """Per layer the keys/values of the committed context, and the context's positions [B, T]."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def add(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)


class DFlashAttention(nn.Module):
    """Qwen3 attention (GQA, QK-norm, no bias) whose keys/values are [context ; block]."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = kinds[layer_idx] == "sliding_attention"
        self.window = int(config.sliding_window) if sliding else None
        causal = getattr(config, "is_causal", None)
        # as the reference reads it: without is_causal, sliding layers are causal inside the block
        self.causal = sliding if causal is None else bool(causal)

    def keys_values(self, x: torch.Tensor, cos, sin):
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(k, cos, sin), v

    def visible(self, block_pos: torch.Tensor, ctx_pos: torch.Tensor):
        """bool [B, 1, Q, T+Q] or None (all visible)."""
        if self.window is None and not self.causal:
            return None
        keys = torch.cat([ctx_pos, block_pos], dim=1)  # [B, T+Q]
        gap = block_pos[:, None, :, None] - keys[:, None, None, :]  # query minus key position
        ok = torch.ones_like(gap, dtype=torch.bool)
        if self.causal:
            ok &= gap >= 0
        if self.window is not None:
            ok &= gap < self.window
            if not self.causal:
                ok &= -gap < self.window
        return ok

    def forward(self, x, ctx_k, ctx_v, cos, sin, mask):
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, cos, sin)
        blk_k, blk_v = self.keys_values(x, cos, sin)
        k = torch.cat([ctx_k, blk_k], dim=2)
        v = torch.cat([ctx_v, blk_v], dim=2)
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashBlockConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution over the block, in two halves around a sub-layer.

    Kernel tap o of channel c at block position t: ``base_kernel[half, o, c]`` plus a
    dynamic part per position and channel group (``kernel_projection`` of the
    sub-layer's input); group g holds channels g*group_size .. (g+1)*group_size-1.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x, dynamic, base):
        b, length, hidden = x.shape
        grouped = x.view(b, length, self.groups, self.group_size)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            earlier = grouped if tap == 0 else F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))
            weight = base[tap].view(self.groups, self.group_size).to(x.dtype) + dynamic[:, :, tap, :, None]
            out = out + weight * earlier
        return out.view(b, length, hidden)

    def prepare(self, x):
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, y, dynamic):
        return self._convolve(y, dynamic, self.base_kernel[1])


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, conv: bool = False):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        if conv:
            size, group = int(_setting(config, "conv_kernel_size")), int(_setting(config, "conv_group_size"))
            self.attention_conv = DFlashBlockConv(config.hidden_size, size, group)
            self.mlp_conv = DFlashBlockConv(config.hidden_size, size, group)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, h, ctx_k, ctx_v, cos, sin, mask):
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            h = h + self.self_attn(x, ctx_k, ctx_v, cos, sin, mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, kernel = self.attention_conv.prepare(x)
        h = h + self.attention_conv.finish(self.self_attn(x, ctx_k, ctx_v, cos, sin, mask), kernel)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), kernel)


class DFlashCandidateSelector(nn.Module):
    """score(c | previous t, hidden h) = logit(c) + sum_r P[t, r] (W h)[r] S[c, r] over the top-k candidates c."""

    def __init__(self, config):
        super().__init__()
        rank = int(_setting(config, "selector_rank"))
        self.top_k = int(_setting(config, "selector_top_k"))
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def select(self, hidden, logits, anchor_ids):
        """Greedy path: hidden [B, P, H], logits [B, P, V], anchor_ids [B] -> [B, P]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        previous, path = anchor_ids, []
        for i in range(hidden.shape[1]):
            query = self.predecessor_codebook[previous] * projected[:, i]  # [B, rank]
            pair = torch.einsum("br,bkr->bk", query, self.successor_codebook[candidates[:, i]])
            best = (unary[:, i].float() + pair.float()).argmax(dim=-1)
            previous = candidates[:, i].gather(-1, best[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, dim=1)


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (Qwen3 layers with the target's context injected as keys/values)."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    has_block_conv = False
    draft_from = 1  # the first block position that drafts (DSpark: 0)

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        self.target_layer_ids = [int(i) for i in _setting(config, "target_layer_ids")]
        self.block_size = int(_setting(config, "block_size", 16))
        self.mask_token_id = int(_setting(config, "mask_token_id"))
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.rope_theta = _rope_theta(config)
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(config, i, conv=self.has_block_conv) for i in range(config.num_hidden_layers)]
        )
        self.norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = DFlashRMSNorm(hidden, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, DFlashBlockConv):  # the identity: tap 0 = 1, no dynamic part
            nn.init.zeros_(module.base_kernel)
            with torch.no_grad():
                module.base_kernel[:, 0] = 1.0
            nn.init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, DFlashCandidateSelector):
            nn.init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            nn.init.zeros_(module.successor_codebook)

    # -- the network ------------------------------------------------------------------

    def new_cache(self) -> DraftCache:
        return DraftCache()

    def _rope(self, positions, dtype):
        return _rope_tables(positions, self.head_dim, self.rope_theta, dtype)

    @torch.no_grad()
    def extend_context(self, cache: DraftCache, target_hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Commit context: target_hidden [B, T, n*H] (the target's layers target_layer_ids), positions [B, T]."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self._rope(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            cache.add(i, *layer.self_attn.keys_values(ctx, cos, sin))
        cache.positions = positions if cache.positions is None else torch.cat([cache.positions, positions], dim=1)

    def forward(self, noise_embedding, position_ids, target_hidden=None, past_key_values=None, **kwargs):
        """Hidden states [B, Q, H] (final norm applied) of one block.

        noise_embedding [B, Q, H]: the target's embedding of [anchor, MASK x (Q-1)];
        target_hidden [B, T, n*H] (optional): new context, committed to ``past_key_values``
        (a :class:`DraftCache`; a fresh one when None); position_ids [B, T+Q]: the new
        context's positions, then the block's.
        """
        cache = past_key_values if past_key_values is not None else self.new_cache()
        if target_hidden is not None and target_hidden.shape[1]:
            t = target_hidden.shape[1]
            self.extend_context(cache, target_hidden, position_ids[:, :t])
            position_ids = position_ids[:, t:]
        if not len(cache):
            raise ValueError("DFlash drafter: no context (pass target_hidden or a cache that holds some)")
        h = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self._rope(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            mask = layer.self_attn.visible(position_ids, cache.positions)
            h = layer(h, cache.keys[i], cache.values[i], cos, sin, mask)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """Logits of hidden [..., H] through the target's LM head (a module or its weight)."""
        weight = lm_head if isinstance(lm_head, torch.Tensor) else lm_head.weight
        logits = hidden.to(weight.dtype) @ weight.t()
        multiplier = float(_setting(self.config, "output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = _setting(self.config, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head) -> torch.Tensor:
        """Greedy drafts of block positions 1..: hidden [B, P, H], anchor_ids [B] -> tokens [B, P]."""
        return self.compute_logits(hidden, lm_head).argmax(dim=-1)

    # -- greedy speculative decoding ------------------------------------------------------

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens: int, stop_token_ids=None, temperature: float = 0.0,
                      return_stats: bool = False):
        """Greedy DFlash decoding of one prompt with a transformers causal LM ``target``.

        input_ids [1, P]. Returns [1, P + new] (the prompt, then at most ``max_new_tokens``
        tokens, cut after the first of ``stop_token_ids``); with ``return_stats`` also a
        dict: ``accepted`` (drafts accepted per verify step) and ``committed`` (tokens
        each step added to the output).
        """
        from transformers import DynamicCache

        if temperature and temperature > 0:
            raise NotImplementedError("spec_generate decodes greedily (temperature 0) only")
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate takes one prompt (input_ids of shape [1, P])")
        self.eval()
        stops = {int(t) for t in (stop_token_ids or [])}
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        dev, bs = input_ids.device, self.block_size
        prompt = input_ids.shape[1]
        kv = DynamicCache(config=target.config)
        # transformers 5.24 renames the cache argument (past_key_values is deprecated there)
        cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        stats = {"accepted": [], "committed": []}

        def run_target(ids, start):
            pos = torch.arange(start, start + ids.shape[1], device=dev)[None]
            out = target(ids, position_ids=pos, use_cache=True, output_hidden_states=True, **{cache_arg: kv})
            feats = torch.cat([out.hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)
            return out.logits[0].argmax(dim=-1), feats

        def commit(tokens, output):
            kept = []
            for t in tokens:
                if len(output) + len(kept) >= max_new_tokens:
                    return kept, True
                kept.append(int(t))
                if int(t) in stops:
                    return kept, True
            return kept, len(output) + len(kept) >= max_new_tokens

        cache = self.new_cache()
        greedy, feats = run_target(input_ids, 0)
        self.extend_context(cache, feats, torch.arange(prompt, device=dev)[None])
        output, done = commit([int(greedy[-1])], [])
        masks = torch.full((1, bs - 1), self.mask_token_id, dtype=torch.long, device=dev)
        while not done:
            n = prompt + len(output)  # the target's cache holds n-1 positions; the anchor sits at n-1
            anchor = torch.tensor([[output[-1]]], device=dev)
            block = torch.cat([anchor, masks], dim=1)
            hidden = self(embed(block), torch.arange(n - 1, n - 1 + bs, device=dev)[None], past_key_values=cache)
            drafts = self.propose(hidden[:, self.draft_from :], anchor[:, 0], head)[0]
            greedy, feats = run_target(torch.cat([anchor[0], drafts])[None], n - 1)
            matches = (drafts == greedy[:-1]).long().cumprod(0)
            accepted = int(matches.sum())
            surplus = kv.get_seq_length() - (n + accepted)  # keep the anchor and the accepted drafts
            if surplus > 0:
                kv.crop(-surplus)
            self.extend_context(cache, feats[:, : accepted + 1], torch.arange(n - 1, n + accepted, device=dev)[None])
            kept, done = commit(drafts[:accepted].tolist() + [int(greedy[accepted])], output)
            output += kept
            stats["accepted"].append(accepted)
            stats["committed"].append(len(kept))
        ids = torch.cat([input_ids, torch.tensor([output], dtype=input_ids.dtype, device=dev)], dim=1)
        return (ids, stats) if return_stats else ids


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2: block convolutions in every layer, capped logits and the candidate selector."""

    has_block_conv = True

    def __init__(self, config):
        super().__init__(config)
        self.candidate_selector = DFlashCandidateSelector(config)
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head) -> torch.Tensor:
        logits = self.compute_logits(hidden, lm_head)
        return self.candidate_selector.select(hidden.to(logits.dtype), logits, anchor_ids)


class DSparkMarkovHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        rank = int(_setting(config, "markov_rank"))
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + int(_setting(config, "markov_rank")), 1)


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark: the DFlash backbone, every block position drafting, a Markov head over the token before."""

    draft_from = 0

    def __init__(self, config):
        super().__init__(config)
        self.markov_head = DSparkMarkovHead(config)
        self.confidence_head = DSparkConfidenceHead(config)
        self.post_init()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head) -> torch.Tensor:
        logits = self.compute_logits(hidden, lm_head)
        previous, path = anchor_ids, []
        for i in range(hidden.shape[1]):
            bias = self.markov_head.markov_w2(self.markov_head.markov_w1(previous))
            previous = (logits[:, i].float() + bias.float()).argmax(dim=-1)
            path.append(previous)
        return torch.stack(path, dim=1)
