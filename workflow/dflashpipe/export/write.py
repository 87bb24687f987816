"""Save/load a drafter in the published DFlash checkpoint layout.

Directory:

* ``config.json``: a Qwen3 config (``model_type: qwen3``,
  ``architectures: ["DFlashDraftModel"]`` or, for DFlash 2, ``["DFlash2DraftModel"]``,
  the ``auto_map`` z-lab's published drafters carry (``AutoModel: dflash.<class>``),
  shapes, ``num_hidden_layers`` = drafter layers, ``layer_types`` (all
  ``full_attention`` unless the drafter has sliding-window layers: then also
  ``sliding_window``, ``use_sliding_window: true`` and ``is_causal: false``, the
  block staying bidirectional), ``max_window_layers`` = drafter layers) plus top-level
  ``block_size``, ``num_target_layers``, ``rope_theta`` (transformers 5 writes only
  ``rope_parameters``; older readers would silently use theta 10000) and
  ``dflash_config: {block_size, mask_token_id, target_layer_ids}`` (SGLang reads
  ``dflash_config`` first and falls back to the top level; newer published drafters
  nest ``block_size`` there). DFlash 2 adds its keys to ``dflash_config``
  (``conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
  final_logit_softcapping, output_multiplier``) and ``use_cache: false``, as z-lab's
  DFlash 2 checkpoints do. DSpark (``["Qwen3DSparkModel"]``, as DeepSpec writes and SGLang's
  ``dspark.py`` registers it) adds ``markov_rank``, ``markov_head_type: vanilla``,
  ``enable_confidence_head`` and ``confidence_head_with_markov`` (both true) at the top level, where
  DeepSpec's config keeps every key (``mask_token_id`` and ``target_layer_ids`` too), and
  ``dspark_config: {block_size, mask_token_id, target_layer_ids, markov_rank, markov_head_type}``,
  which SGLang reads before the top level; its weights add ``markov_head.markov_w{1,2}.weight`` and
  ``confidence_head.proj.{weight,bias}``.
* ``dflash.py``: the remote code ``auto_map`` names, a copy of
  :mod:`dflashpipe.export.hf_modeling` (torch + transformers only), so
  ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` loads the export.
* ``README.md``: the model card (:mod:`.card`): target, recipe, data, training figures, serving lines.
* ``model.safetensors``: exactly the keys of
  :func:`dflashpipe.drafter.model.expected_state_shapes` (no ``model.`` prefix,
  no embedding / LM head, no biases but DSpark's confidence head's), floating point. A published
  DSpark checkpoint's copies of the target's embedding and LM head (``embed_tokens.``, ``lm_head.``)
  are skipped on loading, as SGLang skips them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflashpipe.jobs.atomic import atomic_path, save_safetensors
from dflashpipe.jobs.errors import UserError

from dflashpipe.export.card import model_card
from dflashpipe.export.files import CARD_NAME, CODE_NAME, CONFIG_NAME, WEIGHTS_NAME
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig, default_target_layer_ids, expected_state_shapes

if TYPE_CHECKING:  # copied beside the weights, not run here: a code dependency without its import time
    from dflashpipe.export import hf_modeling  # noqa: F401

#: the class of each architecture, as z-lab names them (``architectures`` and ``auto_map``)
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
#: as in z-lab's published DFlash drafters (e.g. z-lab/Qwen3-8B-DFlash-b16)
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
#: DFlash 2's keys in ``dflash_config`` (z-lab's names: the DrafterConfig fields of the same names)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "final_logit_softcapping",
                "output_multiplier")
#: DSpark's Markov head, as DeepSpec names it: the only kind this drafter has (DeepSpec also has gated and rnn)
MARKOV_HEAD_TYPE = "vanilla"
#: the target's own weights a published DSpark checkpoint may carry; the drafter uses the target's
SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


def layer_shape_config(cfg: DrafterConfig) -> dict:
    """The drafter's layer shapes as HF config keys (every exported config carries them)."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
    }


