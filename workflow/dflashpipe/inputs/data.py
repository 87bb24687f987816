"""Loading prompt datasets named in the config into one normal form.

A dataset entry in ``config.yaml`` names a local file (``path``: .jsonl,
.jsonl.gz, .json, .parquet) or a Hugging Face dataset (``hf`` + ``split``), and
says which column holds the chat (``messages_column``) or the plain prompt
(``prompt_column``, optionally ``response_column``). A chat column holds either
OpenAI/UltraChat turns (``{role, content}``) or ShareGPT turns (``{from, value}``
with ``human``/``gpt``/``system``, also ``tool``/``function``/...); ``format``
(``auto``: per row, from the turns' keys) says which. Every dataset is turned
into the same table:

    id          str    stable row id (the dataset's own id column, else the row index)
    prompt      list   the conversation up to and including its last user turn
    reference   str    the original last assistant reply, or None

The target later regenerates the reply to ``prompt`` ("dataset expansion"). A turn's content may
be null (an assistant turn that only calls tools: empty text) or a list of content parts (their text
parts, joined by newlines). A row with no turns, no user turn or a non-text part (an image) holds no
prompt: it is skipped and counted (:data:`SKIPPED_ROWS`; the prompts stage's stats file and log). A
row's top-level ``system`` field (the LLaMA-Factory ShareGPT layout) is its system turn.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pandas as pd

from dflashpipe.jobs.errors import UserError

LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


def _check_jsonl(path: Path) -> None:
    """Fail on the first malformed line with file and line number."""
    opener = gzip.open if path.suffix == ".gz" else open
    n_rows = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(
                        f"{path}:{lineno}: malformed JSON line ({err.msg} at column {err.colno}); "
                        "fix or delete that line"
                    ) from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
                n_rows += 1
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read ({err}); is it a (gzipped) UTF-8 JSON-lines file?") from None
    if n_rows == 0:
        raise UserError(f"{path}: the file has no rows; point `path` at a non-empty dataset")


def load_table(spec: dict, name: str, repo_root: str | os.PathLike = ".") -> "datasets.Dataset":
    """Load the raw rows of one configured dataset with ``datasets``."""
    import datasets

    datasets.disable_progress_bars()
    where = f"datasets.{name}"
    if spec.get("path"):
        path = Path(repo_root, spec["path"])
        if not path.exists():
            raise UserError(f"{where}.path: file {path} does not exist; fix the path in the config")
        name_lower = path.name.lower()
        if not name_lower.endswith(LOCAL_SUFFIXES):
            raise UserError(f"{where}.path: {path} has an unsupported extension; use one of {', '.join(LOCAL_SUFFIXES)}")
        if name_lower.endswith(".parquet"):
            builder = "parquet"
        else:
            builder = "json"
            if ".jsonl" in name_lower:
                _check_jsonl(path)
        try:
            table = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:  # pyarrow / datasets raise many types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"{where}.path: cannot load {path} as {builder}: {first}") from None
    elif spec.get("hf"):
        try:
            table = datasets.load_dataset(spec["hf"], spec.get("hf_config"), split=spec.get("split", "train"))
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"{where}.hf: cannot load Hugging Face dataset {spec['hf']!r} "
                f"(split {spec.get('split', 'train')!r}): {first}. Without hub access, download it first "
                "or point `path` at a local jsonl/parquet file"
            ) from None
    else:
        raise UserError(f"{where}: give either `path` (a local jsonl/parquet file) or `hf` (a dataset name)")
    if len(table) == 0:
        raise UserError(f"{where}: the dataset has no rows; point it at a non-empty dataset")
    return table


#: chat columns read when a dataset names neither ``messages_column`` nor ``prompt_column`` and has no ``prompt``
CHAT_COLUMNS = ("conversations", "messages")


#: why a row holds no prompt (skipped and counted by :func:`normalize`)
SKIPPED_ROWS = ("empty_conversation", "no_user_turn", "non_text_content")


class SkippedRow(Exception):
    """A row that holds no prompt; its message is one of :data:`SKIPPED_ROWS`."""


def _text(content) -> str:
    """A turn's content as text: null is empty (an assistant turn that only calls tools); a list of
    content parts is its text parts joined by newlines (as vLLM joins them); any other part (an image,
    audio) leaves the row without a text prompt."""
    if content is None:
        return ""
    if hasattr(content, "tolist"):  # a parquet list column arrives as a numpy array
        content = content.tolist()
    if not isinstance(content, (list, tuple)):
        return str(content)
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            raise SkippedRow("non_text_content")
    return "\n".join(texts)


def _turns_from_row(row: dict, spec: dict, where: str) -> list[dict]:
    col = spec.get("messages_column")
    if not col and not spec.get("prompt_column") and "prompt" not in row:
        col = next((c for c in CHAT_COLUMNS if c in row), None)
    if col:
        if col not in row:
            raise UserError(f"{where}: no column {col!r} (has {sorted(row)}); set `messages_column` to the chat column")
        chat = row[col].tolist() if hasattr(row[col], "tolist") else row[col]
        if chat is None or chat == []:
            raise SkippedRow("empty_conversation")
        turns = _chat_turns(chat, spec.get("format") or "auto", col, where)
    else:
        col = spec.get("prompt_column") or "prompt"
        if col not in row:
            raise UserError(
                f"{where}: no column {col!r} (has {sorted(row)}); set `prompt_column` or `messages_column`"
            )
        turns = [{"role": "user", "content": _text(row[col])}]
        resp = spec.get("response_column")
        if resp:
            if resp not in row:
                raise UserError(f"{where}: no column {resp!r} (has {sorted(row)}); fix `response_column`")
            if row[resp] is not None:
                turns.append({"role": "assistant", "content": _text(row[resp])})
    own = row.get("system")  # the row's own system prompt comes before the dataset's
    system = own if isinstance(own, str) and own.strip() else spec.get("system_prompt")
    if system and not any(t["role"] == "system" for t in turns):
        turns = [{"role": "system", "content": system}] + turns
    return turns


#: chat formats of a ``messages_column`` (``format`` in a dataset's spec; ``auto``: decided per row)
CHAT_FORMATS = ("auto", "openai", "sharegpt")

#: ShareGPT speakers (``from``) and the chat-template role each becomes; ``gpt`` variants seen in public corpora
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "assistant": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant"}


def _chat_format(turns, fmt: str) -> str | None:
    """The format ``turns`` are in (``openai`` / ``sharegpt``), or None when they fit neither (or not ``fmt``)."""
    if not isinstance(turns, (list, tuple)) or not all(isinstance(t, dict) for t in turns):
        return None
    # a key counts when it holds a value: arrow gives rows of a file every key any row has, as None
    fits = {"openai": all(t.get("role") is not None and "content" in t for t in turns),
            "sharegpt": all(t.get("from") is not None and "value" in t for t in turns)}
    if fmt != "auto":
        return fmt if fits[fmt] else None
    return next((f for f in ("openai", "sharegpt") if fits[f]), None)


def _chat_turns(turns, fmt: str, col: str, where: str) -> list[dict]:
    """A chat column's turns as ``{role, content}`` (ShareGPT speakers mapped by :data:`SHAREGPT_ROLES`)."""
    if fmt not in CHAT_FORMATS:  # the schema refuses it first; this guards direct callers
        raise UserError(f"{where}: format {fmt!r} is not one of {', '.join(CHAT_FORMATS)}")
    if hasattr(turns, "tolist"):  # a parquet list column arrives as a numpy array
        turns = turns.tolist()
    found = _chat_format(turns, fmt)
    if found is None:
        wanted = {"openai": "{role, content}", "sharegpt": "{from, value}"}
        what = " or ".join(wanted.values()) if fmt == "auto" else wanted[fmt]
        first = next((t for t in turns if _chat_format([t], fmt) is None), None) if isinstance(turns, (list, tuple)) else turns
        shown = sorted(k for k, v in first.items() if v is not None) if isinstance(first, dict) else (
            "turns of both formats" if first is None else type(first).__name__)
        raise UserError(f"{where}: column {col!r} must be a list of {what} turns (a turn has {shown}); "
                        "set the dataset's `format` (auto, openai, sharegpt) or `messages_column`")
    if found == "openai":
        return [{"role": str(t["role"]), "content": _text(t["content"])} for t in turns]
    out = []
    for t in turns:
        speaker = str(t["from"]).strip().lower()
        if speaker not in SHAREGPT_ROLES:
            raise UserError(f"{where}: column {col!r}: ShareGPT speaker {t['from']!r} is not one of "
                            f"{', '.join(sorted(SHAREGPT_ROLES))}")
        out.append({"role": SHAREGPT_ROLES[speaker], "content": _text(t["value"])})
    return out


