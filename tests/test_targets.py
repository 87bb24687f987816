"""A user's own target and data: other model families, tokenizers without a mask token, templates
that add a default system turn, replies cut at the length limit, and a config naming only its own
datasets. The targets are tiny, randomly initialised, with tokenizers built here from the micro
target's vocabulary; the last test runs the pipeline on one of them through Snakemake."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from conftest import PROMPTS, planned_rules, snakemake
from dflashpipe.inputs.target import resolve_mask_token
from dflashpipe.inputs.tokenize import encode_chat, loop_start, tokenize_expanded
from dflashpipe.jobs.errors import UserError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# SmolLM2-style: a default system turn when the conversation has none
WITH_DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful AI assistant."
                       "<|im_end|>\n{% endif %}" + CHATML)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=1024)


def make_target(out: Path, micro_target: Path, family: str, *, template: str = CHATML, mask: str | None = None,
                extra_special: tuple[str, ...] = (), spare_rows: int = 0, tied: bool = True) -> Path:
    """A tiny random ``family`` (llama | qwen2 | qwen3) causal LM with a tokenizer built from the micro target's."""
    import transformers
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer.from_file(str(micro_target / "tokenizer.json"))
    base.add_special_tokens(list(extra_special))
    tok = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  mask_token=mask, chat_template=template)
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    cfg = getattr(transformers, config_cls)(vocab_size=len(tok) + spare_rows, tie_word_embeddings=tied,
                                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SMALL)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # sharper logits than the default init: varied greedy replies
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(8.0)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_the_mask_token_is_decided_from_the_targets_files(micro_target, tmp_path):
    """The documented rule: the tokenizer's mask token, else the first spare embedding row, else a
    reserved special token, else one line listing the special tokens the template does not use."""
    with_mask = make_target(tmp_path / "m", micro_target, "qwen3", mask="<|mask|>")
    spare = make_target(tmp_path / "s", micro_target, "qwen3", spare_rows=64)
    reserved = make_target(tmp_path / "r", micro_target, "qwen2", tied=False,
                           extra_special=("<|reserved_special_token_0|>", "<|reserved_special_token_1|>"))
    none = make_target(tmp_path / "n", micro_target, "llama", template=WITH_DEFAULT_SYSTEM)
    n_tok = json.loads((spare / "config.json").read_text())["vocab_size"] - 64

    assert resolve_mask_token(str(with_mask))[1] == "the tokenizer's mask token '<|mask|>'"
    assert resolve_mask_token(str(spare)) == (n_tok, f"the first spare embedding row (the tokenizer has {n_tok} tokens, "
                                                     f"the embedding {n_tok + 64} rows)")
    rid, how = resolve_mask_token(str(reserved))
    assert how == "the reserved special token '<|reserved_special_token_0|>'" and rid == n_tok
    with pytest.raises(UserError) as e:
        resolve_mask_token(str(none))
    msg = str(e.value)
    assert msg.startswith("drafter.mask_token_id: the target in") and "\n" not in msg
    assert "'<|mask|>'" in msg and "'<|im_start|>'" not in msg  # the template's own tokens are not candidates
    assert resolve_mask_token(str(none), 3) == (3, "set in the config")
    with pytest.raises(UserError, match=r"drafter.mask_token_id: 99999 is not a row of the target embedding"):
        resolve_mask_token(str(none), 99999)


def test_loss_mask_with_a_default_system_turn_and_cut_replies(micro_target, tmp_path):
    """Only the reply is in the loss (not the default system turn the template adds); a reply cut
    at the length limit keeps its tokens but not the end of turn the target never produced."""
    from transformers import AutoTokenizer

    path = make_target(tmp_path / "t", micro_target, "llama", template=WITH_DEFAULT_SYSTEM)
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "It is 5 because"}]
    ids, mask, _ = encode_chat(tok, chat, 512)
    assert "You are a helpful AI assistant." in tok.decode(ids) and tok.decode([i for i, m in zip(ids, mask) if m]) == \
        "It is 5 because<|im_end|>\n"
    ids_cut, mask_cut, _ = encode_chat(tok, chat, 512, cut=True)
    assert ids_cut == ids and tok.decode([i for i, m in zip(ids, mask_cut) if m]) == "It is 5 because"

    rows = [{"id": str(i), "sample": 0, "messages": chat[:1] + [{"role": "assistant", "content": "word " * 20}],
             "finish_reason": reason} for i, reason in enumerate(["stop", "length", "length"])]
    pd.DataFrame(rows).to_parquet(tmp_path / "e.parquet")
    stats = tokenize_expanded({"x": str(tmp_path / "e.parquet")}, str(path), [128], str(tmp_path / "tok"),
                              str(tmp_path / "s.json"), log=lambda m: None)
    assert stats["samples"] == 3 and stats["cut_replies"]["kept_with_end_of_turn_out_of_the_loss"] == 2
    import datasets

    n_loss = datasets.load_from_disk(str(tmp_path / "tok"))["num_loss_tokens"]
    assert n_loss[0] == n_loss[1] + 2 == n_loss[2] + 2  # <|im_end|> and its newline
    stats = tokenize_expanded({"x": str(tmp_path / "e.parquet")}, str(path), [128], str(tmp_path / "tok2"),
                              str(tmp_path / "s2.json"), cut_replies="drop", log=lambda m: None)
    assert stats["samples"] == 1 and stats["dropped"] == {"cut_reply": 2}


