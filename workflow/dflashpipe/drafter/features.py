"""Context features: the target's hidden states that condition the drafter.

``context_features(target, input_ids, attention_mask, layer_ids)`` returns
``[B, S, len(layer_ids) * H]``: the concatenation, in ``layer_ids`` order, of
Hugging Face ``hidden_states[id + 1]`` (the output of decoder layer ``id``).
This is exactly what the published DFlash inference code feeds its drafters.

One HF detail matters: ``hidden_states[L]`` (the LAST layer) is returned AFTER
the final norm, all others before it. We reproduce that, so a feature of the
last layer means the same thing on both paths.

Two paths, identical results (a test checks it):

* fast: for the standard HF decoder layout (``model.model.embed_tokens``,
  ``.layers``, ``.norm``, ``.rotary_emb``) run the embedding and ONLY the layers
  up to ``max(layer_ids)``; the remaining layers and the LM head (for Qwen3-8B a
  [S, 151k] logits tensor per sequence) are skipped.
* fallback: ``target(..., output_hidden_states=True)`` for any other model.

For right-padded batches ``attention_mask`` may be None: in a causal LM a real
token never attends to the padding after it, so real positions get the same
features either way (and the cheaper is_causal attention path is used).
"""

from __future__ import annotations

import inspect
import weakref

import torch

_LAYOUT = ("embed_tokens", "layers", "norm", "rotary_emb")


def _run_layer(layer, x, mask, position_ids, position_embeddings):
    out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)


def compiled_target_layer():
    """The target's decoder layer as one compiled graph for all layers (norms, RoPE, SwiGLU fused).

    Pass it as ``layer_fn`` to :func:`context_features`.

    The target forward is a third of a drafter training step at Qwen3-8B
    shapes; eager HF layers spend a quarter of it in unfused elementwise kernels.
    (Once a forward with ``output_hidden_states=True`` has run in the process,
    transformers' output-capturing hooks break this graph in pieces; training
    never makes such a call.)
    """
    return torch.compile(_run_layer, dynamic=False)


def has_standard_layout(target) -> bool:
    """True if ``target.model`` has the HF decoder layout the fast path needs."""
    inner = getattr(target, "model", None)
    return inner is not None and all(hasattr(inner, a) for a in _LAYOUT)


def _call_mask_fn(fn, config, embeds, attention_mask, position_ids):
    """Call a transformers ``masking_utils`` mask builder across 5.x signature changes."""
    params = inspect.signature(fn).parameters
    kw = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    for name in ("cache", "past_key_values"):
        if name in params:
            kw[name] = None
    if "cache_position" in params:
        kw["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
    return fn(**{k: v for k, v in kw.items() if k in params})


#: Layer types the fast path can mask, and the ``transformers.masking_utils`` builder of each.
_MASK_BUILDERS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


def layer_types_of(inner) -> list[str]:
    """The attention type of each decoder layer of an HF model's inner model (``full_attention`` where unset)."""
    return list(getattr(inner.config, "layer_types", None) or ["full_attention"] * len(inner.layers))


#: The masks of unpadded batches, per model and shape (see :func:`_layer_masks`).
_SHAPE_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_masks(inner, embeds, attention_mask, position_ids):
    """{layer_type: mask} as the HF model builds it, or None if a layer type is unknown.

    Without an attention mask (and ``position_ids`` an ``arange`` of S: :func:`_fast_features`'s) the masks
    depend on the batch's shape alone: transformers' builder looks for packed sequences in ``position_ids``,
    a check that waits for the GPU, every training step. Where it finds that no layer needs a mask tensor
    (causal attention alone, the usual case) that answer is kept per shape, holding no memory."""
    from transformers import masking_utils

    types = layer_types_of(inner)
    if any(t not in _MASK_BUILDERS for t in types):
        return None, types
    held, key = _SHAPE_MASKS.setdefault(inner, {}), None
    if attention_mask is None:
        key = (tuple(types), getattr(inner.config, "_attn_implementation", None), *embeds.shape[:2], embeds.dtype,
               embeds.device)
        if key in held:
            return held[key], types
    build = {t: getattr(masking_utils, _MASK_BUILDERS[t]) for t in set(types)}
    masks = {t: _call_mask_fn(fn, inner.config, embeds, attention_mask, position_ids) for t, fn in build.items()}
    if key is not None and all(m is None for m in masks.values()):
        held[key] = masks
    return masks, types


@torch.no_grad()
def _fast_features(target, input_ids, attention_mask, layer_ids, layer_fn, final: bool = False):
    inner = target.model
    B, S = input_ids.shape
    x = inner.embed_tokens(input_ids)
    position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    masks, types = _layer_masks(inner, x, attention_mask, position_ids)
    if masks is None:
        return None
    position_embeddings = inner.rotary_emb(x, position_ids)
    # the model's own depth, not len(layers): trim_unused_layers may have dropped the tail
    wanted, last_layer = set(layer_ids), inner.config.num_hidden_layers - 1
    out = {}
    for i in range((last_layer if final else max(layer_ids)) + 1):
        x = layer_fn(inner.layers[i], x, masks[types[i]], position_ids, position_embeddings)
        if i in wanted:
            out[i] = inner.norm(x) if i == last_layer else x  # HF: hidden_states[L] is post-norm
    feats = torch.cat([out[i] for i in layer_ids], dim=-1)
    return (feats, inner.norm(x)) if final else feats


def trim_unused_layers(target, layer_ids) -> int:
    """Drop the target's decoder layers after ``max(layer_ids)`` (training never runs them).

    Frees their memory (for Qwen3-8B with the default taps, 2 of 36 layers,
    ~0.8 GB in bf16). Only where the fast path of :func:`context_features`
    runs (standard layout, layer types it can mask): it stops at the deepest
    tapped layer anyway. The trimmed model is for feature extraction only.
    Returns the number of layers dropped.
    """
    if not has_standard_layout(target):
        return 0
    if any(t not in _MASK_BUILDERS for t in layer_types_of(target.model)):
        return 0  # the HF fallback would run, and it needs every layer (its last output is post-norm)
    inner, keep = target.model, max(int(i) for i in layer_ids) + 1
    dropped = len(inner.layers) - keep
    if dropped > 0:
        inner.layers = inner.layers[:keep]
    return max(dropped, 0)


@torch.no_grad()
def prepare_target(target, cfg, setup, layer_ids) -> dict:
    """The loaded target as training runs it: trimmed to the tapped layers (unless distillation reads
    its last layer and LM head) and, with ``train.target_fp8``, its decoder linears in FP8 (:mod:`.fp8`)."""
    from dflashpipe.drafter.fp8 import quantize_decoder_linears

    done = {"layers_dropped": 0 if setup.objective.needs_teacher else trim_unused_layers(target, layer_ids)}
    if cfg.target_fp8:
        done["fp8"] = quantize_decoder_linears(target)
    return done


def _hf_features(target, input_ids, attention_mask, layer_ids, final: bool = False):
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
                 logits_to_keep=1)
    hs = out.hidden_states
    feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    return (feats, hs[-1]) if final else feats


