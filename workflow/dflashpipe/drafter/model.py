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

Two architectures (``DrafterConfig.arch``), one class:

* ``dflash``: the paper's drafter, as above.
* ``dflash2``: z-lab's DFlash 2 (``DFlash2DraftModel``): the same KV injection,
  plus in every layer two grouped dynamic causal convolutions over the block's
  positions (:class:`GroupedDynamicConv`, one around attention, one around the
  MLP), logits scaled by ``output_multiplier`` and soft-capped, and a low-rank
  :class:`CandidateSelector` that re-ranks the top-k candidates of each block
  position given the token chosen before it (:meth:`DFlashDrafter.propose`).

* ``dspark``: DeepSeek's DSpark (DeepSpec ``Qwen3DSparkModel``): the DFlash backbone whose
  block slot k predicts the token after position a+k (slot 0, the anchor, drafts too: a block of
  bs slots proposes bs tokens; :attr:`DrafterConfig.label_shift`), a low-rank :class:`MarkovHead`
  adding a bias from the token before each slot to its logits (the anchor, then each drafted
  token in turn), and a :class:`ConfidenceHead` predicting each slot's acceptance.

Any can have sliding-window layers (``layer_types`` / ``sliding_window``): a
block query at position p sees a context key j only if p - j < sliding_window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashpipe.jobs.errors import UserError

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
ARCHS = ("dflash", "dflash2", "dspark")
LAYER_TYPES = ("full_attention", "sliding_attention")


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


def resolve_layer_types(num_layers: int, sliding_window: int | None, layer_types: list[str] | None) -> list[str]:
    """Per-layer attention types: as given, else all sliding when a window is set, else all full."""
    if layer_types is not None:
        return list(layer_types)
    return ["sliding_attention" if sliding_window else "full_attention"] * int(num_layers)