def test_loop_start_finds_where_a_reply_starts_repeating():
    head = [5, 6, 7, 8, 9, 10, 11, 12]
    unit = [1, 2, 3, 2, 4]  # a unit that contains a repeated token is still one period
    assert loop_start(head + unit * 6) == (len(head), 5)
    assert loop_start(head + [3] * 20) == (len(head), 1)
    # the loop may start inside the head: a head ending in the unit's tail belongs to the loop
    assert loop_start([9, 9, 2, 4] + unit * 4) == (2, 5)
    assert loop_start(head + unit * 2) is None  # 10 tokens of repetition: under min_span
    assert loop_start(list(range(100))) is None
    assert loop_start([]) is None


def test_cut_replies_rules_are_the_schemas():
    from dflashpipe.inputs.tokenize import CUT_REPLIES
    from dflashpipe.jobs.settings import load_schema

    assert list(CUT_REPLIES) == load_schema()["properties"]["tokenize"]["properties"]["cut_replies"]["enum"]


def test_cut_loop_keeps_a_looping_reply_up_to_its_loop(micro_target, tmp_path):
    """tokenize.cut_replies cut_loop: a reply cut at the length limit because it loops keeps its text up
    to the loop's first occurrence (out of the loss: the end of turn); a cut reply that does not loop
    keeps all of its tokens, as mask_end; a finished reply is untouched."""
    from transformers import AutoTokenizer

    path = make_target(tmp_path / "t", micro_target, "llama")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = [{"role": "user", "content": "Count."}]
    head, unit = tok.encode("the answer is", add_special_tokens=False), tok.encode(" one two", add_special_tokens=False)
    looping = head + unit * 12
    straight = tok.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda", add_special_tokens=False)
    rows = [{"id": "loop", "sample": 0, "finish_reason": "length", "token_ids": looping,
             "messages": prompt + [{"role": "assistant", "content": tok.decode(looping)}]},
            {"id": "long", "sample": 0, "finish_reason": "length", "token_ids": straight,
             "messages": prompt + [{"role": "assistant", "content": tok.decode(straight)}]},
            {"id": "done", "sample": 0, "finish_reason": "stop", "token_ids": looping,
             "messages": prompt + [{"role": "assistant", "content": tok.decode(looping)}]}]
    pd.DataFrame(rows).to_parquet(tmp_path / "e.parquet")
    stats = tokenize_expanded({"x": str(tmp_path / "e.parquet")}, str(path), [256], str(tmp_path / "tok"),
                              str(tmp_path / "s.json"), cut_replies="cut_loop", reply_ids="generated",
                              log=lambda m: None)
    import datasets

    ds = datasets.load_from_disk(str(tmp_path / "tok"))
    loss = {r["id"]: [i for i, m in zip(r["input_ids"], r["loss_mask"]) if m] for r in ds}
    assert loss["loop"] == head + unit  # up to the first occurrence of the loop, no end of turn
    assert loss["long"] == straight
    assert loss["done"][: len(looping)] == looping and len(loss["done"]) > len(looping)  # + its end of turn
    assert stats["cut_replies"]["cut_at_their_loop"] == 1 and stats["samples"] == 3