def drafter_config_json(cfg: DrafterConfig, target_config=None, dtype: torch.dtype | None = None) -> dict:
    """The config.json dict for ``cfg`` (see module docstring)."""
    from transformers import Qwen3Config

    extra = {}
    if target_config is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            val = getattr(target_config, key, None)
            if val is not None:
                extra[key] = val
    qc = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **extra,
    )
    d = qc.to_diff_dict()
    arch = ARCHITECTURES[cfg.arch]
    d.update(
        {
            "model_type": "qwen3",
            "architectures": [arch],
            "auto_map": {"AutoModel": f"dflash.{arch}"},
            "vocab_size": cfg.vocab_size,
            **layer_shape_config(cfg),
            "layer_types": ["full_attention"] * cfg.num_hidden_layers,
            "max_window_layers": cfg.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_theta": float(cfg.rope_theta),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
            "block_size": cfg.block_size,
            "num_target_layers": cfg.num_target_layers,
            "dflash_config": {
                "block_size": cfg.block_size,
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids),
            },
        }
    )
    if "sliding_attention" in cfg.layer_types:
        # as SGLang/vLLM and z-lab's reference read them; is_causal false: the block stays bidirectional
        # (without it the reference makes sliding layers causal inside the block)
        d.update(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window, use_sliding_window=True,
                 is_causal=False)
    if cfg.arch == "dflash2":
        d["dflash_config"].update({k: getattr(cfg, k) for k in DFLASH2_KEYS})
        d["use_cache"] = False
    elif cfg.arch == "dspark":
        markov = {"markov_rank": cfg.markov_rank, "markov_head_type": MARKOV_HEAD_TYPE}
        d.update(markov, enable_confidence_head=True, confidence_head_with_markov=True, **d["dflash_config"])
        d["dspark_config"] = {**d["dflash_config"], **markov}
    else:  # a plain DFlash drafter with a logit transform (not the paper's): written where the reference reads it
        if cfg.output_multiplier != 1.0:
            d["dflash_config"]["output_multiplier"] = cfg.output_multiplier
        if cfg.final_logit_softcapping:
            d["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    if dtype is not None:
        d["dtype"] = str(dtype).removeprefix("torch.")
    d.pop("id2label", None)
    d.pop("label2id", None)
    return d


def save_drafter(
    model: DFlashDrafter,
    cfg: DrafterConfig,
    out_dir: str | os.PathLike,
    target_config=None,
    dtype: torch.dtype | None = None,
    card: str | None = None,
) -> Path:
    """Write the checkpoint directory atomically; returns its path.

    ``dtype`` casts the saved weights (e.g. ``torch.bfloat16``); default: as in
    the model. ``target_config`` (optional) supplies bos/eos/pad ids and is
    checked against ``cfg``. ``card``: the model card's text (default: one that
    knows only ``cfg`` and the target's name).
    """
    if target_config is not None:
        th = getattr(target_config, "hidden_size", cfg.hidden_size)
        tl = getattr(target_config, "num_hidden_layers", cfg.num_target_layers)
        if th != cfg.hidden_size or tl != cfg.num_target_layers:
            raise UserError(
                f"save_drafter: drafter (hidden {cfg.hidden_size}, {cfg.num_target_layers} target layers) does not "
                f"match the target config (hidden {th}, {tl} layers)"
            )
    expected = expected_state_shapes(cfg)
    state = {}
    for name, t in model.state_dict().items():
        if name not in expected:
            raise ValueError(f"save_drafter: unexpected parameter {name!r} in the model")
        t = t.detach().to("cpu")
        if dtype is not None:
            t = t.to(dtype)
        if not t.is_floating_point():
            raise ValueError(f"save_drafter: parameter {name!r} is not floating point ({t.dtype})")
        state[name] = t.contiguous()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"save_drafter: model lacks {missing[:3]}")
    saved_dtype = dtype or next(iter(state.values())).dtype
    config = drafter_config_json(cfg, target_config, saved_dtype)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, is_dir=True) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_safetensors(state, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        shutil.copyfile(Path(__file__).with_name("hf_modeling.py"), tmp / CODE_NAME)
        if card is None:
            card = model_card(cfg, target=getattr(target_config, "_name_or_path", "") or "the target")
        (tmp / CARD_NAME).write_text(card)
    return out_dir


def _arch_from_json(d: dict, where: Path) -> dict:
    """The architecture fields of DrafterConfig from a config.json (ours, z-lab's DFlash or DFlash 2)."""
    dflash = d.get("dflash_config") or {}
    archs = d.get("architectures") or ["DFlashDraftModel"]
    names = {v: k for k, v in ARCHITECTURES.items()}
    if archs[0] not in names:
        raise UserError(f"{where}: architectures {archs} is not one of {', '.join(names)}")
    n = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if not layer_types:  # Qwen2/3 convention: layers from max_window_layers on slide when use_sliding_window
        slide_from = int(d.get("max_window_layers") or 0) if d.get("use_sliding_window") else n
        layer_types = ["sliding_attention" if i >= slide_from else "full_attention" for i in range(n)]
    out = {"arch": names[archs[0]], "layer_types": list(layer_types)}
    if "sliding_attention" in layer_types:
        if d.get("sliding_window") is None:
            raise UserError(f"{where}: layer_types has sliding_attention layers but sliding_window is missing")
        if d.get("is_causal") is not False:  # absent: the reference makes sliding layers causal in the block
            raise UserError(f"{where}: sliding_attention layers need 'is_causal': false (this drafter attends "
                            f"bidirectionally inside a block; got {d.get('is_causal')!r})")
        out["sliding_window"] = int(d["sliding_window"])
    if out["arch"] == "dspark":
        out.update(_dspark_from_json(d, where))
    for key in DFLASH2_KEYS:
        value = dflash.get(key, d.get(key))
        if value is not None:
            out[key] = value
        elif out["arch"] == "dflash2" and key != "final_logit_softcapping":
            raise UserError(f"{where}: missing key 'dflash_config.{key}' (a DFlash 2 drafter)")
    return out


def _dspark_from_json(d: dict, where: Path) -> dict:
    """DSpark's keys (``dspark_config`` first, then the top level, as SGLang reads them); what this drafter
    cannot run (another Markov head, no confidence head) is a one-line error."""
    nested = d.get("dspark_config") or {}

    def key(name, default=None):
        return nested[name] if nested.get(name) is not None else d.get(name, default)

    if key("markov_rank") is None:
        raise UserError(f"{where}: missing key 'dspark_config.markov_rank' (a DSpark drafter)")
    kind = key("markov_head_type", MARKOV_HEAD_TYPE)
    if kind != MARKOV_HEAD_TYPE:
        raise UserError(f"{where}: markov_head_type {kind!r}: only DeepSpec's {MARKOV_HEAD_TYPE!r} head is supported")
    if not (key("enable_confidence_head", True) and key("confidence_head_with_markov", True)):
        raise UserError(f"{where}: a DSpark drafter here has a confidence head over [hidden ; markov embedding] "
                        "(enable_confidence_head and confidence_head_with_markov true)")
    return {"markov_rank": int(key("markov_rank"))}


def _cfg_from_json(d: dict, where: Path) -> DrafterConfig:
    def need(key):
        if key not in d:
            raise UserError(f"{where}: missing key '{key}'")
        return d[key]

    dflash = d.get("dflash_config") or {}
    theta = d.get("rope_theta")
    if theta is None and isinstance(d.get("rope_parameters"), dict):
        theta = d["rope_parameters"].get("rope_theta")
    if theta is None:
        raise UserError(f"{where}: missing key 'rope_theta' (top level or rope_parameters)")
    mask_token_id = dflash.get("mask_token_id", d.get("mask_token_id"))
    if mask_token_id is None:
        raise UserError(f"{where}: missing key 'dflash_config.mask_token_id'")
    num_layers = int(need("num_hidden_layers"))
    # top level (this export and z-lab's Qwen3 drafters) or nested (newer published drafters)
    num_target_layers = int(d["num_target_layers"] if "num_target_layers" in d else dflash.get("num_target_layers") or need("num_target_layers"))
    block_size = d["block_size"] if "block_size" in d else dflash.get("block_size") or need("block_size")
    ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:
        ids = default_target_layer_ids(num_target_layers, num_layers)
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        block_size=int(block_size),
        mask_token_id=int(mask_token_id),
        target_layer_ids=list(ids),
        num_target_layers=num_target_layers,
        **_arch_from_json(d, where),
    )


def load_drafter(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a checkpoint directory written by :func:`save_drafter` (or a published DFlash drafter).

    Returns (model in eval mode, cfg). Bad input raises a one-line :class:`UserError`
    naming the file and key.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"drafter checkpoint {path}: directory not found")
    cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file}: file not found")
    try:
        d = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{cfg_file}: not valid JSON ({err})") from None
    if not isinstance(d, dict):
        raise UserError(f"{cfg_file}: expected a JSON object")
    cfg = _cfg_from_json(d, cfg_file)
    if not w_file.is_file():
        raise UserError(f"{w_file}: file not found")
    try:
        state = load_file(str(w_file))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{w_file}: cannot read safetensors ({err}); the file is truncated or corrupt: delete it and "
                        "rerun, snakemake exports it again (a drafter of your own: copy it again)") from None
    expected = expected_state_shapes(cfg)
    state = {k: v for k, v in state.items() if not (cfg.arch == "dspark" and k.startswith(SHARED_PREFIXES))}
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{w_file}: missing key '{missing[0]}'{more}")
    unexpected = sorted(k for k in state if k not in expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"{w_file}: unexpected key '{unexpected[0]}'{more}; not a DFlash drafter of this layout")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise UserError(
                f"{w_file}: key '{k}' has shape {list(state[k].shape)}, expected {list(shape)} from {CONFIG_NAME}"
            )
        if not state[k].is_floating_point():
            raise UserError(f"{w_file}: key '{k}' has dtype {state[k].dtype}, expected floating point")
    model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=dtype if dtype is not None else next(iter(state.values())).dtype)
    model.eval()
    return model, cfg


