"""Multi-turn chats regenerated turn by turn (``expand.turns``): every assistant turn is the target's, and each
is a loss segment of its own."""

import json

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from conftest import mini_config, snakemake, write_config
from dflashpipe.training.data import anchor_mask
from dflashpipe.drafter.masks import sample_anchors
from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.inputs.target import prompt_ids
from dflashpipe.inputs.tokenize import encode_chat
from dflashpipe.inputs.turns import turn_plan
from dflashpipe.stages.expand import ExpandSettings, expand_prompts

SETTINGS = dict(max_new_tokens=12, batch_size=1, chunk_size=8, temperature=0.0)


def _chat(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant", "t": "tool"}
    return [{"role": roles[r], "content": c} for r, c in turns]


ROWS = {
    "two": _chat(("u", "What is 2 + 3?"), ("a", "CORPUS 5"), ("u", "And times 4?"), ("a", "CORPUS 20")),
    "three": _chat(("s", "Be brief."), ("u", "Name a colour."), ("a", "CORPUS red"), ("u", "Another?"),
                   ("a", "CORPUS blue"), ("u", "One more, please.")),
    "single": _chat(("u", "Count to three."), ("a", "CORPUS 1 2 3")),
    "tool": _chat(("u", "Weather?"), ("a", "CORPUS calling"), ("t", "sunny"), ("u", "So?"), ("a", "CORPUS sunny")),
    # the second user turn leaves no room in the target's context: the chat is cut after the first reply
    "long": _chat(("u", "Hello."), ("a", "CORPUS hi"), ("u", " ".join(f"w{i}" for i in range(6000)))),
}
SEGMENTS = {"two": 2, "three": 3, "single": 1, "tool": 1, "long": 1}


def _segments(mask) -> int:
    mask = list(mask)
    return int(mask[0]) + sum(b > a for a, b in zip(mask, mask[1:]))


def _spans(ids, mask) -> list[list[int]]:
    """The loss segments' tokens."""
    out = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            out.append([])
        if m:
            out[-1].append(ids[i])
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multiturn")
    src = folder / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": k, "messages": v}) + "\n" for k, v in ROWS.items()))
    out = folder / "chats.parquet"
    prepare_prompts({"path": str(src), "messages_column": "messages"}, "chats", str(out))
    return out


def test_turn_plan():
    assert turn_plan(ROWS["three"], "all") == ([1, 3, 5], 3, None)
    prompt = ROWS["two"][:3]  # the normal form: up to the last user turn
    assert turn_plan(prompt, "all") == ([0, 2], 2, None)
    assert turn_plan(prompt, "last") == ([2], 2, "turns_last")
    assert turn_plan(ROWS["tool"][:4], "all") == ([3], 2, "tool_turns")
    assert turn_plan(_chat(("u", "a"), ("u", "b")), "all") == ([1], 1, None)  # an unanswered user turn is context


def test_embedded_backend_answers_every_user_turn(random_target, prompts, tmp_path):
    """Greedy, one prompt at a time: each reply is what the target says to the conversation so far, its own
    earlier replies included; tokenized, each reply is a loss segment."""
    out = tmp_path / "all.parquet"
    summary = expand_prompts(str(prompts), str(random_target), ExpandSettings(**SETTINGS), str(out), log=lambda m: None)
    df = pd.read_parquet(out).set_index("id")
    tok = AutoTokenizer.from_pretrained(random_target)
    for rid, n_turns in SEGMENTS.items():
        messages = [dict(t) for t in df.loc[rid, "messages"]]
        turns = list(df.loc[rid, "turns"])
        assert len(turns) == n_turns, rid
        assert messages[-1]["content"] == df.loc[rid, "response"]
        for t in turns:  # the target's reply, its ids and its context
            m = int(t["message"])
            assert messages[m]["role"] == "assistant" and "CORPUS" not in messages[m]["content"], rid
            assert tok.decode(list(t["token_ids"]), skip_special_tokens=True) == messages[m]["content"]
            assert t["num_prompt_tokens"] == len(prompt_ids(tok, messages[:m]))
        if rid in ("two", "three", "long"):
            assert all("CORPUS" not in t["content"] for t in messages if t["role"] == "assistant"), rid
    three = [dict(t) for t in df.loc["three", "messages"]]
    assert [t["role"] for t in three] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert df.loc["tool", "unanswered"] == "tool_turns" and "CORPUS calling" in str(list(df.loc["tool", "messages"]))
    assert df.loc["long", "unanswered"] == "skipped_prompt_too_long" and len(df.loc["long", "messages"]) == 2
    assert summary["turns"] == {"regenerated": 8, "unanswered": {"tool_turns": 1, "skipped_prompt_too_long": 1}}

    # the second reply of "two" is what the target answers to its own first reply, asked alone
    two = [dict(t) for t in df.loc["two", "messages"]]
    alone = tmp_path / "alone.parquet"
    pd.DataFrame({"id": ["x"], "prompt": [two[:3]], "reference": [None]}).to_parquet(alone)
    expand_prompts(str(alone), str(random_target), ExpandSettings(**SETTINGS), str(tmp_path / "x.parquet"),
                   log=lambda m: None)
    assert pd.read_parquet(tmp_path / "x.parquet")["response"][0] == two[3]["content"]

    # every regenerated turn is a loss segment of its own: with the generated ids, exactly those (the random
    # target's replies are cut at max_new_tokens: the end of turn it never wrote is out of the loss)
    assert set(df["finish_reason"]) == {"length"}
    for rid, n_turns in SEGMENTS.items():
        messages = [dict(t) for t in df.loc[rid, "messages"]]
        turns = list(df.loc[rid, "turns"])
        earlier = [(int(t["message"]), list(t["token_ids"]), t["finish_reason"] == "length") for t in turns[:-1]]
        info = {}
        ids, mask, _ = encode_chat(tok, messages, 8192, cut=True, reply_ids=list(df.loc[rid, "token_ids"]), info=info,
                                   earlier=earlier)
        assert _spans(ids, mask) == [[int(i) for i in t["token_ids"]] for t in turns], rid
        assert _segments(mask) == n_turns and all(o != "not_maskable" for o in info.get("turns", [])), info


def test_samples_are_chains_of_their_own_and_last_keeps_the_corpus_turns(random_target, prompts, tmp_path):
    out = tmp_path / "s.parquet"
    expand_prompts(str(prompts), str(random_target), ExpandSettings(**{**SETTINGS, "temperature": 1.0, "num_samples": 2,
                                                                        "seed": 1}), str(out), log=lambda m: None)
    df = pd.read_parquet(out)
    two = df[df["id"] == "two"].sort_values("sample")
    assert list(two["sample"]) == [0, 1] and [len(t) for t in two["turns"]] == [2, 2]
    first = [list(m)[1]["content"] for m in two["messages"]]
    assert first[0] != first[1]  # each sample answers the second turn after its own first reply

    last = tmp_path / "last.parquet"
    summary = expand_prompts(str(prompts), str(random_target), ExpandSettings(**{**SETTINGS, "turns": "last"}),
                             str(last), log=lambda m: None)
    df = pd.read_parquet(last).set_index("id")
    for rid, chat in ROWS.items():
        prompt = chat if chat[-1]["role"] == "user" else chat[:-1]
        assert [dict(t) for t in df.loc[rid, "messages"]][:-1] == prompt, rid
        assert len(df.loc[rid, "turns"]) == (0 if rid == "long" else 1)
    assert summary["turns"]["unanswered"] == {"turns_last": 4, "skipped_prompt_too_long": 2}


def test_anchors_stay_inside_one_reply():
    """A block never reaches from one loss segment into the next; one segment: the anchors of sample_anchors."""
    lm = torch.zeros(1, 40, dtype=torch.bool)
    lm[0, 4:14] = True
    lm[0, 17:30] = True  # a gap of 3 (a short user turn), then the next reply
    for reach in (3, 4):
        allowed = {a for a in range(39) if lm[0, a] and lm[0, a + 1] and not (a < 17 <= a + reach)}
        anchors, keep = sample_anchors(anchor_mask(lm, reach), 40, 4, torch.Generator().manual_seed(0))
        assert set(anchors[keep].tolist()) == allowed
    one = torch.zeros(1, 40, dtype=torch.bool)
    one[0, 5:30] = True
    assert torch.equal(anchor_mask(one, 3), one)


def test_workflow_trains_every_turn(tmp_path):
    """Through Snakemake on the tiny target: a ShareGPT file of 2-3 user turns a row beside the shipped data;
    ``turns: all`` puts the target's reply in every assistant position and one loss segment per reply in the
    tokenized samples; ``turns: last`` keeps one segment."""
    chats = [
        {"id": f"c{i}", "conversations": [
            {"from": "human", "value": f"Add {i} and {i + 1}."}, {"from": "gpt", "value": "CORPUS one"},
            {"from": "human", "value": "Now double it."}, {"from": "gpt", "value": "CORPUS two"},
            *([{"from": "human", "value": "And halve that."}, {"from": "gpt", "value": "CORPUS 3"}] if i % 2 else [])]}
        for i in range(6)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = mini_config()
    cfg["datasets"]["math"]["limit"] = 8
    del cfg["datasets"]["code"]  # one shipped training set beside the chats: each run expands two, not three
    cfg["datasets"]["chats"] = {"path": str(tmp_path / "chats.jsonl"), "messages_column": "conversations",
                                "format": "sharegpt"}
    config = write_config(tmp_path / "config.yaml", cfg)
    target = ["results/tokenized/stats.json"]
    res = snakemake(tmp_path, *target, "--cores", "2", "--configfile", str(config))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    import datasets

    df = pd.read_parquet(tmp_path / "results/expanded/chats.parquet").set_index("id")
    for c in chats:
        messages = [dict(t) for t in df.loc[c["id"], "messages"]]
        n = len(c["conversations"]) // 2
        assert [t["role"] for t in messages] == ["user", "assistant"] * n
        assert [int(t["message"]) for t in df.loc[c["id"], "turns"]] == [2 * k + 1 for k in range(n)]
        assert not any("CORPUS" in t["content"] for t in messages)
    ds = datasets.load_from_disk(str(tmp_path / "results/tokenized/train"))
    turns = {c["id"]: len(c["conversations"]) // 2 for c in chats}
    kept = [(r["id"], _segments(r["loss_mask"])) for r in ds if r["dataset"] == "chats"]
    assert kept and all(n == turns[rid] for rid, n in kept), kept
    assert all(_segments(r["loss_mask"]) == 1 for r in ds if r["dataset"] != "chats")
    stats = json.loads((tmp_path / "results/tokenized/stats.json").read_text())["turns"]
    assert stats["regenerated"] >= sum(turns.values()) and stats["samples_with_several"] == len(kept)

    cfg["expand"]["turns"] = "last"
    write_config(config, cfg)
    res = snakemake(tmp_path, *target, "--cores", "2", "--configfile", str(config))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    df = pd.read_parquet(tmp_path / "results/expanded/chats.parquet")
    assert all("CORPUS" in str(list(m)) for m in df["messages"])  # the corpus's earlier replies stay
    ds = datasets.load_from_disk(str(tmp_path / "results/tokenized/train"))
    assert all(_segments(r["loss_mask"]) == 1 for r in ds)
    stats = json.loads((tmp_path / "results/tokenized/stats.json").read_text())["turns"]
    assert stats["samples_with_several"] == 0 and stats["unanswered"]["turns_last"] == sum(n - 1 for n in turns.values())


def test_batched_backend_answers_turn_by_turn_as_embedded(random_target, prompts, tmp_path):
    """Greedy on the CPU the batched backend gives the embedded backend's tokens, turn after turn."""
    frames = {}
    for backend in ("embedded", "batched"):
        out = tmp_path / f"{backend}.parquet"
        expand_prompts(str(prompts), str(random_target), ExpandSettings(**SETTINGS, backend=backend), str(out),
                       log=lambda m: None)
        frames[backend] = pd.read_parquet(out).set_index("id").sort_index()
    a, b = frames["embedded"], frames["batched"]
    assert [len(t) for t in a["turns"]] == [len(t) for t in b["turns"]] == [SEGMENTS[i] for i in a.index]
    assert [[dict(t) for t in m] for m in a["messages"]] == [[dict(t) for t in m] for m in b["messages"]]
