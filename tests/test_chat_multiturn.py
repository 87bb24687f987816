"""The multi-turn chat lever's data (resources/prompts/chat_multiturn_train.jsonl.gz, issue 68): whole ShareGPT
conversations whose every assistant turn the target writes. Read from the shipped file as the workflow reads it,
answered by the expansion's turn-by-turn loop with a stand-in backend (no model, no Snakemake run)."""

import gzip
import json

import pytest
import yaml

from conftest import PROMPTS, REPO
from dflashpipe.config import SCHEMA_PATH, _merge, user_datasets, validate_config
from dflashpipe.inputs.data import load_rows, normalize
from dflashpipe.inputs.turns import turn_plan
from dflashpipe.stages.expand import ExpandSettings, turn_by_turn

SPEC = {"path": str(PROMPTS / "chat_multiturn_train.jsonl.gz"), "messages_column": "messages"}


def _rows(name):
    with gzip.open(PROMPTS / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _users(row):
    return [t["content"] for t in row["messages"] if t["role"] == "user"]


@pytest.fixture(scope="module")
def rows():
    return _rows("chat_multiturn_train")


def test_rows_are_user_null_user_chats_of_two_to_four_turns(rows):
    """MT-Bench's spelling of a turn the target fills in (an assistant turn with ``"content": null``) between
    user turns that pass chat_train's filter; about as many user turns (replies to train) as chat_train's 6,000."""
    assert len(rows) == 2100 and len({r["id"] for r in rows}) == len(rows)
    mt_bench = _rows("mt_bench")[0]["messages"][1]
    for row in rows:
        assert row["source"] == "sharegpt" and row["id"].startswith("sharegpt-") and row["id"].endswith("_0")
        messages = row["messages"]
        assert [t["role"] for t in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"], row["id"]
        assert all(t == mt_bench for t in messages[1::2]), row["id"]
        assert all(16 <= len(u) <= 1000 and u.isascii() and u == u.strip() for u in _users(row)), row["id"]
    turns = sorted({len(_users(r)) for r in rows})
    assert turns == [2, 3, 4] and sum(len(_users(r)) for r in rows) == 5935


def test_no_conversation_of_the_chat_evaluation_sets(rows):
    heldout, mt_bench = _rows("chat_heldout"), _rows("mt_bench")
    assert not {r["id"] for r in rows} & {r["id"] for r in heldout}
    evaluated = {u for r in heldout + mt_bench for u in _users(r)}
    assert not {u for r in rows for u in _users(r)} & evaluated


def test_the_expansion_answers_every_user_turn(rows):
    """The workflow's reader takes every row; the turn plan answers each user turn and the turn-by-turn loop
    (a stand-in backend that answers "reply to turn k") fills every null assistant turn with the target's reply."""
    df, stats = normalize(load_rows(SPEC, "chat_multiturn", REPO), SPEC, "chat_multiturn", 0)
    assert stats["skipped_total"] == 0 and len(df) == len(rows) and stats["user_turns"] == 5935
    for prompt, row in zip(df["prompt"], rows):
        points, n_users, why = turn_plan(prompt, "all")
        assert why is None and n_users == len(points) == len(_users(row))
        assert [prompt[i]["content"] for i in points] == _users(row)

    def generate(batch, chunk_seed, progress, num_samples=None):
        records = []
        for rid, prompt in zip(batch["id"], batch["prompt"]):
            k = sum(t["role"] == "user" for t in prompt)
            reply = f"reply to turn {k}"
            records.append({"id": rid, "sample": 0, "messages": [dict(t) for t in prompt] + [
                {"role": "assistant", "content": reply}], "response": reply, "num_prompt_tokens": 1,
                "num_new_tokens": 1, "finish_reason": "stop", "token_ids": [k]})
        return records, len(records)

    settings = ExpandSettings(max_new_tokens=8, batch_size=64, chunk_size=512, temperature=0.0)
    records, new_tokens = turn_by_turn(generate, settings)(df, 0, lambda prompts, tokens: None)
    assert new_tokens == 5935 and [r["id"] for r in records] == list(df["id"])
    for record, row in zip(records, rows):
        n = len(_users(row))
        assert record["unanswered"] is None and record["user_turns"] == len(record["turns"]) == n
        messages = record["messages"]
        assert [t["content"] for t in messages if t["role"] == "user"] == _users(row)
        assert [t["content"] for t in messages if t["role"] == "assistant"] == [f"reply to turn {k}" for k in range(1, n + 1)]


def test_the_overlay_swaps_chat_and_keeps_smollm2s_other_datasets():
    """A datasets section replaces the earlier files' whole, so the overlay repeats config/smollm2.yaml's: the
    two stay in step, chat_train swapped for the multi-turn file, everything else as the run without the lever."""
    base = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())
    lever = yaml.safe_load((REPO / "config" / "smollm2_chat_multiturn.yaml").read_text())
    assert set(lever) == {"datasets", "tokenize"} and lever["tokenize"] == {"buckets": [*base["tokenize"]["buckets"], 2048]}
    expected = {k: v for k, v in base["datasets"].items() if k != "chat"}
    expected["chat_multiturn"] = {**base["datasets"]["chat"], "path": "resources/prompts/chat_multiturn_train.jsonl.gz"}
    assert lever["datasets"] == expected
    assert list(lever["datasets"]) == [("chat_multiturn" if k == "chat" else k) for k in base["datasets"]]
    # merged as the workflow merges them (the last datasets section whole, the rest key by key): a valid config
    files = [REPO / "config" / "smollm2.yaml", REPO / "config" / "smollm2_chat_multiturn.yaml"]
    merged = _merge(_merge(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), base), lever)
    merged["datasets"] = user_datasets(files)
    merged = validate_config(merged, str(SCHEMA_PATH), "smollm2 + chat_multiturn")
    assert "chat" not in merged["datasets"] and merged["tokenize"]["buckets"] == [256, 512, 1024, 2048]
    assert merged["train"]["repeat"] == {"code": 3, "code_more": 3} and merged["train"]["max_steps"] == 3000


