"""The DFlash drafter: a few Qwen3 decoder layers that draft a whole block at once.

Shapes used throughout (B batch, S context length, Q block/query length,
H hidden size, nT number of target layers tapped, Hq/Hkv query/key-value heads,
D head dim):

* ``block_embeds``   [B, Q, H]      the target's (frozen) embedding of the block
                                    tokens: [anchor, MASK x (bs-1)] per block
* ``target_hidden``  [B, S, nT*H]   the target's hidden states of layers
                                    ``target_layer_ids`` concatenated on the last dim
* ``context``        [B, S, H]      ``hidden_norm(fc(target_hidden))``, shared by all layers
* ``position_ids``   [B, S+Q]       positions of the context, then of the block

KV injection: in every layer the keys/values are
``[k_proj/v_proj(context) ; k_proj/v_proj(block hidden)]`` while the queries come
from the block hidden only. The context has no query, FFN or residual path.

Two ways to run it:

* training, :meth:`DFlashDrafter.forward`, many blocks per sequence at once with
  either a dense boolean mask (SDPA; works everywhere incl. CPU backward) or a
  flex_attention ``BlockMask`` (the fast GPU path); both built from
  :func:`dflashpipe.drafter.masks.dflash_mask_mod`.
* inference, :meth:`DFlashDrafter.extend_context` + :meth:`DFlashDrafter.draft`
  with a :class:`DraftCache` holding the projected context keys/values.

The embedding and LM head are NOT part of this module: they are the target's,
frozen, and passed in by the caller.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashpipe.errors import UserError

# ---------------------------------------------------------------------------
# How the training forward runs (a property of each drafter: see DFlashDrafter.set_compile_mode)
# ---------------------------------------------------------------------------


def _block_layer(layer, h, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, attn):
    """One drafter layer of the training forward: project the context K/V, run the block."""
    ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
    return layer(h, ctx_k, ctx_v, blk_cos, blk_sin, attn)


#: ``layers``: each layer one compiled graph, shared by all layers, flex_attention traced inside;
#: ``flex``: only flex_attention compiled; ``none``: eager (the default; CPU/SDPA training).
COMPILE_MODES = ("layers", "flex", "none")


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """``n`` target layer ids spread uniformly from layer 1 to L-3.

    Qwen3-8B (L=36), n=5 -> [1, 9, 17, 25, 33] (the public DFlash reference's
    ``build_target_layer_ids``; ``round`` as there). For n=1 the middle layer.
    If [1, L-3] holds fewer than ``n`` layers (a shallow target) the ids are
    spread over [0, L-1] instead, so the drafter still sees distinct layers
    (a 4-layer target, n=3 -> [0, 2, 3]). Duplicates are removed, so fewer than
    ``n`` ids come back when the target has fewer than ``n`` layers.
    """
    L = int(num_target_layers)
    if L < 1 or n < 1:
        raise UserError(f"default_target_layer_ids: need num_target_layers >= 1 and n >= 1, got {L}, {n}")
    if n == 1:
        return [L // 2]
    start, end = 1, L - 3
    if end - start + 1 < n:
        start, end = 0, L - 1
    span = end - start
    ids = [int(round(start + i * span / (n - 1))) for i in range(n)]
    return sorted(set(ids))


def _rope_theta_of(target_config) -> float:
    """rope_theta of an HF config: ``rope_parameters`` (transformers 5) or top level."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        # Per-layer-type rope parameters (e.g. {"full_attention": {...}}).
        for sub in params.values():
            if isinstance(sub, dict) and "rope_theta" in sub:
                return float(sub["rope_theta"])
    theta = getattr(target_config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    return 10000.0


@dataclass
class DrafterConfig:
    """Shapes of the drafter. Attention/MLP shapes are copied from the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    block_size: int = 16

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise UserError(
                f"drafter config: target_layer_ids {bad} outside the target's layers 0..{self.num_target_layers - 1}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"drafter config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise UserError(f"drafter config: head_dim={self.head_dim} must be even for RoPE")
        if self.block_size < 2:
            raise UserError(f"drafter config: block_size={self.block_size} must be >= 2")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise UserError(
                f"drafter config: mask_token_id={self.mask_token_id} is not a row of the target embedding "
                f"(vocab_size={self.vocab_size})"
            )
        if self.num_hidden_layers < 1:
            raise UserError(f"drafter config: num_hidden_layers={self.num_hidden_layers} must be >= 1")

    @classmethod
    def from_target_config(
        cls,
        target_config,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
    ) -> "DrafterConfig":
        """Drafter shapes from an HF (Qwen3/Llama-like) target config.

        ``target_layer_ids=None`` -> :func:`default_target_layer_ids` with
        ``n = num_hidden_layers``, as the public DFlash reference does (paper: 5 and 5).
        """
        tc = target_config
        if mask_token_id is None:
            raise UserError("drafter config: mask_token_id is required (a token id that exists in the target embedding)")
        heads = int(tc.num_attention_heads)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        L = int(tc.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(L, num_hidden_layers)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(tc.intermediate_size),
            num_hidden_layers=int(num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta_of(tc),
            vocab_size=int(tc.vocab_size),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=L,
        )

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, scale by ``weight`` in the input dtype. x [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Default (unscaled) RoPE tables. position_ids [B, T] -> cos, sin [B, 1, T, D].

    inv_freq is computed on the fly in fp32 (no buffer), so casting the module to
    bf16 never rounds it.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, D]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D], cos/sin [B, 1, T, D]."""
    return x * cos + _rotate_half(x) * sin


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv*groups, T, D] (GQA for SDPA, works with every backend and mask)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sdpa_masked(q, k, v, mask: torch.Tensor, groups: int) -> torch.Tensor:
    """SDPA with a boolean mask [B, 1, Q, K] (True = visible) whose rows may be empty.

    A query row that sees nothing (padded block, or q past N*bs) would give NaN
    (or backend-dependent values) and, through the next layer's values, poison
    other rows even at weight 0 (0 * NaN = NaN). We let such rows see key 0 and
    then zero their output, which is exactly what flex_attention returns for an
    empty row; the loss gives those positions weight 0.
    q [B, Hq, Q, D], k/v [B, Hkv, K, D] -> [B, Hq, Q, D].
    """
    empty = ~mask.any(dim=-1, keepdim=True)  # [B, 1, Q, 1]
    first_key = torch.zeros_like(mask[:1, :1, :1])
    first_key[..., 0] = True
    safe = mask | (empty & first_key)
    out = F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=safe)
    return out.masked_fill(empty, 0.0)


