"""One decoder layer of the Llama layout, written out for the decoders, with its projections fused.

At a decode step a layer's matmuls read its weights once and compute little, so each one costs
its bytes plus a fixed overhead per kernel, and one matmul of the concatenated weights costs
less than the separate ones (measured: docs/decoding.md). :func:`fuse_projections` therefore concatenates each
layer's q/k/v weights (and biases) into one matrix and gate/up into another, and makes the HF
modules' weights views of them: no memory is added, and HF's own forward (``generate``, the
training features) runs unchanged on the same numbers.

:func:`attention_inputs` and :func:`finish_layer` are the layer around its attention, which the
caller does its own way (a slotted cache with flex attention, a static cache with SDPA). Model
types: :data:`SUPPORTED_MODEL_TYPES` (others run HF's layer where the caller can).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: model types whose layers follow the Llama layout this module writes out
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def attention_dims(cfg) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a decoder config (GQA and head_dim defaults as HF's)."""
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    return n_heads, n_kv, int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)


def written_out_reason(model) -> str | None:
    """None if this module can run ``model``'s layers; else why not (one phrase). ``model`` may be a
    stand-in with only a ``config`` (what a job decides before loading the weights)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "quantization_config", None):
        return "quantised weights (plain floating-point nn.Linear projections only)"
    # a loaded model (not only its config): quantised or otherwise replaced projections keep HF's modules
    for layer in getattr(getattr(model, "model", None), "layers", []):
        a, m = layer.self_attn, layer.mlp
        for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if type(p) is not torch.nn.Linear or not p.weight.is_floating_point():
                return f"{type(p).__name__} projections (plain floating-point nn.Linear only)"
    return None


def _cat(*tensors):
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


#: the fused matrices: (layer attribute, fused name, the projections fused in it)
FUSED = (("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up", ("gate_proj", "up_proj")))


def _views(owner, name: str, parts) -> bool:
    """Whether the projections' weights are (still) views of the fused matrix."""
    fused = getattr(owner, f"{name}_weight", None)
    return fused is not None and all(p.weight.untyped_storage().data_ptr() == fused.data_ptr() for p in parts)


def _fuse(owner, name: str, part_names) -> None:
    """One fused matrix (and bias) from the projections' weights, which become views of it."""
    parts = [getattr(owner, n) for n in part_names]
    if _views(owner, name, parts):
        return
    with torch.no_grad():  # a plain tensor, even of weights that require a gradient (the drafter's)
        weight = _cat(*(p.weight for p in parts))
        bias = _cat(*(p.bias for p in parts)) if all(p.bias is not None for p in parts) else None
    start = 0
    for p in parts:  # the module's weight (and bias) now live inside the fused ones
        n = p.weight.shape[0]
        p.weight.data = weight[start : start + n]
        if bias is not None:
            p.bias.data = bias[start : start + n]
        start += n
    owner.register_buffer(f"{name}_weight", weight, persistent=False)
    owner.register_buffer(f"{name}_bias", bias, persistent=False)
    owner.fused_sizes = [p.weight.shape[0] for p in parts]


def fuse_projections(model, layers=None) -> None:
    """Each layer's q/k/v and gate/up weights as one matrix each (the buffers ``qkv_weight``,
    ``qkv_bias``, ``gate_up_weight``, ``gate_up_bias``, not saved with the model), the projections'
    own weights becoming views of them. Idempotent. Run it after the model is on its device.

    ``.to()`` copies every tensor on its own, so the projections stop being views (the same numbers,
    twice the memory): calling this again fuses them again, and a ``load_state_dict`` does it by itself
    (a hook), so the fused matrices never hold other weights than the projections. ``layers``: other
    layers with the same ``self_attn`` / ``mlp`` projections (the drafter's) instead of ``model``'s."""
    for layer in model.model.layers if layers is None else layers:
        for attr, name, part_names in FUSED:
            owner = getattr(layer, attr)
            _fuse(owner, name, part_names)
            if not getattr(owner, "_refuses_on_load", False):
                owner.register_load_state_dict_post_hook(lambda module, _keys, n=name, ps=part_names: _fuse(module, n, ps))
                owner._refuses_on_load = True


def live_block_mask(live: torch.Tensor, order: torch.Tensor, mask_mod, q_len: int, kv_len: int, block: int):
    """A flex BlockMask whose row b reads the key blocks ``order[:live[b]]`` of ``block`` positions, every one
    through ``mask_mod``: ``live`` int32 [rows, 1, 1], updated in place by each step, ``order`` [blocks]. One
    object for every step of a captured graph (the batched decoder's and the static steps')."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_indices = order.view(1, 1, 1, -1).expand(live.shape[0], 1, 1, -1).contiguous()
    return BlockMask.from_kv_blocks(live, kv_indices, BLOCK_SIZE=(block, block), mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    """x [B, heads, T, D]; cos/sin [B, T, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def attention_inputs(layer, h, cos, sin, n_heads: int, n_kv: int, head_dim: int, fused: bool = True):
    """h [B, T, H] (normed) -> q [B, Hq, T, D], k/v [B, Hkv, T, D] with RoPE (``fused``: one matmul,
    after :func:`fuse_projections`; else the three projection modules)."""
    a = layer.self_attn
    B, T, _ = h.shape
    if fused:
        q, k, v = F.linear(h, a.qkv_weight, a.qkv_bias).split(a.fused_sizes, dim=-1)
    else:
        q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
    q, k, v = q.view(B, T, n_heads, head_dim), k.view(B, T, n_kv, head_dim), v.view(B, T, n_kv, head_dim)
    if hasattr(a, "q_norm"):  # Qwen3
        q, k = a.q_norm(q), a.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin), v


def finish_layer(layer, x, o, fused: bool = True):
    """o [B, T, Hq*D] attention output -> the layer's output (``fused``: gate and up as one matmul)."""
    x = x + layer.self_attn.o_proj(o)
    m = layer.mlp
    if not fused:
        return x + m(layer.post_attention_layernorm(x))
    gate, up = F.linear(layer.post_attention_layernorm(x), m.gate_up_weight, m.gate_up_bias).split(m.fused_sizes, dim=-1)
    return x + m.down_proj(m.act_fn(gate) * up)