def _arch(default):
    """A :class:`DrafterConfig` field that chooses the architecture: a key of the config's ``drafter``
    section of the same name, which training takes from the config as it is (:data:`ARCH_KEYS`)."""
    return field(default=default, metadata={"arch": True})


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
    # the architecture (ARCH_KEYS: the config's `drafter` keys of the same names)
    arch: str = _arch("dflash2")  # one of ARCHS; every _arch default is the schema's (tests/test_settings.py)
    layer_types: list[str] | None = _arch(None)  # per layer, one of LAYER_TYPES; None: all sliding iff sliding_window
    sliding_window: int | None = _arch(None)
    # dflash2 only (z-lab's dflash_config keys)
    conv_kernel_size: int = _arch(2)
    conv_group_size: int = _arch(16)
    selector_rank: int = _arch(256)
    selector_top_k: int = _arch(16)
    final_logit_softcapping: float | None = _arch(None)
    output_multiplier: float = _arch(1.0)
    # dspark only (DeepSpec's keys)
    markov_rank: int = _arch(256)

    def __post_init__(self):
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = resolve_layer_types(self.num_hidden_layers, self.sliding_window, self.layer_types)
        self.validate()

    @property
    def label_shift(self) -> int:
        """1 for DSpark (block slot k predicts token a+k+1, every slot drafts), 0 else (slot k predicts a+k)."""
        return int(self.arch == "dspark")

    @property
    def num_drafts(self) -> int:
        """Tokens one block proposes: bs - 1 (DFlash: slots 1..bs-1), bs (DSpark: every slot)."""
        return self.block_size - 1 + self.label_shift

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

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
        if self.arch not in ARCHS:
            raise UserError(f"drafter.arch: must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise UserError(
                f"drafter.layer_types: need {self.num_hidden_layers} entries, each one of {', '.join(LAYER_TYPES)}; "
                f"got {self.layer_types}"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UserError("drafter.layer_types: sliding_attention layers need drafter.sliding_window (a window in tokens)")
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise UserError(
                f"drafter.sliding_window ({self.sliding_window}) must be at least drafter.block_size ({self.block_size})"
            )
        if self.arch == "dflash2":
            if self.hidden_size % self.conv_group_size:
                raise UserError(
                    f"drafter.conv_group_size ({self.conv_group_size}) must divide the hidden size ({self.hidden_size})"
                )
            if not 1 <= self.selector_top_k <= self.vocab_size or self.selector_rank < 1 or self.conv_kernel_size < 1:
                raise UserError("drafter: selector_top_k, selector_rank and conv_kernel_size must be >= 1 "
                                "(selector_top_k at most the vocabulary)")
        if self.arch == "dspark" and self.markov_rank < 1:
            raise UserError(f"drafter.markov_rank ({self.markov_rank}) must be >= 1")

    @classmethod
    def from_target_config(
        cls,
        target_config,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        **arch_keys,
    ) -> "DrafterConfig":
        """Drafter shapes from an HF (Qwen3/Llama-like) target config.

        ``target_layer_ids=None`` -> :func:`default_target_layer_ids` with
        ``n = num_hidden_layers``, as the public DFlash reference does (paper: 5 and 5).
        ``arch_keys``: the architecture fields (``arch``, ``layer_types``, ``sliding_window``
        and the dflash2 keys), as the config's ``drafter`` section names them.
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
            **arch_keys,
        )

    def to_dict(self) -> dict:
        return asdict(self)


#: DrafterConfig's architecture fields, name -> type: the config's ``drafter`` keys of the same names, which
#: training's settings (``TrainConfig``) take with the schema's defaults. Declared once, in DrafterConfig (``_arch``).
ARCH_FIELDS = {f.name: f.type for f in fields(DrafterConfig) if f.metadata.get("arch")}
ARCH_KEYS = tuple(ARCH_FIELDS)


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
        return self._heads_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def _heads_kv(self, k: torch.Tensor, v: torch.Tensor, cos, sin):
        """Projected k, v [B, T, Hkv*D] -> [B, Hkv, T, D] each; k_norm then RoPE on k."""
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)

    def forward(self, x, ctx_k, ctx_v, cos, sin, attn=None, block_at: int | None = None) -> torch.Tensor:
        """x [B, Q, H] (normed block hidden); ctx_k/ctx_v [B, Hkv, S, D] projected context;
        cos/sin [B, 1, Q, D] block positions; attn: None (everything visible),
        bool [B, 1, Q, S+Q], or a BlockMask over the same key layout. -> [B, Q, H].

        ``block_at`` (the decoders' static caches): ctx_k/ctx_v are buffers [B, Hkv, block_at + Q, D] whose
        last Q positions take the block's keys/values in place, so no layer copies its context; ``attn`` must
        then hide the buffer's unwritten positions."""
        B, Q, _ = x.shape
        fused = getattr(self, "qkv_weight", None)  # decoding: q/k/v as one matmul (decode.layer.fuse_projections)
        if fused is None:
            q = self.q_proj(x)
            blk_k, blk_v = self.project_kv(x, cos, sin)
        else:
            q, k, v = F.linear(x, fused).split(self.fused_sizes, dim=-1)
            blk_k, blk_v = self._heads_kv(k, v, cos, sin)
        q = apply_rope(self.q_norm(q.view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2), cos, sin)
        if block_at is None:
            k, v = torch.cat([ctx_k, blk_k], dim=2), torch.cat([ctx_v, blk_v], dim=2)
        else:
            ctx_k[:, :, block_at:].copy_(blk_k)
            ctx_v[:, :, block_at:].copy_(blk_v)
            k, v = ctx_k, ctx_v
        groups = self.n_heads // self.n_kv
        if isinstance(attn, BlockMask):
            out = self.flex_fn(q, k, v, block_mask=attn, enable_gqa=groups > 1)
        elif attn is None:  # inference: the block sees all its context and itself
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1)
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
        fused = getattr(self, "gate_up_weight", None)  # decoding: gate and up as one matmul
        if fused is not None:
            gate, up = F.linear(x, fused).split(self.fused_sizes, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grouped_causal_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """Causal convolution over each block's positions, one kernel per channel.

    x [B, L, H] with L a multiple of ``block_size`` (blocks side by side, never
    mixed: position 0 of a block sees no earlier position); dynamic [B, L, K, G]
    (per position and channel group); base [K, H] (per channel).
    out[t] = sum_o (base[o] + dynamic[t, o]) * x[t - o] within the block.
    """
    B, L, H = x.shape
    K, G = base.shape[0], dynamic.shape[-1]
    blocks = x.reshape(B * (L // block_size), block_size, G, H // G)
    kernel = dynamic.reshape(B * (L // block_size), block_size, K, G, 1) + base.view(K, G, H // G).to(x.dtype)
    out = kernel[:, :, 0] * blocks
    for o in range(1, K):
        out = out + kernel[:, :, o] * F.pad(blocks[:, :-o], (0, 0, 0, 0, o, 0))
    return out.reshape(B, L, H)


class GroupedDynamicConv(nn.Module):
    """DFlash 2's short convolution inside a layer, in two halves around a sub-layer.

    ``prepare`` convolves the sub-layer's input and returns the kernel for its
    output; ``finish`` convolves the output. Each half's kernel is a static
    per-channel ``base_kernel[half]`` [K, H] plus a dynamic part per position and
    channel group, projected from the sub-layer's (normed) input. Initialised as
    the identity (base tap 0 = 1, no dynamic part): a fresh DFlash 2 drafter
    starts as a DFlash drafter.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, K = cfg.hidden_size, cfg.conv_kernel_size
        self.kernel_size, self.groups, self.block_size = K, H // cfg.conv_group_size, cfg.block_size
        base = torch.zeros(2, K, H)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(H, 2 * K * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor):
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        # in the projection's dtype: under autocast the bf16 the sub-layer's matmuls read anyway, not the fp32
        # a norm with fp32 weights gives (half the bytes; decoding, all bf16, convolves the same); fp32 without
        x = x.to(dyn.dtype)
        return _grouped_causal_conv(x, dyn[..., 0, :, :], self.base_kernel[0], self.block_size), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        return _grouped_causal_conv(y, dyn, self.base_kernel[1], self.block_size)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; only the block has a residual stream (DFlash 2: convolutions around
    attention and MLP). ``layer_type``: full or sliding-window attention (the mask the caller passes)."""

    def __init__(self, cfg: DrafterConfig, layer_type: str = "full_attention"):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dflash2 = cfg.arch == "dflash2"
        self.attention_conv = GroupedDynamicConv(cfg) if dflash2 else None
        self.mlp_conv = GroupedDynamicConv(cfg) if dflash2 else None

    def forward(self, h, ctx_k, ctx_v, cos, sin, attn=None, block_at: int | None = None):
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            h = h + self.self_attn(x, ctx_k, ctx_v, cos, sin, attn, block_at)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, kernel = self.attention_conv.prepare(x)
        h = h + self.attention_conv.finish(self.self_attn(x, ctx_k, ctx_v, cos, sin, attn, block_at), kernel)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), kernel)


class CandidateSelector(nn.Module):
    """DFlash 2's low-rank re-ranker of each block position's top-k candidates.

    score(c | previous token t, hidden h) = logit(c) + <P[t] * W h, S[c]> with
    codebooks P, S [V, rank] and W [rank, H]. The exported keys are
    ``candidate_selector.{predecessor,successor}_codebook`` (no ``.weight``, as in
    z-lab's checkpoints) and ``candidate_selector.hidden_projection.weight``.
    The successor codebook starts at zero: a fresh selector ranks as the logits do.
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * DFlashDrafter.INIT_STD)
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def scores(self, hidden, unary, candidates, previous):
        """hidden [..., H], unary/candidates [..., k], previous [...] -> candidate scores [..., k]."""
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        query = F.embedding(previous, self.predecessor_codebook) * proj  # [..., rank]
        successors = F.embedding(candidates, self.successor_codebook)  # (an embedding's backward: no sort of the grid)
        pair = (successors * query.unsqueeze(-2).to(self.successor_codebook.dtype)).sum(-1)
        return unary.float() + pair.float()

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
               ids: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy path: hidden [B, P, H], logits [B, P, V], anchor_ids [B] -> tokens [B, P], position by position
        (``ids``: the token of each of the V logits, a draft vocabulary's; None: logit i is token i).

        The scores of every position's candidates after every candidate of the position before it
        (the anchor for position 0) come from one batched product, a [B, P, k, k] table; the path
        then only picks a row per position (a few small ops each, no host sync: CUDA graphs capture it).
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)  # [B, P, k]
        if ids is not None:
            candidates = ids[candidates]
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [B, P, rank]
        before = torch.cat([anchor_ids[:, None, None].expand(-1, 1, self.top_k), candidates[:, :-1]], dim=1)
        query = (self.predecessor_codebook[before] * proj.unsqueeze(2)).to(self.successor_codebook.dtype)
        pair = query @ self.successor_codebook[candidates].transpose(-1, -2)  # [B, P, k before, k candidates]
        table = unary.float().unsqueeze(2) + pair.float()
        row, path = torch.zeros_like(anchor_ids), []  # position 0: every row of `before` is the anchor
        for i in range(hidden.shape[1]):
            row = table[:, i].gather(1, row[:, None, None].expand(-1, 1, self.top_k))[:, 0].argmax(dim=-1)
            path.append(row)
        return candidates.gather(-1, torch.stack(path, dim=1)[..., None])[..., 0]


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov head: the bias ``markov_w2(markov_w1[previous token])`` [..., V] added to a
    block slot's logits (DeepSpec's ``vanilla`` head; keys ``markov_head.markov_w{1,2}.weight``, both [V, rank])."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: a slot's acceptance logit from [hidden ; markov_w1[previous token]]
    (``confidence_head.proj`` with a bias; DeepSpec's ``confidence_head_with_markov``)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)

    def forward(self, hidden: torch.Tensor, previous_embeds: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], previous_embeds [..., rank] -> logits [...]."""
        x = torch.cat([hidden, previous_embeds.to(hidden.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype))[..., 0]


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
        self.layers = nn.ModuleList([DecoderLayer(cfg, t) for t in cfg.layer_types])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.arch == "dflash2" else None
        dspark = cfg.arch == "dspark"
        self.markov_head = MarkovHead(cfg) if dspark else None
        self.confidence_head = ConfidenceHead(cfg) if dspark else None
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=self.INIT_STD)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for layer in self.layers:  # the convolutions start as the identity
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    nn.init.zeros_(conv.kernel_projection.weight)
        self.compile_mode = "none"
        self.layer_fn = _block_layer  # how forward() runs one layer
        self.draft_ids = self.draft_head = self.draft_markov = None  # a draft vocabulary (use_draft_vocab): decoding only

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
            mask = attn[layer.layer_type] if isinstance(attn, dict) else attn
            h = self.layer_fn(layer, h, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, mask)
        return self.norm(h)

    def logit_transform(self) -> tuple[float, float | None]:
        """(multiplier, soft cap) applied to the LM head's logits: (1, None) for DFlash."""
        cap = self.cfg.final_logit_softcapping
        return float(self.cfg.output_multiplier), (float(cap) if cap else None)

    def compute_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits of hidden [..., H] through the target's LM head (DFlash 2: scaled and soft-capped)."""
        logits = hidden.to(lm_head_weight.dtype) @ lm_head_weight.t()
        mult, cap = self.logit_transform()
        if mult != 1.0:
            logits = logits * mult
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def use_draft_vocab(self, ids: torch.Tensor | None, lm_head_weight: torch.Tensor | None = None) -> None:
        """Draft over the tokens ``ids`` only (ascending; None: the whole vocabulary again). Their rows of the LM
        head are copied once, and a draft reads those instead of the whole head: at Qwen3-8B's shapes the head
        is 1.2 GB of the draft's 3.2 GB. A token outside ``ids`` is never drafted, and decoding stays lossless. A
        DFlash draft changes only where the whole vocabulary's argmax lies outside ``ids`` (ties resolve to the
        lowest id either way); DFlash 2's and DSpark's where one of their candidates does."""
        if ids is None:
            self.draft_ids = self.draft_head = self.draft_markov = None
            return
        if lm_head_weight is None:
            raise ValueError("use_draft_vocab: the LM head's weight is needed to draft among ids")
        top_k = getattr(self.candidate_selector, "top_k", 0)
        if len(ids) < top_k:
            raise ValueError(f"a draft vocabulary of {len(ids)} tokens is smaller than the candidate selector's top {top_k}")
        self.draft_ids = ids.to(lm_head_weight.device, torch.long)
        self.draft_head = lm_head_weight.detach().index_select(0, self.draft_ids).contiguous()
        if self.markov_head is not None:  # DSpark: its Markov head's rows for ids too (it is V x rank as well)
            self.draft_markov = self.markov_head.markov_w2.weight.detach().index_select(0, self.draft_ids).contiguous()

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """A block's draft tokens: hidden [B, bs, H] (the whole block), anchor_ids [B] -> [B, num_drafts].

        DFlash: the argmax of slots 1..bs-1. DFlash 2: the candidate selector's greedy path over them.
        DSpark: slot by slot over all bs slots, the argmax of its logits plus the Markov head's bias
        from the token before it (the anchor, then the token just drafted). With a draft vocabulary
        (:meth:`use_draft_vocab`) each picks among its tokens only.
        """
        ids = self.draft_ids
        hidden = hidden[:, 1 - self.cfg.label_shift :]
        logits = self.compute_logits(hidden, lm_head_weight if ids is None else self.draft_head)
        if self.markov_head is not None:
            previous, path = anchor_ids, []
            for i in range(hidden.shape[1]):
                if ids is None:
                    bias = self.markov_head.bias(previous)
                else:  # the Markov head's rows for ids only
                    bias = F.linear(self.markov_head.markov_w1(previous), self.draft_markov)
                best = (logits[:, i].float() + bias.float()).argmax(dim=-1)
                previous = best if ids is None else ids[best]
                path.append(previous)
            return torch.stack(path, dim=1)
        if self.candidate_selector is None:
            best = logits.argmax(dim=-1)
            return best if ids is None else ids[best]
        return self.candidate_selector.select(hidden.to(logits.dtype), logits, anchor_ids, ids)

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
        ctx_positions = torch.arange(cache.seq_len, device=positions.device)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache.k[i], cache.v[i], cos, sin, window_mask(positions, ctx_positions, self.cfg.window_of(i)))
        return self.norm(h)


def apply_compile_mode(setup, drafter) -> None:
    """Give the drafter the step setup's compile mode; on the flex (CUDA) path, guard the compiled path.

    ``setup``: the :class:`~dflashpipe.training.step.Setup` of the run (its ``attention``, ``compile``
    and ``cfg.activation_memory_budget``).

    ``layers``: the drafter's layers (flex_attention inside), the target's
    layers and the loss chunks run as compiled graphs, one each shared by all
    layers (norms, RoPE, SwiGLU, softmax-CE fused); ``flex``: only
    flex_attention is compiled; ``none``: nothing is. On the flex path any
    dense (uncompiled) flex_attention call is an error, whatever the mode: with
    ``none`` the first attention call stops with one line instead of
    materialising the full score matrix. Shapes are static: one graph per bucket.

    Dynamo's DDP optimiser is off: it would split a graph compiled inside
    DistributedDataParallel's forward at gradient-bucket boundaries, so a shard
    would compile other graphs than the single-process warm job. The compiled
    regions are single layers, whose gradients become ready layer by layer, so
    DDP's bucketed all-reduces overlap the backward without it.

    ``train.activation_memory_budget`` (< 1) makes AOTAutograd's partitioner keep fewer of the
    compiled graphs' activations and recompute the rest in the backward. Like the Dynamo setting
    above it is process-wide: a warm job and a rank are processes of their own.
    """
    from dflashpipe.jobs.hotstart import forbid_dense_flex

    drafter.set_compile_mode(setup.compile)
    if setup.attention == "flex":
        forbid_dense_flex()
        torch._dynamo.config.optimize_ddp = False
    if setup.compile != "none":  # read when AOTAutograd partitions a graph (and part of its cache key)
        from torch._functorch import config as functorch_config

        functorch_config.activation_memory_budget = setup.cfg.activation_memory_budget


def window_mask(block_positions: torch.Tensor, ctx_positions: torch.Tensor, window: int | None):
    """The inference mask of one drafted block: None (everything visible) without a window, else
    bool [B, 1, Q, T+Q]: context key j visible iff position - j < window; the block sees itself whole.

    block_positions [B, Q], ctx_positions [T] (context keys in cache order)."""
    if window is None:
        return None
    ctx_ok = (block_positions[:, None, :, None] - ctx_positions.view(1, 1, 1, -1)) < window
    B, Q = block_positions.shape
    return torch.cat([ctx_ok, ctx_ok.new_ones(B, 1, Q, Q)], dim=-1)


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
        if cfg.arch == "dflash2":
            G, K = H // cfg.conv_group_size, cfg.conv_kernel_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + f"{conv}.base_kernel"] = (2, K, H)
                shapes[p + f"{conv}.kernel_projection.weight"] = (2 * K * G, H)
    shapes["norm.weight"] = (H,)
    shapes["fc.weight"] = (H, len(cfg.target_layer_ids) * H)
    shapes["hidden_norm.weight"] = (H,)
    if cfg.arch == "dflash2":
        V, R = cfg.vocab_size, cfg.selector_rank
        shapes["candidate_selector.predecessor_codebook"] = (V, R)
        shapes["candidate_selector.successor_codebook"] = (V, R)
        shapes["candidate_selector.hidden_projection.weight"] = (R, H)
    if cfg.arch == "dspark":
        V, R = cfg.vocab_size, cfg.markov_rank
        shapes["markov_head.markov_w1.weight"] = (V, R)
        shapes["markov_head.markov_w2.weight"] = (V, R)
        shapes["confidence_head.proj.weight"] = (1, H + R)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes
