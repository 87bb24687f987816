"""The batched expansion backend (continuous batching over a static KV cache) against transformers.

Real models on the CPU: the micro target's config and tokenizer with random
weights (replies that vary from token to token), in float64 for the token-level
comparison so that no near-tie can flip an argmax between two attention codes.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import PROMPTS
from dflashpipe.decode.slots import SlotDecoder, unsupported_reason
from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.stages.expand import ExpandSettings, expand_prompts

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model64(random_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float64).eval()


def hf_greedy(model, prompt, n, end_ids):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, temperature=None, top_p=None,
                         top_k=None, eos_token_id=sorted(end_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("slots", [3, 16])
def test_greedy_equals_transformers_token_for_token_with_rows_reused(model64, slots):
    """7 prompts of different lengths. 3 rows: rows are refilled mid-run, prompts prefilled in groups;
    16 rows: every step computes only the busy rows (8 of 16, padded with a free one), caches gathered."""
    g = torch.Generator().manual_seed(0)
    vocab = model64.config.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1, 12, 25)]
    free = [hf_greedy(model64, p, 20, set()) for p in prompts[:2]]
    end_ids = {free[0][5], free[1][9]}  # tokens these replies produce mid-way: some requests stop early
    dec = SlotDecoder(model64, slots=slots, capacity=64)
    assert dec.mode == "slots+dense+fused" and unsupported_reason(model64) is None
    assert dec._bucket(7) == (3 if slots == 3 else 8) and dec._bucket(slots) == slots
    got = dec.generate(prompts, 20, end_ids)
    for p, (ids, finish) in zip(prompts, got):
        ref = hf_greedy(model64, p, 20, end_ids)
        assert ids == ref
        assert finish == ("stop" if ref[-1] in end_ids else "length")
    assert {f for _, f in got} == {"stop", "length"}  # both ways of ending were exercised
    assert dec.generate(prompts, 20, end_ids) == got  # the reused cache holds nothing stale that matters


@pytest.mark.parametrize("slots,compile", [(3, False), (16, False), (16, True)])
def test_flex_attention_reads_only_the_live_blocks(random_target, slots, compile):
    """The GPU default (compiled flex_attention with a block mask; float32: flex has no float64): every
    cache position outside the rows' live blocks is NaN, so one read of it poisons the reply. Flex
    decodes the transformers replies through it; the dense attention (which reads the whole capacity)
    does not, so the poison is where a full read would hit. Compiled (Inductor on the steps, as on a
    GPU): one decoder layer as one graph for every layer, compiled once per row count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 7, 12, 1, 9, 5, 10, 2, 8, 12, 4)]
    new = [14, 6, 10, 14, 3, 12, 8, 14, 5, 9, 14, 7]  # rows finish one after another
    block = 16  # every position stays below 2 blocks (prompt <= 12 + 14 new)

    def poisoned(attention, compile=False):
        dec = SlotDecoder(model, slots=slots, capacity=64, attention=attention, kv_block=block, compile=compile)
        for t in dec.k + dec.v:
            t.zero_()
            t[:, :, 2 * block:] = float("nan")
        return dec

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    flex = poisoned("flex", compile)
    assert flex.mode == "slots+flex" + ("+compiled" if compile else "") + "+fused" and flex.capacity == 64
    got = flex.generate(prompts, new, set())
    assert set(flex.step_counts) == ({16, 8} if slots == 16 else {3})  # 16 rows: full and partial steps
    if compile:  # one decoder layer, shared by every layer: one graph per row count (16 and 8)
        assert model.config.num_hidden_layers > 1 and counters["stats"]["unique_graphs"] == 2
    assert [ids for ids, _ in got] == [hf_greedy(model, p, n, set()) for p, n in zip(prompts, new)]
    assert poisoned("dense").generate(prompts, new, set()) != got