class Attention(nn.Module):
    """Qwen3 attention with KV injection from the context (GQA, QK-norm, no bias)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.flex_fn = flex_attention  # eager, or compiled: DFlashDrafter.set_compile_mode

    def project_kv(self, x: torch.Tensor, cos, sin):
        """Keys/values of x [B, T, H] -> k, v [B, Hkv, T, D]; k_norm then RoPE on k.

        Used for the context and for the block alike: the public DFlash reference
        applies k_norm to ALL keys (context and block), so do we.
        """
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx_k, ctx_v, cos, sin, attn=None) -> torch.Tensor:
        """x [B, Q, H] (normed block hidden); ctx_k/ctx_v [B, Hkv, S, D] projected context;
        cos/sin [B, 1, Q, D] block positions; attn: None (everything visible),
        bool [B, 1, Q, S+Q], or a BlockMask over the same key layout. -> [B, Q, H]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        blk_k, blk_v = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, blk_k], dim=2)
        v = torch.cat([ctx_v, blk_v], dim=2)
        groups = self.n_heads // self.n_kv
        if isinstance(attn, BlockMask):
            out = self.flex_fn(q, k, v, block_mask=attn, enable_gqa=groups > 1)
        elif attn is None:
            out = F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups))
        else:
            out = sdpa_masked(q, k, v, attn, groups)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only the block has a residual stream."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx_k, ctx_v, cos, sin, attn=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx_k, ctx_v, cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---------------------------------------------------------------------------
# Inference cache
# ---------------------------------------------------------------------------


