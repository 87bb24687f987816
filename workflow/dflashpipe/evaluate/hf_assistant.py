"""The exported drafter as transformers' own DFlash assistant (``MuseGlimmerAssistantModel``).

transformers (5.15 and later) ships DFlash speculative generation:
``target.generate(..., assistant_model=assistant, speculation_type="dflash")``
drives a ``DFlashTokenCandidateGenerator`` whose drafter class is
``MuseGlimmerAssistantModel`` (``model_type: muse_glimmer_assistant``). That class
is the same network as this pipeline's drafter (Qwen3 layers with QK-norm, KV
injection of the projected target context into every layer, non-causal block,
the target's embedding and LM head) under other names:

* config: ``block_size``, ``mask_token_id`` and ``target_layer_ids`` at the top
  level (not in ``dflash_config``); ``layer_types`` all ``full_attention`` (its
  default is sliding-window attention, which this drafter never uses);
* weights: ``fc`` -> ``encoder.fc``, ``hidden_norm`` -> ``encoder.output_norm_enc``;
  every ``layers.*`` key and ``norm`` keep their names.

:func:`load_hf_assistant` builds it in memory from a drafter export (what the
evaluator's ``hf_dflash`` method runs); :func:`export_hf_assistant` writes it as
a directory that ``transformers.AutoModel.from_pretrained`` loads without remote
code::

    python -m dflashpipe.evaluate.hf_assistant results/drafter results/drafter_transformers
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflashpipe.export.write import CONFIG_NAME, WEIGHTS_NAME, layer_shape_config, load_drafter
from dflashpipe.drafter.model import DrafterConfig
from dflashpipe.jobs.atomic import atomic_path, save_safetensors
from dflashpipe.jobs.errors import UserError

MODEL_TYPE = "muse_glimmer_assistant"
ARCHITECTURE = "MuseGlimmerAssistantModel"

#: Our export's key -> the transformers assistant's key (all other keys are identical).
RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def unavailable_reason() -> str | None:
    """None when the installed transformers has DFlash generation; else why not (one line)."""
    import transformers

    missing = []
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel  # noqa: F401
    except ImportError:
        missing.append("MuseGlimmerAssistantModel")
    try:
        from transformers.generation import DFlashTokenCandidateGenerator  # noqa: F401
    except ImportError:
        missing.append("DFlashTokenCandidateGenerator")
    if missing:
        return (
            f"transformers {transformers.__version__} has no DFlash speculative generation "
            f"(lacks {', '.join(missing)}; it ships with transformers 5.15 and later)"
        )
    return None


def unsupported_reason(cfg: DrafterConfig) -> str | None:
    """None when transformers' assistant can run this drafter; else why not (one line).

    ``MuseGlimmerAssistantModel`` is plain DFlash with full attention and the LM head's raw logits.
    """
    if cfg.arch != "dflash":
        return f"transformers' {ARCHITECTURE} runs plain DFlash drafters only, not drafter.arch {cfg.arch}"
    if "sliding_attention" in cfg.layer_types:
        return f"transformers' {ARCHITECTURE} is exported with full attention only; this drafter has sliding-window layers"
    if cfg.output_multiplier != 1.0 or cfg.final_logit_softcapping:
        return f"transformers' {ARCHITECTURE} uses the LM head's raw logits; this drafter scales or soft-caps them"
    return None


def _supported(drafter_dir: Path):
    """load_drafter, refusing a drafter the assistant cannot run (one-line UserError)."""
    drafter, cfg = load_drafter(drafter_dir)  # validates the export (keys, shapes, config)
    reason = unsupported_reason(cfg)
    if reason:
        raise UserError(f"{drafter_dir}: {reason}")
    return drafter, cfg


def assistant_config_dict(cfg: DrafterConfig, special_ids: dict | None = None, dtype: torch.dtype | None = None) -> dict:
    """The ``MuseGlimmerAssistantConfig`` fields for a drafter of config ``cfg``.

    ``special_ids``: bos/eos/pad token ids to carry over (the class's own defaults
    belong to another vocabulary, so unknown ones are written as null).
    """
    ids = special_ids or {}
    d = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        **layer_shape_config(cfg),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        # full attention over the whole context, as trained; sliding_window is then unused
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "sliding_window": cfg.max_position_embeddings,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "vocab_size": cfg.vocab_size,
        "num_target_layers": cfg.num_target_layers,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        val = ids.get(key)
        if isinstance(val, (list, tuple)):  # the assistant's config types these as one int
            val = val[0] if val else None
        d[key] = val
    if dtype is not None:
        d["dtype"] = str(dtype).removeprefix("torch.")
    return d


def assistant_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our export's state dict under the transformers assistant's names."""
    return {RENAMES.get(k, k): v for k, v in state.items()}


def _special_ids(drafter_dir: Path) -> dict:
    d = json.loads((drafter_dir / CONFIG_NAME).read_text())
    return {k: d.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def load_hf_assistant(drafter_dir: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """A ``MuseGlimmerAssistantModel`` (eval mode) with the weights of the drafter export ``drafter_dir``.

    Loading is strict both ways: every key of the assistant gets a weight and
    every weight of the export is used. Raises :class:`UserError` when the
    installed transformers has no DFlash generation, or for a drafter it cannot
    run (:func:`unsupported_reason`: DFlash 2, sliding-window layers).
    """
    reason = unavailable_reason()
    if reason:
        raise UserError(reason)
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    drafter_dir = Path(drafter_dir)
    drafter, cfg = _supported(drafter_dir)
    state = assistant_state_dict(drafter.state_dict())
    conf = assistant_config_dict(cfg, _special_ids(drafter_dir))
    conf.pop("model_type")
    conf["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = MuseGlimmerAssistantConfig(**conf)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = MuseGlimmerAssistantModel(config)
    missing, unexpected = _compare_keys(model, state)
    if missing or unexpected:
        raise UserError(
            f"{drafter_dir}: the drafter does not map onto transformers' {ARCHITECTURE} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.load_state_dict(state, strict=True, assign=True)
    # non-persistent buffers (RoPE inverse frequencies) were created on meta: rebuild them
    model.rotary_emb = type(model.rotary_emb)(config=config)
    model.to(device=device, dtype=dtype if dtype is not None else next(iter(state.values())).dtype)
    return model.eval().requires_grad_(False)


def _compare_keys(model, state) -> tuple[list[str], list[str]]:
    want = set(model.state_dict())
    return sorted(want - set(state)), sorted(set(state) - want)


def export_hf_assistant(drafter_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the drafter export ``drafter_dir`` as a transformers assistant directory (atomically).

    ``AutoModel.from_pretrained(out_dir)`` then returns a ``MuseGlimmerAssistantModel``
    (no remote code) for ``target.generate(..., assistant_model=it, speculation_type="dflash")``.
    The weights keep their dtype.
    """
    drafter_dir = Path(drafter_dir)
    drafter, cfg = _supported(drafter_dir)
    state = {k: t.contiguous() for k, t in assistant_state_dict(drafter.state_dict()).items()}
    conf = assistant_config_dict(cfg, _special_ids(drafter_dir), next(iter(state.values())).dtype)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
        save_safetensors(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m dflashpipe.evaluate.hf_assistant",
        description="Write a DFlash drafter export as transformers' MuseGlimmerAssistantModel directory.",
    )
    ap.add_argument("drafter_dir", help="the drafter export (config.json + model.safetensors)")
    ap.add_argument("out_dir", help="where to write the transformers assistant directory")
    args = ap.parse_args(argv)
    out = export_hf_assistant(args.drafter_dir, args.out_dir)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
