import gzip
import json

import pandas as pd
import pytest

from dflashpipe.inputs.data import load_rows, normalize, prepare_prompts
from dflashpipe.jobs.errors import UserError


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


def test_a_rows_category_is_carried_and_a_set_without_one_keeps_its_table(tmp_path):
    """MT-Bench's layout: a category per row, two user turns with a null assistant turn between them (the
    target's reply goes there): the prompt keeps both turns, the table a ``category`` column; a set whose rows
    have no category gets the table it always had (the same bytes: nothing downstream reruns)."""
    two = [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": None},
           {"role": "user", "content": "Shorter."}]
    f = write_jsonl(tmp_path / "mt.jsonl", [{"id": "m1", "messages": two, "category": "writing"},
                                            {"id": "m2", "messages": chat("2+2?")}])
    df = prepare_prompts({"path": str(f), "messages_column": "messages"}, "mt", str(tmp_path / "mt.parquet"))
    assert df["prompt"][0] == [dict(two[0]), {"role": "assistant", "content": ""}, dict(two[2])]
    assert df["category"][0] == "writing" and pd.isna(df["category"][1]) and pd.isna(df["reference"][0])
    assert pd.read_parquet(tmp_path / "mt.parquet")["category"].fillna("-").tolist() == ["writing", "-"]
    plain = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "messages": chat("1+1?", "2")}])
    assert list(prepare_prompts({"path": str(plain), "messages_column": "messages"}, "d", str(tmp_path / "d.parquet")).columns) \
        == ["id", "prompt", "reference"]


def test_prompt_column_mapping_parquet(tmp_path):
    f = tmp_path / "d.parquet"
    pd.DataFrame({"question": ["q1", "q2"], "answer": ["a1", "a2"]}).to_parquet(f)
    spec = {"path": str(f), "prompt_column": "question", "response_column": "answer", "system_prompt": "be brief"}
    df, _ = normalize(load_rows(spec, "d"), spec, "d")
    assert df["prompt"][1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"}]
    assert df["reference"][1] == "a2"
    assert df["id"][0] == "d-0"


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"^datasets.d.path: file .*nope.jsonl does not exist"):
        load_rows({"path": str(tmp_path / "nope.jsonl")}, "d")


def test_malformed_line_is_counted_and_located_by_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl.gz"
    with gzip.open(f, "wt") as g:
        g.write(json.dumps({"messages": chat("x", "y")}) + "\n")
        g.write("\n")
        g.write('{"messages": [oops]}\n')
    df, stats = normalize(load_rows({"path": str(f)}, "d"), {"path": str(f)}, "d")
    assert len(df) == 1 and stats["skipped_rows"]["malformed_json"] == 1
    assert stats["first_skipped"] == [{"where": f"{f}:3", "id": None, "reason": "malformed_json",
                                       "detail": "not JSON at column 15: Expecting value"}]
    with pytest.raises(UserError, match=rf"^{f} \(dataset d\): 1 of 2 rows are bad \(malformed_json 1\), more than "
                                        rf"data.max_bad_rows allows \(0% of 2\); the first: {f}:3: malformed_json"):
        normalize(load_rows({"path": str(f)}, "d"), {"path": str(f)}, "d", max_bad_rows=0.0)


def test_a_corrupt_parquet_is_one_line(tmp_path, capfd):
    """`datasets` logged its own "Failed to read schema ..." line before ours: two lines for one fault."""
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"PAR1" + bytes(range(200)))
    with pytest.raises(UserError, match=rf"^datasets.d.path: cannot load {f}: .*Parquet magic bytes not found"):
        load_rows({"path": str(f)}, "d")
    assert capfd.readouterr().err == ""


