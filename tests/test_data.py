import gzip
import json

import pandas as pd
import pytest

from dflashpipe.data import load_table, normalize, prepare_prompts
from dflashpipe.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(q, a=None):
    turns = [{"role": "user", "content": q}]
    return turns + ([{"role": "assistant", "content": a}] if a else [])


def test_messages_rows_are_normalised(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": chat("1+1?", "2")}, {"id": "b", "messages": chat("2+2?")}])
    df = prepare_prompts({"path": str(f), "messages_column": "messages"}, "d", str(tmp_path / "out.parquet"))
    assert list(df["id"]) == ["a", "b"]
    assert df["prompt"][0] == [{"role": "user", "content": "1+1?"}]
    assert df["reference"][0] == "2" and pd.isna(df["reference"][1])
    assert pd.read_parquet(tmp_path / "out.parquet").shape[0] == 2


def test_prompt_column_mapping_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["q1", "q2"], "answer": ["a1", "a2"]}).to_parquet(f)
    spec = {"path": str(f), "prompt_column": "question", "response_column": "answer", "system_prompt": "be brief"}
    df = normalize(load_table(spec, "d"), spec, "d")
    assert df["prompt"][1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"}]
    assert df["reference"][1] == "a2"
    assert df["id"][0] == "d-0"


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"^datasets.d.path: file .*nope.jsonl does not exist"):
        load_table({"path": str(tmp_path / "nope.jsonl")}, "d")


def test_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps({"messages": chat("x", "y")}) + "\n")
        g.write("\n")
        g.write('{"messages": [oops]}\n')
    with pytest.raises(UserError, match=r"bad.jsonl.gz:3: malformed JSON line"):
        load_table({"path": str(f)}, "d")


def test_empty_file(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    with pytest.raises(UserError, match="has no rows"):
        load_table({"path": str(f)}, "d")


def test_row_without_user_turn(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": chat("q", "a")}, {"messages": [{"role": "assistant", "content": "hi"}]}])
    spec = {"path": str(f), "messages_column": "messages"}
    with pytest.raises(UserError, match=r"d.jsonl row 1 \(dataset d\): the conversation has no user turn"):
        normalize(load_table(spec, "d"), spec, "d")


def test_wrong_column_is_named(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "q"}])
    spec = {"path": str(f), "prompt_column": "question"}
    with pytest.raises(UserError, match=r"no column 'question' \(has \['text'\]\)"):
        normalize(load_table(spec, "d"), spec, "d")


def test_failed_prepare_leaves_no_output(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])
    out = tmp_path / "out.parquet"
    with pytest.raises(UserError):
        prepare_prompts({"path": str(f), "messages_column": "messages"}, "d", str(out))
    assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))
