"""Loading the target model (any Hugging Face causal LM directory) with clear errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflashpipe.jobs.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
#: the files a model saved here has (``save_pretrained`` of a model and its tokenizer, with the pinned
#: transformers): the workflow asks for each of them, so one deleted from the tiny target's or the AR
#: draft's folder makes its job run again
SAVED_MODEL_FILES = ("chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json")


def check_saved_model(path) -> None:
    """After a save: fail with one line if ``path`` lacks a file of :data:`SAVED_MODEL_FILES` (another
    transformers saves another set of files: the list is what the workflow asks for)."""
    missing = [f for f in SAVED_MODEL_FILES if not (Path(path) / f).is_file()]
    if missing:
        raise UserError(f"{path}: save_pretrained wrote no {', '.join(missing)} (this transformers saves other "
                        "files than dflashpipe.inputs.target.SAVED_MODEL_FILES lists); install the pinned "
                        "requirements.txt")


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


def safetensors_problem(f: Path) -> str | None:
    """What is wrong with a safetensors file, read from its header and size alone (a copy cut short, a
    download that stopped): ``"is truncated (...)"``, ``"is not a readable safetensors file (...)"``, or None."""
    import struct

    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        return f"is not a readable safetensors file ({err})"
    if size < 8 + n + end:
        return f"is truncated ({size} bytes of the {8 + n + end} its header lists)"
    return None


def _check_safetensors(f: Path, field: str) -> None:
    """One line unless ``f``'s header reads and its size holds every tensor the header lists."""
    problem = safetensors_problem(f)
    if problem:
        raise UserError(f"{field}: {f} {problem}; copy the model again")


def check_made_weights(folder, what: str) -> None:
    """A model the workflow made (the tiny target), checked while planning: its safetensors weights damaged
    after its job finished is one line saying to delete them, before a job that reads them (and Snakemake,
    which deletes that job's outputs first) starts."""
    for f in sorted(Path(folder).glob("*.safetensors")):
        problem = safetensors_problem(f)
        if problem:
            raise UserError(f"{f} {problem}: {what} is damaged; delete the file and rerun, snakemake makes it again")


def check_target_files(path: str, field: str = "target.path") -> Path:
    """What the workflow checks of a configured target while it plans, before any job deletes an output:
    a model directory (:func:`check_target_dir`) whose safetensors weights are whole (every shard an index
    names is there) and whose tokenizer has a chat template. Reads headers only: no torch, no weights."""
    p = check_target_dir(path, field)
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        try:
            if (p / name).is_file() and not isinstance(json.loads((p / name).read_text()), dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise UserError(f"{field}: {p / name} does not read as JSON ({err}); copy the model again") from None
    index = p / "model.safetensors.index.json"
    shards = sorted(p.glob("*.safetensors"))
    if index.is_file():
        try:
            named = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise UserError(f"{field}: {index} does not read ({err}); copy the model again") from None
        missing = [n for n in named if not (p / n).is_file()]
        if missing:
            raise UserError(f"{field}: {index} names {', '.join(missing[:3])}, which {p} lacks; copy the model again")
    for f in shards:
        _check_safetensors(f, field)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise UserError(f"{field}: {p} has no tokenizer (tokenizer.json / tokenizer_config.json); save the tokenizer "
                        "beside the model")
    if not _tokenizer_facts(p)["template"]:
        raise UserError(f"{field}: the tokenizer in {p} has no chat template (tokenizer_config.json chat_template or "
                        "chat_template.jinja); the pipeline renders every prompt with it: add the template of the "
                        "model's instruct version")
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


def prompt_text(tokenizer, turns, chat_template_kwargs: dict | None = None, where: str | None = None) -> str:
    """A prompt as the target's chat template renders it, ready for the reply (``add_generation_prompt``):
    the one place that encodes a prompt (expansion, its server backend, evaluation, the tiny target).

    A template that refuses the turns (Mistral-style strict user/assistant alternation given a ShareGPT
    ``system`` or ``tool`` turn) is one line naming ``where`` (the dataset file and row) and what to do
    (without ``where``, the template's own error)."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template([dict(t) for t in turns], tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except TemplateError as err:
        if where is None:
            raise
        roles = ", ".join(str(t["role"]) for t in turns)
        raise UserError(f"{where}: the target's chat template refuses this conversation (roles {roles}: {err}); "
                        "drop or merge the turns it does not take in the dataset, or give the target a chat template "
                        "that accepts them") from None


def prompt_ids(tokenizer, turns, chat_template_kwargs: dict | None = None, where: str | None = None) -> list[int]:
    """:func:`prompt_text`'s token ids (the template writes the special tokens itself: none are added)."""
    return list(tokenizer(prompt_text(tokenizer, turns, chat_template_kwargs, where), add_special_tokens=False)["input_ids"])


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


def _decides_tokens(f: Path) -> bool:
    """A file of a target directory that can change its tokens: any but hidden files (Snakemake's
    ``.snakemake_timestamp`` in a directory it made, ``.gitattributes``) and documentation."""
    return f.is_file() and not f.name.startswith(".") and f.suffix.lower() != ".md" and not f.name.upper().startswith("LICENSE")


def target_fingerprint(path: str) -> str:
    """A short stable identity of a target directory: the names and contents of its files.

    Every file that can change the tokens counts by content (weights, config, tokenizer, chat template,
    generation config, ...; not README.md or hidden files): a fine-tune swapped into the same directory
    is another target. Files over 64 MB (the weights) count by their sha256, read once per file version
    and cached (:func:`dflashpipe.jobs.filedigest.file_digest`): many GB are not re-read by every job.
    """
    from dflashpipe.jobs.filedigest import file_digest

    p = check_target_dir(path)
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if not _decides_tokens(f):
            continue
        h.update(f.name.encode())
        if f.stat().st_size > (64 << 20):
            h.update(b"sha256:" + file_digest(f).encode())
        else:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def write_target_id(out: str, fingerprint: str) -> None:
    """Write a target's fingerprint (:func:`target_fingerprint`) to ``out``, the small JSON file the rules read
    the target through: rule ``target_id`` for a configured target (the fingerprint read while planning is its
    param) and rule ``tiny_target`` beside the model it trains."""
    from dflashpipe.jobs.atomic import write_json

    write_json(out, {"fingerprint": fingerprint})


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


#: ``generate`` arguments of a target's ``generation_config.json`` that change which token comes next (or when a
#: reply ends), each with the value that leaves the model's distribution alone (transformers' global default)
NEUTRAL_DECODING = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0, "typical_p": 1.0, "min_p": None,
    "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "length_penalty": 1.0, "num_beams": 1,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None, "dola_layers": None,
    "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
    "renormalize_logits": False, "remove_invalid_values": False, "guidance_scale": None,
    "watermarking_config": None, "stop_strings": None, "max_time": None, "token_healing": False,
}


