"""Loading the target model (any Hugging Face causal LM directory) with clear errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflashpipe.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def check_target_dir(path: str, field: str = "target.path") -> Path:
    """Fail with one line unless ``path`` looks like an HF model directory."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{field}: {p} does not exist; set it to a Hugging Face model directory or to null for the tiny default")
    if not p.is_dir():
        raise UserError(f"{field}: {p} is a file, not a model directory (expected config.json + weights + tokenizer)")
    if not (p / "config.json").is_file():
        raise UserError(f"{field}: {p} has no config.json; it is not a Hugging Face model directory")
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in p.iterdir()):
        raise UserError(f"{field}: {p} has no weight files (*.safetensors / *.bin); it is not a saved model")
    return p


def load_tokenizer(path: str, field: str = "target.path"):
    from transformers import AutoTokenizer

    check_target_dir(path, field)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise UserError(f"{field}: cannot load a tokenizer from {path}: {str(err).splitlines()[0]}") from None
    if tok.chat_template is None:
        raise UserError(f"{field}: the tokenizer in {path} has no chat template; the pipeline needs one")
    return tok


def load_target(path: str, device: str = "cpu", dtype=None, field: str = "target.path"):
    """Load (model, tokenizer) for inference; the model is in eval mode with grads off."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(path, field)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    except Exception as err:
        raise UserError(f"{field}: cannot load a causal LM from {path}: {str(err).splitlines()[0]}") from None
    model.to(device).eval().requires_grad_(False)
    return model, tok


def target_fingerprint(path: str) -> str:
    """A short stable identity of a target directory: its config, tokenizer and weight files.

    Weight files are identified by name and size (hashing many GB of weights
    would dominate small jobs); config and tokenizer files by content.
    """
    p = check_target_dir(path)
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if not f.is_file():
            continue
        h.update(f.name.encode())
        if f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size > (64 << 20):
            h.update(str(f.stat().st_size).encode())
        else:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def describe_target(path: str) -> dict:
    cfg = json.loads((check_target_dir(path) / "config.json").read_text())
    return {
        "path": str(path),
        "fingerprint": target_fingerprint(path),
        "model_type": cfg.get("model_type"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
    }
