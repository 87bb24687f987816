"""A user's own target and corpus (issue 63): the recipe a real target trains, through Snakemake."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import yaml

from conftest import PROMPTS, REPO, read_jsonl_gz, snakemake, write_config
from dflashpipe.config import TINY_RECIPE, load_yaml
from dflashpipe.jobs.settings import SCHEMA_PATH, load_schema


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _schema_default(dotted: str):
    node = load_schema(str(SCHEMA_PATH))
    for part in dotted.split("."):
        node = node["properties"][part]
    return node["default"]


def _checkout_like(tmp_path):
    """A working folder like the checkout: the shipped config/config.yaml where the Snakefile looks for it,
    so that a user's --configfile overlays it, as it does from a clone."""
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config/config.yaml", tmp_path / "config/config.yaml")
    return tmp_path


def test_a_real_target_trains_the_real_recipe_and_the_tiny_one_the_demo_cuts(tmp_path, micro_target):
    """An overlay naming only a real target.path and its datasets inherits none of the CPU demo's cuts: every
    key of config/tiny_target.yaml takes the schema's default; the console says the recipe and whose it is,
    and results/effective_config.yaml records every key. The embedded target keeps the cuts, under the keys a
    user sets."""
    work = _checkout_like(tmp_path)
    data = {"mine": {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 8},
            "mine_eval": {"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "use": "eval"}}
    user = write_config(work / "user.yaml", {"target": {"path": str(micro_target)}, "datasets": data})
    res = snakemake(work, "effective_config", "--cores", "1", "--configfile", str(user))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("recipe: drafter.arch=dflash2 train.loss=kl drafter.num_layers=5 drafter.block_size=16 (the schema's "
            "recipe for a real target, under your config)") in res.stderr
    effective = yaml.safe_load((work / "results/effective_config.yaml").read_text())
    cuts = dict(_leaves(load_yaml(str(TINY_RECIPE))))
    assert len(cuts) > 20
    for key in cuts:
        assert _get(effective, key) == _schema_default(key), key
    assert set(effective["datasets"]) == {"mine", "mine_eval"} and effective["target"]["path"] == str(micro_target)

    # the embedded target: the demo's cuts fill what the files leave out; a key the user sets wins
    tiny = write_config(work / "tiny.yaml", {"drafter": {"num_layers": 2}, "datasets": data})
    res = snakemake(work, "effective_config", "--cores", "1", "--configfile", str(tiny))
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("recipe: drafter.arch=dflash2 train.loss=ce drafter.num_layers=2 drafter.block_size=6 (the embedded tiny "
            "target's 2-core demo recipe, config/tiny_target.yaml, under your config)") in res.stderr
    effective = yaml.safe_load((work / "results/effective_config.yaml").read_text())
    for key, value in cuts.items():
        assert _get(effective, key) == (2 if key == "drafter.num_layers" else value), key


def _doc_overlay() -> dict:
    """The copy-paste overlay of docs/real-target.md, as a user copies it."""
    text = (REPO / "docs/real-target.md").read_text()
    marker = "<!-- the overlay below is run through Snakemake by tests/test_user_data.py -->\n```yaml\n"
    return yaml.safe_load(text.split(marker)[1].split("```")[0])


#: the corpus's broken rows, each with the reason it is counted under (written after the first 4 good rows)
BROKEN = [("not json {", "malformed_json"),
          (json.dumps({"id": "b1", "conversations": [{"from": "bot", "value": "hi"}]}), "unknown_role"),
          (json.dumps({"id": "b2", "conversations": []}), "empty_conversation"),
          (json.dumps({"id": "b3", "conversations": [{"from": "gpt", "value": "hello"}]}), "no_user_turn"),
          (json.dumps({"id": "b4", "conversations": [{"from": "human", "value": None}]}), "null_content")]


def _corpus(folder):
    """A ShareGPT corpus as users have them (single and multi-turn rows, a top-level system field, broken
    rows, a last line cut short) and an eval file of {id, question} rows, from the shipped math prompts."""
    good = []
    for i, r in enumerate(read_jsonl_gz(PROMPTS / "math_train.jsonl.gz", 16)):
        q, a = r["messages"][0]["content"], r["messages"][1]["content"]
        conv = [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        if i % 2:  # multi-turn: a follow-up question and its answer
            conv += [{"from": "human", "value": "Check that answer once more."}, {"from": "gpt", "value": "It holds."}]
        row = {"id": f"c{i}", "conversations": conv}
        if i % 3 == 0:
            row["system"] = "You are a careful math tutor."
        good.append(json.dumps(row))
    lines = good[:4] + [line for line, _ in BROKEN] + good[4:]
    chat = folder / "sharegpt.jsonl"
    chat.write_text("\n".join(lines) + '\n{"id": "t1", "conversations": [{"from": "human", "val')  # cut short
    questions = folder / "questions.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "question": r["messages"][0]["content"]}) + "\n"
                                 for i, r in enumerate(read_jsonl_gz(PROMPTS / "math_heldout.jsonl.gz", 4))))
    return chat, questions


#: what a test can afford on the CPU, beside the user's overlay (the embedded tiny target's recipe fills the rest)
SMALL = {"expand": {"max_new_tokens": 24, "batch_size": 16, "chunk_size": 16, "threads": 1},
         "tokenize": {"buckets": [256, 512]},
         "train": {"max_steps": 3, "batch_size": 2, "num_anchors": 8, "checkpoint_every": 2, "threads": 1},
         "evaluate": {"num_prompts": 2, "max_new_tokens": 12, "methods": ["dflash", "ar"], "threads": 1}}


def test_a_sharegpt_corpus_and_an_eval_file_as_they_come(tmp_path):
    """docs/real-target.md's overlay, with the tiny target for the user's model: the checker and the run
    stop on more bad rows than data.max_bad_rows allows, with one line counting every reason; allowed, the
    run goes through, every bad row counted and located (file:line, 1-based, and the row's id), and the
    console, eval.csv and the model card say that the tiny target's figures do not transfer."""
    import subprocess
    import sys

    chat, questions = _corpus(tmp_path)
    overlay = _doc_overlay()
    assert set(overlay) == {"target", "datasets", "data"}  # the doc's shape, as the test runs it
    overlay["target"]["path"] = "resources/tiny_target"
    overlay["datasets"]["chat"]["path"], overlay["datasets"]["questions"]["path"] = str(chat), str(questions)
    mine = write_config(tmp_path / "my.yaml", overlay)
    small = write_config(tmp_path / "small.yaml", SMALL)

    n_rows = 16 + len(BROKEN) + 1
    counts = "malformed_json 1, truncated_line 1, unknown_role 1, null_content 1, empty_conversation 1, no_user_turn 1"
    stop = (f"{chat} (dataset chat): 6 of {n_rows} rows are bad ({counts}), more than data.max_bad_rows allows "
            f"(5% of {n_rows}); the first: {chat}:5: malformed_json: not JSON at column 1: Expecting value; fix those "
            "rows or raise data.max_bad_rows")
    res = subprocess.run([sys.executable, "-m", "dflashpipe.config", str(mine)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.strip() == f"ERROR: {stop}", res.stderr
    res = snakemake(tmp_path, "--cores", "2", "--configfile", str(mine), str(small))
    assert res.returncode != 0 and stop in res.stdout + res.stderr
    assert not (tmp_path / "results/prompts/chat.parquet").exists()

    allow = write_config(tmp_path / "allow.yaml", {"data": {"max_bad_rows": 6}})
    res = subprocess.run([sys.executable, "-m", "dflashpipe.config", str(mine), str(allow)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (f"datasets.chat: 16 prompts of {n_rows} rows (24 user turns; prompts with a reference reply: 16); skipped 6 bad rows "
            f"({counts}; the first: {chat}:5: malformed_json: not JSON at column 1: Expecting value)") in res.stdout
    assert "datasets.questions: 4 prompts of 4 rows (4 user turns; prompts with a reference reply: 0)" in res.stdout
    res = snakemake(tmp_path, "--cores", "2", "--configfile", str(mine), str(small), str(allow))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    r = tmp_path / "results"
    stats = json.loads((r / "prompts/chat.stats.json").read_text())
    assert {k: n for k, n in stats["skipped_rows"].items() if n} == {reason: 1 for _, reason in BROKEN} | {"truncated_line": 1}
    assert [(b["where"], b["id"], b["reason"]) for b in stats["first_skipped"]] == [
        (f"{chat}:5", None, "malformed_json"), (f"{chat}:6", "b1", "unknown_role"), (f"{chat}:7", "b2", "empty_conversation"),
        (f"{chat}:8", "b3", "no_user_turn"), (f"{chat}:9", "b4", "null_content")]
    assert "skipped 6 bad rows" in (r / "logs/prompts/chat.log").read_text()
    # every assistant turn of a multi-turn row is the target's (expand.turns: all), and trained
    ex = pd.read_parquet(r / "expanded/chat.parquet")
    assert not [t for m in ex["messages"] for t in m if t["role"] == "assistant" and t["content"] == "It holds."]
    turns = json.loads((r / "tokenized/stats.json").read_text())["turns"]
    assert turns["regenerated"] > 16 and turns["samples_with_several"] > 0 and turns["trained"] > 16
    # the tiny target on the user's data says what its figures are, wherever they are read
    assert "NOTE: the embedded tiny target (a 1.3M-parameter model" in out
    ev = pd.read_csv(r / "tables/eval.csv")
    assert set(ev["dataset"]) == {"questions"} and ev["caveat"].str.contains("do not transfer to a real target").all()
    assert "**Caveat:** the embedded tiny target" in (r / "drafter/README.md").read_text()


def test_the_checker_reads_the_data(tmp_path):
    """python -m dflashpipe.config opens each dataset as its prompts job will: a column that is not there is
    one line with a guess, before anything runs (it said `ok` and the prompts job failed 15 s into the run)."""
    import subprocess
    import sys

    _, questions = _corpus(tmp_path)
    mine = write_config(tmp_path / "my.yaml", {"datasets": {
        "math": {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 4},
        "questions": {"path": str(questions), "prompt_column": "questoin", "use": "eval"}}})
    res = subprocess.run([sys.executable, "-m", "dflashpipe.config", str(mine)], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.strip() == (f"ERROR: {questions} (dataset questions): none of its 4 rows gives a prompt (missing_column 4; "
                                  f"the first: {questions}:1 (id 'q0'): missing_column: no column 'questoin' (has ['id', "
                                  "'question']; did you mean 'question'?); set `prompt_column`)")


def test_the_docs_name_every_bad_row_reason():
    """config/README.md lists the reasons a row is counted under, as the code names them, and the reliability
    table points at the tests that check them (they exist)."""
    import re

    from dflashpipe.inputs.data import BAD_ROWS

    text = (REPO / "config/README.md").read_text()
    paragraph = text[text.index("A bad row is skipped and counted by reason"):text.index("## `data`")]
    assert tuple(re.findall(r"`([a-z_]+)`", paragraph.split(")")[0])) == BAD_ROWS
    row = next(line for line in (REPO / "docs/reliability.md").read_text().splitlines() if line.startswith("| bad rows"))
    for test in re.findall(r"test_user_data\.py::(\w+)", row):
        assert test in globals(), test