def generation_arguments(generation_config, max_new_tokens: int, temperature: float, top_p: float = 1.0,
                         eos_ids: list[int] | None = None, pad_token_id: int | None = None) -> tuple[dict, dict]:
    """``generate`` keyword arguments that decode exactly what the settings say, and what they neutralise.

    Greedy (``temperature`` 0) is argmax; sampling is softmax(logits / temperature) with the
    ``top_p`` cut and no top-k cut. transformers fills every argument left unset from the model's
    ``generation_config`` (Qwen2.5-Instruct: ``repetition_penalty: 1.05``), so each
    :data:`NEUTRAL_DECODING` key the target's config sets otherwise is passed with its neutral value.
    Returns ``(kwargs, neutralised)``: ``neutralised`` maps each key of the target's config that
    does not apply to its value there (for the log: :func:`describe_neutralised`). The batched and
    server backends apply none of these by construction; they log the same ``neutralised``.
    """
    from transformers import GenerationConfig

    known = GenerationConfig().to_dict()  # this transformers' keys (5.17 lacks some of 5.24's)
    kw = {"max_new_tokens": int(max_new_tokens)}
    if temperature > 0:
        kw.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if eos_ids is not None:
        kw["eos_token_id"] = [int(e) for e in eos_ids]
    if pad_token_id is not None:
        kw["pad_token_id"] = int(pad_token_id)
    neutralised = {}
    sampled = bool(getattr(generation_config, "do_sample", None))
    if temperature > 0 or sampled:  # greedy settings under greedy decoding change nothing: not worth a line
        for key, neutral in (("do_sample", kw["do_sample"]), ("temperature", kw["temperature"]),
                             ("top_p", kw["top_p"] or 1.0), ("top_k", 0)):
            val = getattr(generation_config, key, None)
            if val is not None and val != neutral:
                neutralised[key] = val
    for key, neutral in NEUTRAL_DECODING.items():
        val = getattr(generation_config, key, None)
        if key in known and val is not None and val != neutral:
            kw[key] = neutral
            neutralised[key] = val
    return kw, neutralised


def describe_neutralised(neutralised: dict, what: str = "regeneration") -> str | None:
    """One log line naming the target's generation settings that do not apply (None: nothing to say)."""
    if not neutralised:
        return None
    listed = ", ".join(f"{k}={v!r}" for k, v in sorted(neutralised.items()))
    return (f"the target's generation_config sets {listed}: not applied, {what} decodes exactly what the config says "
            "(greedy: argmax; sampling: temperature and top_p only)")


def target_generation_config(path: str):
    """The target's ``GenerationConfig`` as transformers would load it with the model (None: none derivable)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: what transformers derives from config.json
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