# Mistral-style: user and assistant turns alternate, starting with the user; anything else is refused
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_that_refuses_a_conversation_is_one_line_naming_the_row(micro_target, tmp_path):
    """A ShareGPT file with a system turn, a target whose template only alternates user/assistant: the
    expansion stops before it loads the model, and the evaluation before it decodes, with one line each."""
    from dflashpipe.evaluate.run import encode_prompt
    from dflashpipe.inputs.data import prepare_prompts
    from dflashpipe.inputs.target import load_tokenizer
    from dflashpipe.stages.expand import ExpandSettings, expand_prompts

    target = make_target(tmp_path / "strict", micro_target, "qwen3", template=STRICT, mask="<|mask|>")
    rows = [{"id": "ok", "conversations": [{"from": "human", "value": "2+2?"}]},
            {"id": "sys", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "3+3?"}]}]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "chats.parquet"
    prepare_prompts({"path": str(data)}, "chats", str(prompts))
    with pytest.raises(UserError) as e:
        expand_prompts(str(prompts), str(target), ExpandSettings(max_new_tokens=4), str(tmp_path / "out.parquet"),
                       log=lambda m: None)
    assert str(e.value) == (f"{prompts} row id 'sys': the target's chat template refuses this conversation (roles "
                            "system, user: Conversation roles must alternate user/assistant/user/assistant/...); drop or "
                            "merge the turns it does not take in the dataset, or give the target a chat template that "
                            "accepts them")
    with pytest.raises(UserError, match=r"^eval.parquet row id 'sys': the target's chat template refuses"):
        encode_prompt(load_tokenizer(str(target)), [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                      None, "eval.parquet row id 'sys'")


def user_config(work: Path, target: Path, **overrides) -> Path:
    """A user's config: their target and ONLY their datasets (the shipped four must not appear)."""
    cfg = {
        "target": {"path": str(target)},
        "datasets": {
            "mine": {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 40},
            "mine_eval": {"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "use": "eval",
                          "limit": 3},
        },
        "expand": {"max_new_tokens": 40, "batch_size": 16, "chunk_size": 20, "threads": 1},
        "tokenize": {"buckets": [128, 256]},
        "gpu": {"slots": 1},
        "drafter": {"block_size": 4, "num_layers": 1},
        "train": {"shards": 1, "threads": 1, "num_anchors": 8, "batch_size": 4, "max_steps": 4, "heldout_samples": 4},
        "evaluate": {"num_prompts": 2, "max_new_tokens": 12, "methods": ["dflash", "ar"]},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = work / "my.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _llama_user(micro_target, tmp_path):
    """A Llama-family target whose tokenizer has no mask token and no spare row, the user's datasets
    only; returns (work dir, target, the id of the mask token the refusal suggests)."""
    target = make_target(tmp_path / "llama", micro_target, "llama", template=WITH_DEFAULT_SYSTEM)
    work = tmp_path / "wf"
    work.mkdir()
    mask_id = json.loads((target / "tokenizer.json").read_text())["added_tokens"][3]["id"]  # <|mask|>
    return work, target, mask_id


def test_a_users_llama_target_without_a_mask_token_is_refused_in_one_line_then_plans_its_datasets(micro_target, tmp_path):
    """Refused before anything runs, with the candidates; with one of them set, the plan runs the
    user's datasets only."""
    work, target, mask_id = _llama_user(micro_target, tmp_path)
    res = snakemake(work, "-n", "--configfile", str(user_config(work, target)))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR:")]
    assert line.startswith("ERROR: drafter.mask_token_id: the target in") and "'<|mask|>'" in line
    cfg = user_config(work, target, drafter={"mask_token_id": mask_id})  # the same file, now with the fix
    plan = planned_rules(work, "--configfile", str(cfg))
    assert plan["prompts"] == 2 and plan["expand_shard"] == 1 and plan["evaluate"] == 1  # no shipped dataset


@pytest.mark.slow  # ~90 s on 2 cores: the whole pipeline on the user's target and datasets
def test_a_users_llama_target_and_datasets_run_end_to_end(micro_target, tmp_path):
    work, target, mask_id = _llama_user(micro_target, tmp_path)
    cfg = user_config(work, target, drafter={"mask_token_id": mask_id})
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.stem for p in (work / "results/prompts").glob("*.parquet")) == ["mine", "mine_eval"]
    summary = json.loads((work / "results/eval/mine_eval.summary.json").read_text())
    assert summary["lossless"]["passed"] and summary["chat_template_kwargs"] == {}
    stats = json.loads((work / "results/tokenized/stats.json").read_text())
    assert stats["samples"] > 0 and stats["cut_replies"]["rule"] == "mask_end"
    assert json.loads((work / "results/drafter/config.json").read_text())["dflash_config"]["mask_token_id"] == mask_id


def test_the_last_configfile_naming_datasets_wins_and_the_checker_agrees(micro_target, tmp_path):
    """With several --configfile files, the datasets are those of the last file naming any (not a
    union); `python -m dflashpipe.config` checks what the workflow checks, the mask token included."""
    import subprocess
    import sys

    target = make_target(tmp_path / "llama", micro_target, "llama", template=WITH_DEFAULT_SYSTEM)
    work = tmp_path / "wf"
    work.mkdir()
    first = user_config(work, target, drafter={"mask_token_id": 3})
    second = work / "other.yaml"
    second.write_text(yaml.safe_dump({"datasets": {"only": {"path": str(PROMPTS / "math_train.jsonl.gz"),
                                                            "messages_column": "messages", "limit": 8}}}))
    plan = planned_rules(work, "--configfile", str(first), str(second))
    assert plan["prompts"] == 1 and "evaluate" not in plan  # `only`, without the first file's two
    checker = [sys.executable, "-m", "dflashpipe.config"]
    ok = subprocess.run([*checker, str(first), str(second)], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith(f"ok: {first}, {second}")
    bare = user_config(tmp_path, target)  # no mask_token_id: refused by the checker as by the workflow
    res = subprocess.run([*checker, str(bare)], capture_output=True, text=True)
    assert res.returncode == 1 and res.stderr.startswith("ERROR: drafter.mask_token_id: the target in")