class DraftCache:
    """Per layer, the projected context keys/values (after k_norm and RoPE).

    ``k[i]``, ``v[i]``: [B, Hkv, T, D] for the T committed context positions.
    Block keys/values are never stored: each draft recomputes its block.
    """

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def seq_len(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if len(self.k) <= layer:
            self.k.append(k)
            self.v.append(v)
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)

    def crop(self, n: int) -> None:
        """Keep only the first ``n`` context positions."""
        self.k = [k[:, :, :n] for k in self.k]
        self.v = [v[:, :, :n] for v in self.v]


# ---------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """Stack of Qwen3 layers with KV injection; parameter names match the export layout."""

    INIT_STD = 0.02  # Qwen3 initializer_range

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.INIT_STD)
        self.compile_mode = "none"
        self.layer_fn = _block_layer  # how forward() runs one layer

    def set_compile_mode(self, mode: str) -> None:
        """How the training forward runs (one of :data:`COMPILE_MODES`); inference stays eager.

        ``layers`` ("regional" compile): the layers are identical in structure,
        so all of them share ONE compiled graph (per shape and grad mode), with
        flex_attention traced inside; Inductor fuses the RMSNorms, RoPE and
        SwiGLU and saves fewer activations for the backward than eager does.
        ``flex``: eager layers calling a compiled flex_attention. ``none``: eager.
        Shapes are static (``dynamic=False``): one graph per length bucket.
        """
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
        flex = torch.compile(flex_attention, dynamic=False) if mode == "flex" else flex_attention
        for layer in self.layers:
            layer.self_attn.flex_fn = flex
        self.layer_fn = torch.compile(_block_layer, dynamic=False) if mode == "layers" else _block_layer
        self.compile_mode = mode

    def _rope(self, position_ids, dtype):
        return rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden [B, S, nT*H] -> context [B, S, H] = hidden_norm(fc(.))."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, block_embeds, target_hidden, position_ids, attn) -> torch.Tensor:
        """Training forward over all blocks of a batch at once.

        block_embeds [B, Q, H]; target_hidden [B, S, nT*H]; position_ids [B, S+Q]
        (context positions then block positions); attn: bool [B, 1, Q, S+Q]
        (SDPA) or a flex ``BlockMask`` for (Q, S+Q). Returns final-normed hidden [B, Q, H].
        """
        S = target_hidden.shape[1]
        ctx = self.project_context(target_hidden)
        cos, sin = self._rope(position_ids, block_embeds.dtype)
        ctx_cos, ctx_sin = cos[:, :, :S], sin[:, :, :S]
        blk_cos, blk_sin = cos[:, :, S:], sin[:, :, S:]
        h = block_embeds
        for layer in self.layers:
            h = self.layer_fn(layer, h, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, attn)
        return self.norm(h)

    # -- inference ----------------------------------------------------------

    def new_cache(self) -> DraftCache:
        return DraftCache()

    @torch.no_grad()
    def extend_context(self, cache: DraftCache, target_hidden_new: torch.Tensor, positions: torch.Tensor) -> None:
        """Append projected context. target_hidden_new [B, T, nT*H], positions [B, T]."""
        ctx = self.project_context(target_hidden_new)
        cos, sin = self._rope(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.append(i, k, v)

    @torch.no_grad()
    def draft(self, cache: DraftCache, block_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run one block against all cached context (+ itself, bidirectional).

        block_embeds [B, Q, H], positions [B, Q] -> final-normed hidden [B, Q, H].
        The block's keys/values are not stored in the cache.
        """
        if not cache.k:
            raise ValueError("draft(): the cache holds no context; call extend_context first")
        cos, sin = self._rope(positions, block_embeds.dtype)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cache.k[i], cache.v[i], cos, sin, None)
        return self.norm(h)


def expected_state_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The exact export layout: key -> shape."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (hq, H)
        shapes[p + "self_attn.k_proj.weight"] = (hkv, H)
        shapes[p + "self_attn.v_proj.weight"] = (hkv, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, hq)
        shapes[p + "self_attn.q_norm.weight"] = (D,)
        shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    shapes["norm.weight"] = (H,)
    shapes["fc.weight"] = (H, len(cfg.target_layer_ids) * H)
    shapes["hidden_norm.weight"] = (H,)
    return shapes
