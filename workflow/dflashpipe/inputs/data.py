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
    category    str    the row's top-level ``category`` field (MT-Bench's 8), only where some row has one


The target later regenerates the reply to ``prompt`` ("dataset expansion"). A turn's content may be a
list of content parts (their text parts, joined by newlines); a null content is empty text in an
assistant turn (one that only calls tools, or one the target fills in: between MT-Bench's two turns). A row that gives no prompt (a line that is not JSON, a
missing column, an unknown role, a null or non-text content, no turns, no user turn, a repeated id:
:data:`BAD_ROWS`) is skipped and counted by reason, with the first few located as ``file:line``
(1-based) and the row's id, in the prompts stage's stats file and log; past ``data.max_bad_rows``
the stage stops with one line listing every reason's count. A row's top-level ``system`` field (the
LLaMA-Factory ShareGPT layout) is its system turn.
"""

from __future__ import annotations

import difflib
import gzip
import json
import os
import re
from pathlib import Path

import pandas as pd

from dflashpipe.jobs.errors import UserError, damaged_output

LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")

#: why a row gives no prompt: it is skipped and counted by reason (results/prompts/<name>.stats.json, the
#: prompts job's log and ``python -m dflashpipe.config``); past ``data.max_bad_rows`` the job stops
BAD_ROWS = ("malformed_json", "truncated_line", "not_an_object", "missing_column", "not_a_chat", "unknown_role",
            "null_content", "non_text_content", "empty_conversation", "no_user_turn", "duplicate_id")
#: a row's group within its set (MT-Bench's 8 categories): carried into the prompts table where present, and
#: the evaluation reports per category
CATEGORY = "category"
#: the bad rows a stats file and a log line locate (the first met, in file order)
FIRST_BAD = 5
#: the roles an OpenAI-format turn may have
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class SkippedRow(Exception):
    """A row that gives no prompt: ``reason`` is one of :data:`BAD_ROWS`, ``detail`` what was found."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _json_error(err: json.JSONDecodeError) -> str:
    return f"not JSON at column {err.colno}: {re.sub(r'( starting)? at$', '', err.msg)}"


def _jsonl_rows(path: Path) -> list[tuple[str, dict | SkippedRow]]:
    """``(location, row)`` per non-blank line of a (gzipped) JSON-lines file, the location ``file:line``
    (1-based, as an editor numbers it); a line that is not a JSON object gives a :class:`SkippedRow`."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:  # a last line cut short: the file was truncated
                    reason = "malformed_json" if line.endswith("\n") else "truncated_line"
                    rows.append((where, SkippedRow(reason, _json_error(err))))
                    continue
                rows.append((where, row if isinstance(row, dict) else
                             SkippedRow("not_an_object", f"a JSON {type(row).__name__}, not an object")))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read ({err}); is it a (gzipped) UTF-8 JSON-lines file?") from None
    return rows


def load_rows(spec: dict, name: str, repo_root: str | os.PathLike = ".") -> list[tuple[str, dict | SkippedRow]]:
    """The raw rows of one configured dataset, each with its location: ``file:line`` in a JSON-lines file,
    ``file row N`` (1-based) in a parquet or JSON file or a Hugging Face dataset."""
    where = f"datasets.{name}"
    if spec.get("path"):
        path = Path(repo_root, spec["path"])
        if not path.exists():
            raise UserError(f"{where}.path: file {path} does not exist; fix the path in the config")
        name_lower = path.name.lower()
        if not name_lower.endswith(LOCAL_SUFFIXES):
            raise UserError(f"{where}.path: {path} has an unsupported extension; use one of {', '.join(LOCAL_SUFFIXES)}")
        if ".jsonl" in name_lower:
            rows = _jsonl_rows(path)
        else:
            rows = _table_rows(_load_dataset("parquet" if name_lower.endswith(".parquet") else "json", str(path),
                                             f"{where}.path: cannot load {path}"), str(path))
    elif spec.get("hf"):
        label = f"{spec['hf']}[{spec.get('split', 'train')}]"
        rows = _table_rows(_load_dataset(spec["hf"], None, f"{where}.hf: cannot load Hugging Face dataset {spec['hf']!r} "
                                         f"(split {spec.get('split', 'train')!r})", spec), label)
    else:
        raise UserError(f"{where}: give either `path` (a local jsonl/parquet file) or `hf` (a dataset name)")
    if not rows:
        raise UserError(f"{spec.get('path') or spec.get('hf')}: the dataset has no rows; point {where} at a non-empty one")
    return rows


def _load_dataset(builder: str, data_files: str | None, what: str, spec: dict | None = None):
    import datasets

    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own line for a broken file: ours says it
    try:
        if spec is None:
            return datasets.load_dataset(builder, data_files=data_files, split="train")
        return datasets.load_dataset(builder, spec.get("hf_config"), split=spec.get("split", "train"))
    except Exception as err:  # pyarrow / datasets raise many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hub = (". Without hub access, download it first or point `path` at a local jsonl/parquet file"
               if spec is not None else "")
        raise UserError(f"{what}: {first}{hub}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _table_rows(table, label: str) -> list[tuple[str, dict]]:
    return [(f"{label} row {i}", row) for i, row in enumerate(table, start=1)]


#: chat columns read when a dataset names neither ``messages_column`` nor ``prompt_column`` and has no ``prompt``
CHAT_COLUMNS = ("conversations", "messages")


def _text(content) -> str:
    """A turn's content as text: a list of content parts is its text parts joined by newlines (as vLLM
    joins them); any other part (an image, audio), or a value that is not text, leaves the row without
    a text prompt."""
    if hasattr(content, "tolist"):  # a parquet list column arrives as a numpy array
        content = content.tolist()
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise SkippedRow("non_text_content", f"a {type(content).__name__} where text belongs")
    texts = []
    for part in content:
        if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise SkippedRow("non_text_content", f"a content part of type {kind!r}")
    return "\n".join(texts)


def _turn(role: str, content) -> dict:
    """A ``{role, content}`` turn; a null content is empty text only in an assistant turn (one that only
    calls tools), a bad row anywhere else."""
    if content is None:
        if role != "assistant":
            raise SkippedRow("null_content", f"a {role} turn with a null content")
        return {"role": role, "content": ""}
    return {"role": role, "content": _text(content)}


def _missing_column(col: str, row: dict, key: str) -> SkippedRow:
    hint = difflib.get_close_matches(col, [str(k) for k in row], n=1)
    return SkippedRow("missing_column", f"no column {col!r} (has {sorted(map(str, row))}"
                      + (f"; did you mean {hint[0]!r}?" if hint else "") + f"); set `{key}`")


def _turns_from_row(row: dict, spec: dict) -> list[dict]:
    col = spec.get("messages_column")
    if not col and not spec.get("prompt_column") and "prompt" not in row:
        col = next((c for c in CHAT_COLUMNS if c in row), None)
        if col is None:
            raise _missing_column("conversations", row, "messages_column or prompt_column")
    if col:
        if col not in row:
            raise _missing_column(col, row, "messages_column")
        chat = row[col].tolist() if hasattr(row[col], "tolist") else row[col]
        if chat is None or chat == []:
            raise SkippedRow("empty_conversation", f"column {col!r} holds no turns")
        turns = _chat_turns(chat, spec.get("format") or "auto", col)
    else:
        col = spec.get("prompt_column") or "prompt"
        if col not in row:
            raise _missing_column(col, row, "prompt_column")
        turns = [_turn("user", row[col])]
        resp = spec.get("response_column")
        if resp:
            if resp not in row:
                raise _missing_column(resp, row, "response_column")
            if row[resp] is not None:
                turns.append(_turn("assistant", row[resp]))
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
    """The format ``turns`` are in (``openai`` / ``sharegpt``), or None when they fit neither (or not ``fmt``).
    A turn's content may be absent (an OpenAI tool call): :func:`_turn` decides what a null content means."""
    if not isinstance(turns, (list, tuple)) or not all(isinstance(t, dict) for t in turns):
        return None
    # a key counts when it holds a value: arrow gives rows of a file every key any row has, as None
    fits = {"openai": all(t.get("role") is not None for t in turns),
            "sharegpt": all(t.get("from") is not None for t in turns)}
    if fmt != "auto":
        return fmt if fits[fmt] else None
    return next((f for f in ("openai", "sharegpt") if fits[f]), None)