def test_empty_file(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    with pytest.raises(UserError, match="has no rows"):
        load_rows({"path": str(f)}, "d")


def test_rows_without_a_prompt_are_skipped_and_counted_in_the_stats_and_log(tmp_path):
    """Real ShareGPT dumps hold `conversations: []` and gpt-only rows; an image part has no text prompt."""
    rows = [{"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
            {"id": "b", "conversations": []},
            {"id": "c", "conversations": [{"from": "gpt", "value": "hello, how can I help?"}]},
            {"id": "d", "conversations": [{"from": "human", "value": "q2"}]},
            {"id": "e", "conversations": [{"from": "system", "value": "be brief"}]}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    logged = []
    df = prepare_prompts({"path": str(f), "limit": 2}, "d", str(tmp_path / "d.parquet"), stats_path=str(tmp_path / "s.json"),
                         log=logged.append)
    assert list(df["id"]) == ["a", "d"]  # `limit` counts the rows kept
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["prompts"] == 2 and stats["rows_read"] == 4 and stats["skipped_total"] == 2
    assert {k: n for k, n in stats["skipped_rows"].items() if n} == {"empty_conversation": 1, "no_user_turn": 1}
    assert [(b["where"], b["id"]) for b in stats["first_skipped"]] == [(f"{f}:2", "b"), (f"{f}:3", "c")]
    assert logged == [f"2 prompts of 4 rows (2 user turns; prompts with a reference reply: 1); skipped 2 bad rows "
                      f"(empty_conversation 1, no_user_turn 1; the first: {f}:2 (id 'b'): empty_conversation: "
                      "column 'conversations' holds no turns)"]
    picture = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                            {"type": "image_url", "image_url": {"url": "x.png"}}]}]
    f = write_jsonl(tmp_path / "p.jsonl", [{"messages": picture}, *[{"messages": r["conversations"]} for r in rows[:1]]])
    df, skipped = normalize(load_rows({"path": str(f)}, "p"), {"path": str(f)}, "p")
    assert len(df) == 1 and skipped["skipped_rows"]["non_text_content"] == 1
    f = write_jsonl(tmp_path / "none.jsonl", rows[1:3])
    with pytest.raises(UserError, match=r"none.jsonl \(dataset n\): none of its 2 rows gives a prompt"):
        normalize(load_rows({"path": str(f)}, "n"), {"path": str(f)}, "n")


def test_openai_turns_with_null_content_or_content_parts_become_their_text(tmp_path):
    tool_call = {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]}
    parts = {"role": "user", "content": [{"type": "text", "text": "Now add 3."}, {"type": "text", "text": "Briefly."}]}
    turns = [{"role": "user", "content": "Add 2."}, tool_call, {"role": "tool", "content": "2"}, parts]
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": turns}])
    df, _ = normalize(load_rows({"path": str(f)}, "d"), {"path": str(f)}, "d")
    assert [t["content"] for t in df["prompt"][0]] == ["Add 2.", "", "2", "Now add 3.\nBriefly."]
    f = tmp_path / "d.parquet"  # arrow: a null content beside text ones, and a tool call's keys on every turn
    pd.DataFrame({"messages": [turns[:3] + [{"role": "user", "content": "Now add 3."}]]}).to_parquet(f)
    df, _ = normalize(load_rows({"path": str(f)}, "d"), {"path": str(f)}, "d")
    assert [t["content"] for t in df["prompt"][0]] == ["Add 2.", "", "2", "Now add 3."]
    f = tmp_path / "q.parquet"
    pd.DataFrame({"question": ["q1", None], "answer": [None, "a2"]}).to_parquet(f)
    spec = {"path": str(f), "prompt_column": "question", "response_column": "answer"}
    df, stats = normalize(load_rows(spec, "d"), spec, "d")
    assert stats["skipped_rows"]["null_content"] == 1 and stats["first_skipped"][0]["where"] == f"{f} row 2"
    assert len(df) == 1 and pd.isna(df["reference"][0])


def test_a_sharegpt_rows_top_level_system_field_is_its_system_turn(tmp_path):
    """The LLaMA-Factory / glaive layout; it comes before the dataset's system_prompt, never beside a system turn."""
    rows = [{"system": "You are a calculator.", "conversations": [{"from": "human", "value": "2+2"}, {"from": "gpt", "value": "4"}]},
            {"system": "", "conversations": [{"from": "human", "value": "hi"}]},
            {"system": "unused", "conversations": [{"from": "system", "value": "own"}, {"from": "human", "value": "hi"}]}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = {"path": str(f), "system_prompt": "the default"}
    df, _ = normalize(load_rows(spec, "d"), spec, "d")
    assert df["prompt"][0] == [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "2+2"}]
    assert df["prompt"][1][0] == {"role": "system", "content": "the default"}
    assert df["prompt"][2][0] == {"role": "system", "content": "own"} and len(df["prompt"][2]) == 2