def test_sampling_is_seeded_and_respects_top_p(model64):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, model64.config.vocab_size, (8,), generator=g).tolist() for _ in range(4)]
    dec = SlotDecoder(model64, slots=2, capacity=48)
    a = dec.generate(prompts, 12, set(), temperature=1.0, top_p=0.9, seed=5)
    assert a == dec.generate(prompts, 12, set(), temperature=1.0, top_p=0.9, seed=5)
    assert a != dec.generate(prompts, 12, set(), temperature=1.0, top_p=0.9, seed=6)
    # top_p that keeps only the most likely token is greedy
    assert dec.generate(prompts, 12, set(), temperature=1.0, top_p=1e-9, seed=5) == dec.generate(prompts, 12, set())


def test_batched_backend_expands_like_the_embedded_one(random_target, tmp_path):
    """Through expand_prompts (float32, greedy): same replies, ids, lengths and finish reasons."""
    prompts = tmp_path / "p.parquet"
    prepare_prompts({"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 6}, "math",
                    str(prompts))
    settings = dict(max_new_tokens=16, batch_size=4, chunk_size=3, temperature=0.0)
    frames = {}
    for backend in ("embedded", "batched"):
        out = tmp_path / f"{backend}.parquet"
        expand_prompts(str(prompts), str(random_target), ExpandSettings(**settings, backend=backend), str(out),
                       log=lambda m: None)
        frames[backend] = pd.read_parquet(out).set_index(["id", "sample"]).sort_index()
    a, b = frames["embedded"], frames["batched"]
    cols = ["response", "num_prompt_tokens", "num_new_tokens", "finish_reason"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert [list(x) for x in a["token_ids"]] == [list(x) for x in b["token_ids"]]
    assert (a["num_new_tokens"] > 0).all()


def test_top_p_keeps_the_tokens_transformers_keeps():
    """Sampling's support: the tokens top_p_filter leaves probability on are those transformers'
    TopPLogitsWarper keeps (random logits, several thresholds), at least one always; samples stay in it."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from dflashpipe.decode.slots import top_p_filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3
    for top_p in (0.05, 0.5, 0.9, 0.999):
        ours = top_p_filter(torch.softmax(logits, dim=-1), top_p) > 0
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        assert torch.equal(ours, theirs), top_p
        assert ours.any(dim=-1).all() and not ours.all()
        samples = {int(SlotDecoder._choose(logits, 1.0, top_p, torch.Generator().manual_seed(k))[0]) for k in range(30)}
        assert all(ours[0, t] for t in samples)


def test_one_long_prompt_does_not_size_every_row(random_target, tmp_path):
    """A shard of short prompts and one long one (a real math prompt repeated to ~1,200 tokens): the short
    ones decode through a cache sized for them, the long one through a cache of its own, also in the
    chunks after it; replies equal the embedded backend's (transformers generate), token for token."""
    import json

    rows = [json.loads(line) for line in __import__("gzip").open(PROMPTS / "math_train.jsonl.gz", "rt")][:7]
    long_q = " ".join([rows[0]["messages"][0]["content"]] * 12)
    rows[2] = {**rows[2], "messages": [{"role": "user", "content": long_q}]}
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "p.parquet"
    prepare_prompts({"path": str(src), "messages_column": "messages"}, "math", str(prompts))
    settings = dict(max_new_tokens=12, batch_size=4, chunk_size=4, temperature=0.0)  # chunks: rows 0-3 and 4-6
    frames, logs = {}, []
    for backend in ("embedded", "batched"):
        out = tmp_path / f"{backend}.parquet"
        expand_prompts(str(prompts), str(random_target), ExpandSettings(**settings, backend=backend), str(out),
                       log=logs.append)
        frames[backend] = pd.read_parquet(out).set_index(["id", "sample"]).sort_index()
    a, b = frames["embedded"], frames["batched"]
    assert [list(x) for x in a["token_ids"]] == [list(x) for x in b["token_ids"]]
    longest, second = b["num_prompt_tokens"].nlargest(2)
    assert longest > 1000 and second < 300
    caches = [int(m.split(" x ")[1].split()[0]) for m in logs if m.startswith("batched decoding:")]
    long_cache = -(-(longest + 12) // 256) * 256
    # chunk 1: its short prompts, then the long one alone; chunk 2: a cache for short prompts again
    assert len(caches) == 3 and caches[1] == long_cache and max(caches[0], caches[2]) <= -(-(second + 12) // 256) * 256


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_fused_projections_share_the_weights_and_leave_the_model_unchanged(model_type):
    """q/k/v and gate/up become one matrix each: the modules' weights (and Qwen2's q/k/v biases) are
    views into them, so no memory is added and HF's own forward gives the same logits; fusing
    again changes nothing; the written-out layer (fused matmuls) gives HF's logits too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflashpipe.decode.layer import fuse_projections
    from dflashpipe.decode.static_target import StaticTargetRunner

    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        before = model(ids).logits

    def storages():
        return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}

    fuse_projections(model)
    fused_bytes = sum(storages().values())
    fuse_projections(model)
    assert sum(storages().values()) == fused_bytes  # idempotent
    assert fused_bytes == sum(p.numel() * p.element_size() for p in model.parameters())  # the storages hold the parameters, no more
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.v_proj.weight.untyped_storage().data_ptr() == a.qkv_weight.data_ptr()
    assert m.up_proj.weight.untyped_storage().data_ptr() == m.gate_up_weight.data_ptr()
    assert (a.qkv_bias is not None) == (model_type == "qwen2")
    assert "qkv_weight" not in model.state_dict()  # the export and checkpoints see the model's own keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-12, rtol=1e-12)
        runner = StaticTargetRunner(model, capacity=32)
        assert runner.mode == "static+fused"
        logits, _ = runner.forward(runner.new_cache(), ids, 0)
    torch.testing.assert_close(logits, before[0].float(), atol=1e-6, rtol=1e-6)


def test_fused_projections_follow_a_load_state_dict_after_to():
    """After ``.to()`` the projections are copies, no longer views of the fused matrices; loading other
    weights then (a library user's fine-tune) must reach the fused matmuls too (before: q/k/v off by up to 1.9 here)."""
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflashpipe.decode.layer import fuse_projections

    cfg = AutoConfig.for_model("qwen2", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # qwen2: q/k/v biases too
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).eval()
    fuse_projections(model)
    model.to(torch.float32)
    tuned = {k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items() if "_proj." in k}
    model.load_state_dict(tuned, strict=False)
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    h = torch.randn(1, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(F.linear(h, a.qkv_weight, a.qkv_bias), torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], -1))
        torch.testing.assert_close(F.linear(h, m.gate_up_weight), torch.cat([m.gate_proj(h), m.up_proj(h)], -1))
    assert a.k_proj.weight.untyped_storage().data_ptr() == a.qkv_weight.data_ptr()  # views again: no second copy
    torch.testing.assert_close(a.q_proj.weight, tuned["model.layers.0.self_attn.q_proj.weight"])


def test_quantised_projections_keep_hf_layers():
    """A target whose projections are not plain floating-point linears (FP8 here) is not written out:
    the static step runs HF's layer modules on it, and nothing is fused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflashpipe.decode.layer import written_out_reason
    from dflashpipe.decode.static_target import StaticTargetRunner
    from dflashpipe.drafter.fp8 import quantize_decoder_linears

    cfg = AutoConfig.for_model("qwen3", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    assert written_out_reason(model) is None
    stand_in = type("M", (), {"config": cfg})()  # what the expansion asks before loading the weights
    assert written_out_reason(stand_in) is None
    cfg.quantization_config = {"quant_method": "fp8"}
    assert "quantised" in written_out_reason(stand_in)
    del cfg.quantization_config
    quantize_decoder_linears(model)
    assert "Fp8Linear projections" in written_out_reason(model)
    runner = StaticTargetRunner(model, capacity=16)
    assert runner.mode == "static" and not hasattr(model.model.layers[0].self_attn, "qkv_weight")
    logits, _ = runner.forward(runner.new_cache(), torch.tensor([[1, 2, 3]]), 0)
    assert logits.shape == (3, 97) and torch.isfinite(logits).all()