def _chat_turns(turns, fmt: str, col: str) -> list[dict]:
    """A chat column's turns as ``{role, content}`` (ShareGPT speakers mapped by :data:`SHAREGPT_ROLES`)."""
    if fmt not in CHAT_FORMATS:  # the schema refuses it first; this guards direct callers
        raise UserError(f"format {fmt!r} is not one of {', '.join(CHAT_FORMATS)}")
    if hasattr(turns, "tolist"):  # a parquet list column arrives as a numpy array
        turns = turns.tolist()
    found = _chat_format(turns, fmt)
    if found is None:
        wanted = {"openai": "{role, content}", "sharegpt": "{from, value}"}
        what = " or ".join(wanted.values()) if fmt == "auto" else wanted[fmt]
        first = next((t for t in turns if _chat_format([t], fmt) is None), None) if isinstance(turns, (list, tuple)) else turns
        shown = sorted(k for k, v in first.items() if v is not None) if isinstance(first, dict) else (
            "turns of both formats" if first is None else type(first).__name__)
        raise SkippedRow("not_a_chat", f"column {col!r} must be a list of {what} turns (a turn has {shown}); "
                         "set the dataset's `format` (auto, openai, sharegpt) or `messages_column`")
    out = []
    for t in turns:
        if found == "openai":
            role = str(t["role"])
            if role not in OPENAI_ROLES:
                raise SkippedRow("unknown_role", f"role {role!r} is not one of {', '.join(OPENAI_ROLES)}")
            out.append(_turn(role, t.get("content")))
            continue
        speaker = str(t["from"]).strip().lower()
        if speaker not in SHAREGPT_ROLES:
            raise SkippedRow("unknown_role", f"ShareGPT speaker {t['from']!r} is not one of "
                             f"{', '.join(sorted(SHAREGPT_ROLES))}")
        out.append(_turn(SHAREGPT_ROLES[speaker], t.get("value")))
    return out


def split_prompt(turns: list[dict]) -> tuple[list[dict], str | None]:
    """Split a chat into (prompt up to the last user turn, last assistant reply or None)."""
    last_user = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last_user is None:
        raise SkippedRow("no_user_turn", f"turns {[t['role'] for t in turns]}")
    tail = turns[last_user + 1 :]
    reference = next((t["content"] for t in tail if t["role"] == "assistant"), None)
    return turns[: last_user + 1], reference


def _row_id(row, spec: dict) -> str | None:
    """The row's own id (``id_column``, else an ``id`` column), or None."""
    if not isinstance(row, dict):
        return None
    value = row.get(spec.get("id_column") or "id")
    return None if value is None else str(value)


def bad_row_limit(max_bad_rows: float, rows: int) -> int:
    """The bad rows ``data.max_bad_rows`` allows among ``rows``: below 1 a share of them, from 1 a number."""
    return int(max_bad_rows * rows) if max_bad_rows < 1 else int(max_bad_rows)


def describe_bad(first: dict) -> str:
    """One bad row, located: ``file:38 (id 'a7'): malformed_json: not JSON at column 81: ...``."""
    rid = f" (id {first['id']!r})" if first.get("id") is not None else ""
    return f"{first['where']}{rid}: {first['reason']}" + (f": {first['detail']}" if first.get("detail") else "")


