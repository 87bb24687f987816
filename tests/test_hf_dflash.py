"""The exported drafter in transformers' own DFlash generation (``speculation_type="dflash"``).

transformers' drafter class is ``MuseGlimmerAssistantModel``; the export maps onto
it by a config translation and two renames (``fc`` -> ``encoder.fc``,
``hidden_norm`` -> ``encoder.output_norm_enc``). Checked here on the CPU, in
float64 (so a block forward and a one-token forward cannot round a near-tie
differently): the assistant computes what our drafter computes; with a drafter
trained to accept part of its drafts, transformers' greedy DFlash output equals
plain greedy decoding and it verifies exactly as often, step for step, as this
pipeline's loop (decode/speculative.py); and the evaluator's ``hf_dflash``
method runs, or is skipped with its reason recorded.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from dflashpipe.export.write import load_drafter, save_drafter
from dflashpipe.evaluate.hf_assistant import (
    RENAMES,
    export_hf_assistant,
    load_hf_assistant,
    unavailable_reason,
)
from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder
from dflashpipe.drafter.masks import block_position_ids, build_block_inputs, dense_mask
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
from dflashpipe.evaluate.baselines import hf_dflash_generate

torch.set_num_threads(1)
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]

V, BS, MASK, EOS = 101, 4, 100, 3
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34], [40, 41]]
TRAINED_ON = 3  # the drafter learns the target's continuations of the first three prompts only


def target_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=256, eos_token_id=EOS)


class Tok:
    """What ``generate`` needs of a tokenizer here."""

    pad_token_id = None
    eos_token_id = EOS


@pytest.fixture(scope="module")
def target():
    """A random Qwen3 with scaled-up weights (a varied greedy output), float64."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(target_config()).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
    return model.to(torch.float64)


def train_drafter(target, cfg, steps: int = 80) -> DFlashDrafter:
    """Fit a drafter to the target's greedy continuations of the first prompts (partly: some drafts fail)."""
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).to(torch.float64)
    emb, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    batches = []
    for p in PROMPTS[:TRAINED_ON]:
        ids = torch.tensor([p + ARDecoder(target, []).generate(p, 24 + BS).tokens])
        S = ids.shape[1]
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)
        loss_mask = torch.zeros(1, S, dtype=torch.bool)
        loss_mask[0, len(p) - 1 :] = True
        anchors = torch.arange(len(p) - 1, S - 1).view(1, -1)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        block_ids, labels, weights = build_block_inputs(ids, loss_mask, anchors, keep, BS, MASK)
        with torch.no_grad():
            block_embeds = emb(block_ids)
        batches.append((feats, block_embeds, block_position_ids(anchors, S, BS), dense_mask(anchors, keep, S, BS), labels, weights))
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        for feats, block_embeds, pos, mask, labels, weights in batches:
            logits = drafter(block_embeds, feats, pos, mask) @ head.t()
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
            ((ce * weights.flatten()).sum() / weights.sum()).backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BS, mask_token_id=MASK, arch="dflash")
    out = save_drafter(train_drafter(target, cfg), cfg, tmp_path_factory.mktemp("drafter") / "d", target.config)
    drafter, cfg = load_drafter(out, dtype=torch.float64)
    return out, drafter, cfg, load_hf_assistant(out, dtype=torch.float64)