def test_wrong_column_is_named_with_a_guess(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"questions": "q"}])
    spec = {"path": str(f), "prompt_column": "question"}
    with pytest.raises(UserError, match=r"d.jsonl:1: missing_column: no column 'question' \(has \['questions'\]; "
                                        r"did you mean 'questions'\?\); set `prompt_column`\)$"):
        normalize(load_rows(spec, "d"), spec, "d")


def test_failed_prepare_leaves_no_output(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])
    out = tmp_path / "out.parquet"
    with pytest.raises(UserError):
        prepare_prompts({"path": str(f), "messages_column": "messages"}, "d", str(out))
    assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))


SHAREGPT = __import__("pathlib").Path(__file__).parent / "fixtures" / "sharegpt_small.jsonl"


def test_sharegpt_conversations_as_in_the_readme_example(tmp_path):
    """The README's `sharegpt` dataset (`messages_column: conversations`) on a ShareGPT file: from/value turns,
    human/gpt/system speakers, a tool call and its result, a turn with an extra null key."""
    spec = {"path": str(SHAREGPT), "messages_column": "conversations"}
    df = prepare_prompts(spec, "sharegpt", str(tmp_path / "out.parquet"))
    assert list(df["id"]) == ["sg-1", "sg-2", "sg-3", "sg-4"]
    assert df["prompt"][0] == [{"role": "user", "content": "What is 12 * 7?"}]
    assert df["reference"][0] == "12 * 7 = 84."
    assert [t["role"] for t in df["prompt"][1]] == ["system", "user", "assistant", "user"]
    assert df["prompt"][1][-1]["content"] == "And one above 20?" and df["reference"][1] == "23."
    assert [t["role"] for t in df["prompt"][2]] == ["user", "assistant", "tool", "user"]
    assert df["prompt"][2][2]["content"] == '{"metres": 3000}' and pd.isna(df["reference"][2])
    assert df["prompt"][3] == [{"role": "user", "content": "Write a haiku about rain."}]


def test_chat_format_detected_per_row_and_column(tmp_path):
    """No messages_column: a `conversations` column is found; ShareGPT and OpenAI rows may share a file."""
    rows = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
            {"conversations": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = {"path": str(f)}
    df, _ = normalize(load_rows(spec, "d"), spec, "d")
    assert df["prompt"][0] == [{"role": "user", "content": "hi"}] and df["reference"][0] == "hello"
    assert df["prompt"][1] == [{"role": "user", "content": "2+2?"}] and df["reference"][1] == "4"


def test_chat_that_fits_no_format_or_an_unknown_role_is_a_counted_bad_row(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"c": chat("q", "a")}, {"c": [{"speaker": "human", "text": "q"}]}])
    spec = {"path": str(f), "messages_column": "c"}
    df, stats = normalize(load_rows(spec, "d"), spec, "d")
    assert len(df) == 1 and stats["first_skipped"][0]["where"] == f"{f}:2"
    assert stats["first_skipped"][0]["detail"] == ("column 'c' must be a list of {role, content} or {from, value} "
                                                   "turns (a turn has ['speaker', 'text']); set the dataset's `format` "
                                                   "(auto, openai, sharegpt) or `messages_column`")
    spec = {"path": str(SHAREGPT), "messages_column": "conversations", "format": "openai"}  # the format set in the spec
    with pytest.raises(UserError, match=r"none of its 4 rows gives a prompt \(not_a_chat 4; the first: .*:1 \(id 'sg-1'\)"):
        normalize(load_rows(spec, "d"), spec, "d")
    bad = write_jsonl(tmp_path / "b.jsonl", [{"conversations": [{"from": "narrator", "value": "x"}]},
                                            {"conversations": [{"from": "human", "value": "q"}]}])
    spec = {"path": str(bad), "format": "sharegpt"}
    df, stats = normalize(load_rows(spec, "d"), spec, "d")
    assert stats["first_skipped"][0]["reason"] == "unknown_role" and "'narrator'" in stats["first_skipped"][0]["detail"]


def test_dataset_format_key_is_checked_by_the_config_schema():
    from dflashpipe.jobs.settings import load_schema

    props = load_schema()["properties"]["datasets"]["additionalProperties"]["properties"]
    assert props["format"]["enum"] == ["auto", "openai", "sharegpt"] and "default" not in props["format"]