def normalize(rows: list[tuple[str, dict | SkippedRow]], spec: dict, name: str,
              max_bad_rows: float | None = None) -> tuple[pd.DataFrame, dict]:
    """Turn located raw rows (:func:`load_rows`) into the normal form (id, prompt, reference), and their
    counts: rows read, user turns, bad rows by reason (:data:`BAD_ROWS`) with the first few located.
    ``limit`` counts kept rows. More bad rows than ``max_bad_rows`` allows (:func:`bad_row_limit`; None:
    any number) is one line listing every reason's count."""
    source = spec.get("path") or spec.get("hf")
    id_col, limit = spec.get("id_column"), spec.get("limit")
    kept, bad, first, seen, read, user_turns = [], dict.fromkeys(BAD_ROWS, 0), [], set(), 0, 0
    for i, (where, row) in enumerate(rows):
        if limit is not None and len(kept) >= limit:
            break
        read += 1
        try:
            if isinstance(row, SkippedRow):
                raise row
            turns = _turns_from_row(row, spec)
            prompt, reference = split_prompt(turns)
            if id_col and id_col not in row:
                raise _missing_column(id_col, row, "id_column")
            rid = _row_id(row, spec) or f"{name}-{i}"
            if rid in seen:
                raise SkippedRow("duplicate_id", f"id {rid!r} occurs earlier; ids must be unique (set `id_column`)")
        except SkippedRow as why:
            bad[why.reason] += 1
            if len(first) < FIRST_BAD:
                first.append({"where": where, "id": _row_id(row, spec), "reason": why.reason, "detail": why.detail})
            continue
        seen.add(rid)
        user_turns += sum(t["role"] == "user" for t in prompt)
        category = row.get(CATEGORY) if isinstance(row, dict) else None
        if isinstance(category, float) and category != category:  # a table's missing value (NaN)
            category = None
        kept.append({"id": rid, "prompt": prompt, "reference": reference,
                     CATEGORY: None if category is None else str(category)})
    columns = ["id", "prompt", "reference"]
    if any(r[CATEGORY] is not None for r in kept):  # a set without categories keeps the table it had
        columns.append(CATEGORY)
    df = pd.DataFrame(kept, columns=columns)
    total = sum(bad.values())
    counts = ", ".join(f"{why} {n}" for why, n in bad.items() if n)
    stats = {"rows_read": read, "prompts": len(df), "user_turns": user_turns,
             "with_reference": int(df["reference"].notna().sum()), "skipped_rows": bad, "skipped_total": total,
             "first_skipped": first}
    if df.empty:
        raise UserError(f"{source} (dataset {name}): none of its {read} rows gives a prompt ({counts}; the first: "
                        f"{describe_bad(first[0])})")
    if max_bad_rows is not None and total > bad_row_limit(max_bad_rows, read):
        allowed = f"{max_bad_rows:.0%} of {read}" if max_bad_rows < 1 else f"{int(max_bad_rows)}"
        raise UserError(f"{source} (dataset {name}): {total} of {read} rows are bad ({counts}), more than "
                        f"data.max_bad_rows allows ({allowed}); the first: {describe_bad(first[0])}; fix those rows "
                        "or raise data.max_bad_rows")
    return df, stats


def summary_line(stats: dict) -> str:
    """The prompts job's log line (and the config checker's) for one dataset's counts."""
    line = (f"{stats['prompts']} prompts of {stats['rows_read']} rows ({stats['user_turns']} user turns; "
            f"prompts with a reference reply: {stats['with_reference']})")
    if stats["skipped_total"]:
        counts = ", ".join(f"{why} {n}" for why, n in stats["skipped_rows"].items() if n)
        line += f"; skipped {stats['skipped_total']} bad rows ({counts}; the first: {describe_bad(stats['first_skipped'][0])})"
    return line


def prepare_prompts(spec: dict, name: str, out_path: str, repo_root: str = ".", stats_path: str | None = None,
                    log=lambda line: None, max_bad_rows: float | None = None) -> pd.DataFrame:
    """Load, normalise and write one dataset's prompts as parquet (atomically); with ``stats_path``, their
    counts (:func:`normalize`) as JSON beside them; one log line says them."""
    from dflashpipe.jobs.atomic import atomic_path, write_json

    df, stats = normalize(load_rows(spec, name, repo_root), spec, name, max_bad_rows)
    with atomic_path(out_path) as tmp:
        df.to_parquet(tmp, index=False)
    if stats_path:
        write_json(stats_path, stats)
    log(summary_line(stats))
    return df


def read_parquet(path: str) -> pd.DataFrame:
    """A stage's parquet output, or one line naming it when it is truncated or corrupt."""
    try:
        return pd.read_parquet(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise damaged_output(path, err) from None


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