def test_assistant_computes_what_our_drafter_computes(target, tmp_path):
    from transformers import AutoModel

    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=2, block_size=BS, mask_token_id=MASK, arch="dflash")
    torch.manual_seed(2)
    out = save_drafter(DFlashDrafter(cfg), cfg, tmp_path / "d", target.config)
    ours, cfg = load_drafter(out, dtype=torch.float64)
    assistant = load_hf_assistant(out, dtype=torch.float64)
    ours_keys = set(ours.state_dict())
    assert set(assistant.state_dict()) == {RENAMES.get(k, k) for k in ours_keys}  # only fc and hidden_norm move
    assert RENAMES.keys() <= ours_keys
    c = assistant.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (BS, MASK, cfg.target_layer_ids)
    assert c.layer_types == ["full_attention"] * 2 and c.rope_parameters["rope_theta"] == cfg.rope_theta

    g = torch.Generator().manual_seed(3)
    S = 9
    feats = torch.randn(1, S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g, dtype=torch.float64)
    block = torch.randn(1, BS, cfg.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        cache = ours.new_cache()
        ours.extend_context(cache, feats, torch.arange(S).view(1, -1))
        want = ours.draft(cache, block, torch.arange(S, S + BS).view(1, -1))
        got = assistant(noise_embeds=block, context_hidden_states=feats, position_ids=torch.arange(S + BS).view(1, -1)).last_hidden_state
    assert torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()

    # the exported directory loads through AutoModel, without remote code, to the same network
    hf_dir = export_hf_assistant(out, tmp_path / "hf")
    conf = json.loads((hf_dir / "config.json").read_text())
    assert conf["model_type"] == "muse_glimmer_assistant" and conf["architectures"] == ["MuseGlimmerAssistantModel"]
    loaded = AutoModel.from_pretrained(hf_dir, dtype=torch.float64).eval()
    assert type(loaded).__name__ == "MuseGlimmerAssistantModel"
    with torch.no_grad():
        again = loaded(noise_embeds=block, context_hidden_states=feats, position_ids=torch.arange(S + BS).view(1, -1)).last_hidden_state
    assert torch.allclose(again, want, atol=1e-10, rtol=0)


def test_transformers_dflash_is_lossless_and_verifies_as_often_as_ours(target, trained):
    _, drafter, cfg, assistant = trained
    accepted = []
    for prompt in PROMPTS:
        # stop token EOS; MASK as the only "stop" (never generated): runs to the length limit, also mid-block
        for eos, max_new in (([EOS], 24), ([MASK], 24), ([MASK], 7)):
            ar = ARDecoder(target, eos).generate(prompt, max_new)
            ours = DFlashDecoder(target, drafter, cfg, eos).generate(prompt, max_new)
            hf = hf_dflash_generate(target, Tok(), assistant, prompt, max_new, 0.0, 0, eos)
            where = f"prompt {prompt}, stop {eos}, max_new {max_new}"
            assert hf.tokens == ar.tokens == ours.tokens, where  # greedy: lossless
            assert hf.target_forwards == ours.target_forwards == ours.verify_steps, where  # verify steps
            assert hf.committed == ours.committed, where  # the same tokens per verify step
            assert hf.stop_reason == ours.stop_reason, where
            accepted += ours.accepted
    # non-trivial: whole blocks accepted on the prompts it learned, nothing on the others
    assert max(accepted) == BS - 1 and min(accepted) == 0


def test_evaluator_runs_hf_dflash_or_records_why_not(micro_target, tmp_path, monkeypatch):
    import dflashpipe.evaluate.hf_assistant as hfa
    from conftest import PROMPTS as PROMPT_DIR
    from conftest import read_jsonl_gz
    from dflashpipe.evaluate.run import evaluate_dataset
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings
    from dflashpipe.inputs.target import load_target

    tgt, tok = load_target(str(micro_target))
    cfg = DrafterConfig.from_target_config(tgt.config, num_hidden_layers=1, block_size=BS,
                                            mask_token_id=tok.mask_token_id, arch="dflash")
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter", tgt.config)
    rows = read_jsonl_gz(PROMPT_DIR / "math_heldout.jsonl.gz", 2)
    pd.DataFrame({"id": [r["id"] for r in rows], "prompt": [r["messages"][:-1] for r in rows],
                  "reference": [None] * 2}).to_parquet(tmp_path / "p.parquet")

    def run(name, log):
        return evaluate_dataset(EvalRun(
            EvalSettings(max_new_tokens=8, methods=["dflash", "hf_dflash"], warmup=False), str(micro_target),
            str(tmp_path / "drafter"), str(tmp_path / "p.parquet"), str(tmp_path / f"{name}.parquet"),
            str(tmp_path / f"{name}.json"),
        ), log=log.append)

    s = run("on", [])
    assert list(s["methods"]) == ["dflash", "ar", "hf_dflash"] and s["skipped_methods"] == {}
    m = s["methods"]["hf_dflash"]
    assert m["matches_ar"] == 1.0 and m["tokens_per_target_forward"] >= 1 and m["speculation_type"] == "dflash"
    assert m["assistant"] == "MuseGlimmerAssistantModel"
    assert set(pd.read_parquet(tmp_path / "on.parquet")["method"]) == {"dflash", "ar", "hf_dflash"}

    reason = "transformers 5.14.0 has no DFlash speculative generation (lacks MuseGlimmerAssistantModel)"
    monkeypatch.setattr(hfa, "unavailable_reason", lambda: reason)
    log = []
    s = run("off", log)
    assert list(s["methods"]) == ["dflash", "ar"] and s["skipped_methods"] == {"hf_dflash": reason}
    assert json.loads((tmp_path / "off.json").read_text())["skipped_methods"] == {"hf_dflash": reason}
    assert any(line.startswith("skipping method hf_dflash: transformers 5.14.0") for line in log)
    assert set(pd.read_parquet(tmp_path / "off.parquet")["method"]) == {"dflash", "ar"}