def export_final(final_state: str | os.PathLike, target_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 log=print, run: dict | None = None) -> Path:
    """The export rule: write the drafter export ``out_dir`` from a training run's final weights.

    ``final_state``: the safetensors file the train job publishes (the drafter's state dict, as
    trained, with metadata ``drafter_config`` (JSON of :class:`DrafterConfig`) and ``export_dtype``
    (the training autocast dtype the export is cast to; empty: as stored)). ``target_dir``: the
    target checkpoint (its bos/eos/pad ids go into config.json; its shapes are checked). ``run``: what
    the model card tells of the run: ``target`` (its name as configured), ``datasets`` (the training
    datasets' specs) and the paths ``stats`` (tokenized/stats.json) and ``summary`` (train/summary.json).
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    final_state = Path(final_state)
    try:
        with safe_open(str(final_state), "pt") as f:
            meta = f.metadata() or {}
        state = load_file(str(final_state))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{final_state}: cannot read the run's final weights ({err}); the file is truncated or corrupt: "
                        "delete it and rerun, snakemake writes it again from the run's last checkpoint") from None
    if "drafter_config" not in meta:
        raise UserError(f"{final_state}: no drafter_config in its metadata; not the final weights of a training run")
    # weights saved before drafter.arch existed name no arch: they are the paper's DFlash
    cfg = DrafterConfig(**{"arch": "dflash", **json.loads(meta["drafter_config"])})
    model = DFlashDrafter(cfg)
    model.load_state_dict(state, strict=True)
    name = meta.get("export_dtype") or ""
    dtype = getattr(torch, name) if name else None
    target_config = AutoConfig.from_pretrained(str(target_dir))
    if hasattr(target_config, "get_text_config"):
        target_config = target_config.get_text_config()
    run = run or {}
    card = model_card(cfg, target=run.get("target") or str(target_dir), datasets=run.get("datasets"),
                      stats=_read_json(run.get("stats")), summary=_read_json(run.get("summary")), drafter=str(out_dir),
                      recipe=run.get("recipe"), caveat=run.get("caveat"))
    out = save_drafter(model, cfg, out_dir, target_config=target_config, dtype=dtype, card=card)
    log(f"exported the drafter (step {meta.get('step', '?')}, {cfg.arch}) to {out}")
    return out


def _read_json(path) -> dict:
    """A JSON file's object, or an empty one for no path."""
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot read it for the model card ({err}); the file is truncated or corrupt: delete "
                        "it and rerun, snakemake makes it again") from None