@torch.no_grad()
def context_features(target, input_ids, attention_mask, layer_ids, path: str = "auto", layer_fn=None,
                     final: bool = False):
    """[B, S] token ids -> [B, S, len(layer_ids) * H] features (see module docstring).

    ``path``: "auto" (fast when the layout allows, else HF), "fast" (error if
    impossible) or "hf" (always ``output_hidden_states``). ``layer_fn``: how the
    fast path runs a layer (eager by default; :func:`compiled_target_layer`).
    ``final``: also return the target's last hidden state after its final norm
    [B, S, H] (what its LM head reads: the distillation loss's teacher), running
    every layer; then the result is ``(features, final)``.
    """
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise ValueError("context_features: layer_ids is empty")
    if path not in ("auto", "fast", "hf"):
        raise ValueError(f"context_features: path must be auto, fast or hf, got {path!r}")
    if path != "hf" and has_standard_layout(target):
        feats = _fast_features(target, input_ids, attention_mask, layer_ids, layer_fn or _run_layer, final)
        if feats is not None:
            return feats
    if path == "fast":
        raise ValueError(f"context_features: {type(target).__name__} does not have the standard HF decoder layout")
    return _hf_features(target, input_ids, attention_mask, layer_ids, final)


class TargetCache:
    """The frozen target's outputs per training sample, computed once and read again in later epochs
    (``train.cache_target_features``).

    The target never changes during training, so a sample's context features (and, for distillation,
    its final hidden states) are the same every time the sample comes back. A batch whose rows are all
    held is read from here; any other batch runs the target and stores its rows while the cache holds
    less than ``max_bytes`` (then it stops growing: a config written for a big target that inherits the
    key cannot fill the memory). Per sample: bucket length x taps (+1 with KL) x hidden values in the target's
    dtype (the shipped tiny default: ~0.25 GB for ~750 samples); meant for small targets, where the
    target's forward is a large part of a step (on 2 CPU cores, a quarter of it).
    """

    MAX_BYTES = 2 << 30

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.rows: dict[int, tuple] = {}
        self.max_bytes, self.nbytes = int(max_bytes), 0

    def __len__(self) -> int:
        return len(self.rows)

    def outputs(self, index, compute):
        """``compute()``'s result for the batch of dataset rows ``index``: (features, final or None)."""
        if index is not None and all(i in self.rows for i in index):
            rows = [self.rows[i] for i in index]
            return torch.stack([r[0] for r in rows]), (torch.stack([r[1] for r in rows]) if rows[0][1] is not None else None)
        feats, final = compute()
        size = sum(t.numel() * t.element_size() for t in (feats, final) if t is not None)
        if index is not None and self.nbytes + size <= self.max_bytes:
            for k, i in enumerate(index):
                self.rows[i] = (feats[k].clone(), final[k].clone() if final is not None else None)
            self.nbytes += size
        return feats, final
