"""Regeneration and the evaluation decode what the config says, whatever the target's generation_config holds.

A real (micro, random-weight) target whose generation_config.json sets what Qwen2.5-Instruct-style
files set (sampling defaults, a repetition penalty) and more (no_repeat_ngram_size, min_new_tokens):
greedy must stay greedy in every backend and in the evaluation's transformers peers.
"""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from conftest import PROMPTS
from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.inputs.target import describe_neutralised, generation_arguments
from dflashpipe.stages.expand import ExpandSettings, expand_prompts

torch.set_num_threads(1)

LEAKY = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.5,
         "no_repeat_ngram_size": 1, "min_new_tokens": 12}


@pytest.fixture(scope="module")
def leaky_target(random_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("leaky") / "model"
    shutil.copytree(random_target, out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **LEAKY}))
    return out


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "p.parquet"
    prepare_prompts({"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 4}, "math",
                    str(out))
    return out


def test_arguments_neutralise_the_targets_settings(leaky_target):
    from transformers import GenerationConfig

    gc = GenerationConfig.from_pretrained(leaky_target)
    kw, gone = generation_arguments(gc, 16, 0.0, eos_ids=[3], pad_token_id=0)
    assert kw["do_sample"] is False and kw["temperature"] is None and kw["top_k"] is None and kw["top_p"] is None
    assert (kw["repetition_penalty"], kw["no_repeat_ngram_size"], kw["min_new_tokens"]) == (1.0, 0, 0)
    assert kw["max_new_tokens"] == 16 and kw["eos_token_id"] == [3] and kw["pad_token_id"] == 0
    assert gone == LEAKY
    kw, gone = generation_arguments(gc, 16, 0.7, top_p=0.9)
    assert (kw["do_sample"], kw["temperature"], kw["top_p"], kw["top_k"]) == (True, 0.7, 0.9, 0)
    assert gone == {k: v for k, v in LEAKY.items() if k not in ("do_sample", "temperature")}
    plain = GenerationConfig(eos_token_id=3)
    assert generation_arguments(plain, 16, 0.0)[1] == {} and describe_neutralised({}) is None


def test_greedy_regeneration_ignores_the_generation_config(leaky_target, random_target, prompts, tmp_path):
    """Greedy expansion with the leaky target: the embedded backend (transformers generate) gives the batched
    backend's replies (which never applied the file), and those of the same weights without the settings;
    the neutralised settings are logged once per job."""
    settings = dict(max_new_tokens=16, batch_size=4, chunk_size=2, temperature=0.0)
    frames, logs = {}, {}
    for name, target, backend in (("embedded", leaky_target, "embedded"), ("batched", leaky_target, "batched"),
                                  ("plain", random_target, "embedded")):
        out, logs[name] = tmp_path / f"{name}.parquet", []
        expand_prompts(str(prompts), str(target), ExpandSettings(**settings, backend=backend), str(out),
                       log=logs[name].append)
        frames[name] = pd.read_parquet(out).set_index(["id", "sample"]).sort_index()
    ids = {k: [list(x) for x in f["token_ids"]] for k, f in frames.items()}
    assert ids["embedded"] == ids["batched"] == ids["plain"]
    assert list(frames["embedded"]["response"]) == list(frames["batched"]["response"])
    for name in ("embedded", "batched"):
        lines = [m for m in logs[name] if "generation_config sets" in m]
        assert len(lines) == 1 and "repetition_penalty=1.5" in lines[0] and "no_repeat_ngram_size=1" in lines[0]
        assert "min_new_tokens=12" in lines[0]
    assert not [m for m in logs["plain"] if "generation_config sets" in m]


def test_evaluation_peers_decode_greedy(leaky_target):
    """The evaluation's transformers peers (hf_generate, prompt lookup) on the leaky target give plain argmax."""
    from transformers import AutoModelForCausalLM

    from dflashpipe.evaluate.baselines import hf_generate, prompt_lookup_generate

    model = AutoModelForCausalLM.from_pretrained(leaky_target, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, model.config.vocab_size, (12,), generator=g).tolist()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(16):  # plain greedy, written out
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(prompt):]
    eos = [t for t in range(5) if t not in want][:1]  # a stop token greedy decoding never reaches here
    assert hf_generate(model, None, prompt, 16, 0.0, eos_ids=eos).tokens == want
    assert prompt_lookup_generate(model, None, prompt, 16, 0.0, eos_ids=eos).tokens == want