def test_arena_hard_is_an_eval_set_of_untrained_prompts_whose_categories_take_turns():
    """resources/prompts/arena_hard.jsonl.gz (Arena-Hard v2.0's prompts): single user turns passing chat_train's
    filter, none a turn of a chat training file or of the other chat evaluation sets; its first rows hold all
    three categories (an evaluation reads the first num_prompts); an eval set of config/smollm2.yaml."""
    rows = _rows("arena_hard")
    assert len(rows) == 344 and len({r["id"] for r in rows}) == 344
    cats = [r["category"] for r in rows]
    assert {c: cats.count(c) for c in set(cats)} == {"coding": 144, "creative_writing": 104, "math": 96}
    assert set(cats[:3]) == set(cats) and set(cats[:30]) == set(cats)
    others = {u for name in ("chat_train", "chat_multiturn_train", "chat_heldout", "mt_bench") for r in _rows(name)
              for u in _users(r)}
    for r in rows:
        (user,) = _users(r)
        assert len(r["messages"]) == 1 and r["source"] == "arena_hard" and r["id"].startswith("arena_hard-")
        assert 16 <= len(user) <= 1000 and user.isascii() and user not in others
    base = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())
    assert base["datasets"]["arena_hard"] == {"path": "resources/prompts/arena_hard.jsonl.gz",
                                              "messages_column": "messages", "use": "eval"}


def test_the_chat_levers_overlay_sets_runs_that_differ_from_smollm2_in_one_lever_each():
    """config/smollm2_chat_levers.yaml: a run without any lever (config/smollm2.yaml's keys as they are), one
    that draws chat twice an epoch (code still three times) and one that trains twice the steps, with an epoch
    cap that lets it; merged as the workflow merges them, a valid config."""
    from dflashpipe.config import run_config

    base = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())
    levers = yaml.safe_load((REPO / "config" / "smollm2_chat_levers.yaml").read_text())
    assert set(levers) == {"runs"} and set(levers["runs"]) == {"without", "chat_x2", "steps_x2"}
    merged = _merge(_merge(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), base), levers)
    merged["datasets"] = user_datasets([REPO / "config" / "smollm2.yaml"])
    merged = validate_config(merged, str(SCHEMA_PATH), "smollm2 + chat_levers")
    without, chat_x2 = run_config(merged, "without"), run_config(merged, "chat_x2")
    assert without["train"]["repeat"] == base["train"]["repeat"] == {"code": 3, "code_more": 3}
    assert chat_x2["train"]["repeat"] == {**base["train"]["repeat"], "chat": 2}
    assert {k: v for k, v in chat_x2["train"].items() if k != "repeat"} == \
        {k: v for k, v in without["train"].items() if k != "repeat"}
    assert chat_x2["drafter"] == without["drafter"] and chat_x2["evaluate"] == without["evaluate"]
    steps_x2 = run_config(merged, "steps_x2")
    assert steps_x2["train"]["max_steps"] == 2 * without["train"]["max_steps"] == 6000
    # 6,000 steps of 16 are 3.1 epochs of the mix's 31,149 samples drawn (docs/real-target.md): a cap of 2 would end it first
    assert steps_x2["train"]["epochs"] * 31_149 >= 6000 * steps_x2["train"]["batch_size"]
    assert {k: v for k, v in steps_x2["train"].items() if k not in ("max_steps", "epochs")} == \
        {k: v for k, v in without["train"].items() if k not in ("max_steps", "epochs")}
    assert steps_x2["drafter"] == without["drafter"] and steps_x2["evaluate"] == without["evaluate"]