def split_prompt(turns: list[dict]) -> tuple[list[dict], str | None]:
    """Split a chat into (prompt up to the last user turn, last assistant reply or None)."""
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        raise SkippedRow("no_user_turn")
    tail = turns[last_user + 1 :]
    reference = next((t["content"] for t in tail if t["role"] == "assistant"), None)
    return turns[: last_user + 1], reference


def normalize(table, spec: dict, name: str) -> tuple[pd.DataFrame, dict]:
    """Turn raw rows into the normal form (id, prompt, reference); also the rows skipped, by reason
    (:data:`SKIPPED_ROWS`; ``first``: the first skipped row's index). ``limit`` counts kept rows."""
    source = spec.get("path") or spec.get("hf")
    id_col = spec.get("id_column")
    limit = spec.get("limit")
    rows, skipped, first = [], dict.fromkeys(SKIPPED_ROWS, 0), None
    for i, row in enumerate(table):
        if limit is not None and len(rows) >= limit:
            break
        where = f"{source} row {i} (dataset {name})"
        try:
            prompt, reference = split_prompt(_turns_from_row(row, spec, where))
        except SkippedRow as why:
            skipped[str(why)] += 1
            first = i if first is None else first
            continue
        if id_col and id_col not in row:
            raise UserError(f"{where}: no id column {id_col!r}; fix `id_column` or remove it")
        rid = str(row[id_col]) if id_col else (str(row["id"]) if "id" in row and row["id"] is not None else f"{name}-{i}")
        rows.append({"id": rid, "prompt": prompt, "reference": reference})
    df = pd.DataFrame(rows, columns=["id", "prompt", "reference"])
    counts = {k: v for k, v in skipped.items() if v}
    if df.empty:
        raise UserError(f"{source} (dataset {name}): no row holds a conversation with a user turn (skipped: {counts}); "
                        "point `messages_column` or `prompt_column` at the prompts")
    if df["id"].duplicated().any():
        dup = df.loc[df["id"].duplicated(), "id"].iloc[0]
        raise UserError(f"{source} (dataset {name}): id {dup!r} occurs twice; ids must be unique (set `id_column`)")
    return df, {"skipped_rows": skipped, "skipped_total": sum(skipped.values()), "first_skipped_row": first}


def prepare_prompts(spec: dict, name: str, out_path: str, repo_root: str = ".", stats_path: str | None = None,
                    log=lambda line: None) -> pd.DataFrame:
    """Load, normalise and write one dataset's prompts as parquet (atomically); with ``stats_path``, their
    counts (prompts, references, rows skipped by reason) as JSON beside them; one log line says them."""
    from dflashpipe.jobs.atomic import atomic_path, write_json

    df, skipped = normalize(load_table(spec, name, repo_root), spec, name)
    stats = {"prompts": len(df), "with_reference": int(df["reference"].notna().sum()), **skipped}
    with atomic_path(out_path) as tmp:
        df.to_parquet(tmp, index=False)
    if stats_path:
        write_json(stats_path, stats)
    counts = ", ".join(f"{n} {why}" for why, n in skipped["skipped_rows"].items() if n)
    log(f"{stats['prompts']} prompts ({stats['with_reference']} with a reference reply)"
        + (f"; skipped {skipped['skipped_total']} rows without a prompt ({counts}; the first: row "
           f"{skipped['first_skipped_row']})" if counts else ""))
    return df


def read_parquet(path: str) -> pd.DataFrame:
    """A stage's parquet output, or one line naming it when it is truncated or corrupt."""
    try:
        return pd.read_parquet(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise UserError(
            f"{path}: cannot read ({first}); the file is truncated or corrupt: delete it and rerun, "
            "snakemake makes it again"
        ) from None


def read_prompts(path: str) -> pd.DataFrame:
    df = read_parquet(path)
    df["prompt"] = df["prompt"].map(lambda turns: [dict(t) for t in turns])
    return df


#: Why a prompt is not used (counted in the expansion/tokenize and evaluation summaries).
SKIP_EMPTY, SKIP_TOO_LONG = "skipped_empty_prompt", "skipped_prompt_too_long"


def screen_prompt(turns: list[dict], n_tokens: int, context: int | None, reserve: int) -> str | None:
    """Why a prompt cannot be decoded (:data:`SKIP_EMPTY`, :data:`SKIP_TOO_LONG`), or None.

    ``n_tokens``: the prompt's length under the target's chat template;
    ``reserve``: tokens that must fit after it (new tokens, a verify block);
    ``context``: the target's ``max_position_embeddings`` (None: no limit).
    """
    if not str(turns[-1].get("content", "")).strip():
        return SKIP_EMPTY
    if context and n_tokens + reserve > context:
        return SKIP_TOO_LONG
    return None


def target_context(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)
