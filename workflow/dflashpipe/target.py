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


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _tokenizer_facts(path: Path) -> dict:
    """Mask token, token count, special tokens and chat template of a target, from its files.

    Reads tokenizer.json / tokenizer_config.json / chat_template.jinja directly, so
    that start-up checks need neither transformers nor torch; a target without
    tokenizer.json (e.g. a sentencepiece model only) is read through transformers.
    """
    def read(name: str) -> dict:
        return json.loads((path / name).read_text()) if (path / name).is_file() else {}

    cfg, special_map = read("tokenizer_config.json"), read("special_tokens_map.json")
    template = cfg.get("chat_template") or ""
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    named = {k: _token_content(cfg.get(k) or special_map.get(k))
             for k in ("mask_token", "eos_token", "bos_token", "pad_token", "unk_token")}
    if (path / "tokenizer.json").is_file():
        tj = json.loads((path / "tokenizer.json").read_text())
        added = {int(t["id"]): (t["content"], bool(t.get("special"))) for t in tj.get("added_tokens", [])}
        # tokens transformers adds at load from the config (older tokenizer_config.json files)
        for i, t in (cfg.get("added_tokens_decoder") or {}).items():
            added.setdefault(int(i), (t["content"], bool(t.get("special"))))
        vocab = tj.get("model", {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        n_tokens = max([*ids, *added, -1]) + 1
    else:  # pragma: no cover - slow path, only for tokenizers without tokenizer.json
        tok = load_tokenizer(str(path))
        added = {i: (t.content, t.special) for i, t in tok.added_tokens_decoder.items()}
        n_tokens, template = len(tok), tok.chat_template or ""
        named = {k: getattr(tok, k) for k in named}
    by_content = {c: i for i, (c, _) in added.items()}
    return {"added": added, "by_content": by_content, "n_tokens": n_tokens, "template": template, "named": named}


def resolve_mask_token(path: str, configured: int | None = None, field: str = "drafter.mask_token_id") -> tuple[int, str]:
    """The drafter's MASK token id for a target, and how it was chosen (the rule config/README.md documents):
    the tokenizer's mask token; else the first embedding row past the tokenizer's tokens (Qwen3:
    151669); else the lowest-id special token named *reserved*; else an error listing the special
    tokens the chat template does not use.

    A configured id must be a row of the target's embedding. One line, naming
    ``field`` and the candidates, when no rule applies.
    """
    p = check_target_dir(path)
    rows = json.loads((p / "config.json").read_text())
    rows = rows.get("text_config", rows).get("vocab_size")
    if configured is not None:
        if rows is not None and not 0 <= configured < rows:
            raise UserError(f"{field}: {configured} is not a row of the target embedding ({rows} rows in {p}/config.json)")
        return int(configured), "set in the config"
    facts = _tokenizer_facts(p)

    def row(token_id: int, how: str) -> tuple[int, str]:
        if rows is not None and token_id >= rows:
            raise UserError(f"{field}: {how} has id {token_id}, past the target embedding's {rows} rows ({p}/config.json); "
                            f"set {field} to a row of the embedding")
        return token_id, how

    mask = facts["named"]["mask_token"]
    if mask is not None and mask in facts["by_content"]:
        return row(facts["by_content"][mask], f"the tokenizer's mask token {mask!r}")
    if rows is not None and rows > facts["n_tokens"]:
        return facts["n_tokens"], (f"the first spare embedding row (the tokenizer has {facts['n_tokens']} tokens, "
                                   f"the embedding {rows} rows)")
    used = set(facts["named"].values())
    free = [(i, c) for i, (c, special) in sorted(facts["added"].items())
            if special and c not in used and c not in facts["template"]]
    reserved = [(i, c) for i, c in free if "reserved" in c.lower()]
    if reserved:
        return row(reserved[0][0], f"the reserved special token {reserved[0][1]!r}")
    listed = ", ".join(f"{i} {c!r}" for i, c in free[:8]) or "none"
    raise UserError(
        f"{field}: the target in {p} has no mask token, no spare embedding row ({rows} rows, {facts['n_tokens']} "
        f"tokens) and no reserved special token; set {field} to a token id it never needs to predict, e.g. a special "
        f"token its chat template does not use: {listed}"
    )


def end_token_ids(tokenizer=None, generation_config=None) -> list[int]:
    """Every id the target stops at: the tokenizer's eos and the generation config's (int or list).

    A reply ended by any of them is finished, not cut at the length limit (expansion, evaluation).
    """
    ids: list[int] = []
    for val in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        for v in val if isinstance(val, (list, tuple)) else [val]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids
