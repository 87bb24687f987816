"""DFlash speculative decoding, the same-harness AR loop, transformers' peers, and evaluate_dataset.

Real models on the CPU: the session's micro Qwen3 target (trained a few steps,
float32) and a "sharp" randomly initialised Qwen3 with the same tokenizer
(weights scaled up so its greedy output varies; float64 so near-ties cannot flip
an argmax between a block forward and a one-token forward).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from dflashpipe.decode.speculative import ARDecoder, DecodeResult, DFlashDecoder, eos_ids_of
from dflashpipe.export.write import load_drafter, save_drafter
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
from dflashpipe.evaluate.lossless import check_lossless, default_tie_tolerance, logit_gap
from dflashpipe.inputs.target import load_target
from dflashpipe.jobs.errors import UserError

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BS = 4
PROMPTS = {
    "p-add": "What is 2+3? Give the answer.",
    "p-apples": "Tom has 5 apples and eats 2. How many are left?",
    "p-short": "Hi",
}


def encode(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def random_drafter(target, tok, out_dir, seed=0, dtype=None, **arch):
    """A randomly initialised drafter, round-tripped through the checkpoint format (DSpark: a Markov head
    strong enough to change drafts)."""
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BS, mask_token_id=tok.mask_token_id,
                                           **{"arch": "dflash", **arch})
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    if drafter.markov_head is not None:
        with torch.no_grad():
            for p in drafter.markov_head.parameters():
                p.normal_(0.0, 1.0)
    save_drafter(drafter, cfg, out_dir, target.config)
    return load_drafter(out_dir, dtype=dtype)


@pytest.fixture(scope="module")
def micro(micro_target, tmp_path_factory):
    target, tok = load_target(str(micro_target))
    drafter, cfg = random_drafter(target, tok, tmp_path_factory.mktemp("drafter") / "d")
    return target, tok, drafter, cfg


@pytest.fixture(scope="module")
def sharp_target(micro_target):
    from transformers import AutoTokenizer

    from dflashpipe.inputs.tiny_target import TinyTargetConfig, build_model

    tok = AutoTokenizer.from_pretrained(str(micro_target))
    target = build_model(
        TinyTargetConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, seed=1), tok
    )
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
    return target.to(torch.float64).eval().requires_grad_(False), tok


@pytest.fixture(scope="module")
def sharp(sharp_target, tmp_path_factory):
    target, tok = sharp_target
    drafter, cfg = random_drafter(target, tok, tmp_path_factory.mktemp("drafter") / "d", seed=1, dtype=torch.float64)
    return target, tok, drafter, cfg


@pytest.fixture(scope="module")
def sharp_dspark(sharp_target, tmp_path_factory):
    """The sharp target with a DSpark drafter: every block slot drafts (BS drafts), the Markov head over them."""
    target, tok = sharp_target
    drafter, cfg = random_drafter(target, tok, tmp_path_factory.mktemp("drafter") / "d", seed=1, dtype=torch.float64,
                                  arch="dspark", markov_rank=8)
    return target, tok, drafter, cfg


class OracleDecoder(DFlashDecoder):
    """Proposes the target's own greedy continuation, optionally corrupting one draft position per step."""

    def __init__(self, *args, reference: list[int], prompt_len: int, corrupt=None, **kw):
        super().__init__(*args, **kw)
        self.reference, self.prompt_len, self.corrupt, self.calls = reference, prompt_len, corrupt, 0

    def _propose(self, dcache, seq, last):
        n_out = len(seq) - self.prompt_len
        d = self.reference[n_out : n_out + self.n_drafts]
        d = d + [self.cfg.mask_token_id] * (self.n_drafts - len(d))
        if self.corrupt is not None:
            k = self.corrupt(self.calls)
            if k < self.n_drafts:
                d[k] = (d[k] + 1) % self.target.model.config.vocab_size
        self.calls += 1
        return torch.tensor(d, device=last.device)


class UnverifiedDecoder(DFlashDecoder):
    """BROKEN on purpose: commits every draft token without checking it against the target."""

    def _accept(self, draft, logits, temperature, gen):
        return self.n_drafts, draft.tolist() + [int(logits[-1].argmax())]


def _consistent(r: DecodeResult, max_new: int, drafts: int = BS - 1):
    assert r.target_forwards == r.verify_steps == len(r.accepted) == len(r.committed_raw)
    assert 1 + sum(r.committed) == len(r.tokens) <= max_new
    assert all(0 <= a <= drafts for a in r.accepted)
    assert all(c == a + 1 for c, a in zip(r.committed_raw, r.accepted))
    assert all(c <= raw for c, raw in zip(r.committed, r.committed_raw))
    assert r.tau >= 1 and r.tau_uncut >= r.tau
    assert r.prefill_s > 0 and r.decode_s > 0


@pytest.mark.parametrize("which", ["micro", "sharp", "sharp_dspark"])
def test_greedy_dflash_is_lossless(which, request):
    target, tok, drafter, cfg = request.getfixturevalue(which)
    eos = eos_ids_of(tok, target)
    dflash, ar = DFlashDecoder(target, drafter, cfg, eos), ARDecoder(target, eos)
    ids = list(PROMPTS)
    d_out = [dflash.generate(encode(tok, PROMPTS[i]), 24) for i in ids]
    a_out = [ar.generate(encode(tok, PROMPTS[i]), 24) for i in ids]
    check_lossless(ids, d_out, a_out)
    for r in d_out:
        _consistent(r, 24, cfg.num_drafts)
    for r in a_out:
        assert r.target_forwards == len(r.tokens) - 1 and r.tau == 1
    if which != "micro":
        assert len({t for r in a_out for t in r.tokens}) > 10  # a non-trivial output to be lossless about


def test_unverified_decoding_fails_the_lossless_check(sharp):
    target, tok, drafter, cfg = sharp
    eos = eos_ids_of(tok, target)
    broken, ar = UnverifiedDecoder(target, drafter, cfg, eos), ARDecoder(target, eos)
    ids = list(PROMPTS)
    b_out = [broken.generate(encode(tok, PROMPTS[i]), 16) for i in ids]
    a_out = [ar.generate(encode(tok, PROMPTS[i]), 16) for i in ids]
    assert b_out[0].tau_uncut == BS  # it "accepts" everything
    with pytest.raises(UserError, match=r"prompt id 'p-add'.*position \d+"):
        check_lossless(ids, b_out, a_out)
    # Tie-aware mode (as evaluate_dataset runs it in bf16) must still catch it: these are no near-ties.
    tol = default_tie_tolerance(torch.bfloat16)

    def near_tie(i, pos, d_tok, a_tok):
        g = logit_gap(target, encode(tok, PROMPTS[ids[i]]), a_out[i].tokens[:pos], a_tok, d_tok)
        return g if abs(g["gap"]) / g["scale"] <= tol else None

    with pytest.raises(UserError, match="prompt id 'p-add'"):
        check_lossless(ids, b_out, a_out, near_tie=near_tie)
    # A divergence the callback calls a near-tie is excused and reported.
    excused = check_lossless(ids, b_out, a_out, near_tie=lambda i, pos, d, a: {"gap": 0.0})
    assert [e["id"] for e in excused] == ids and all(e["dflash_token"] != e["ar_token"] for e in excused)
    # Naming: the first differing prompt, also when earlier ones agree.
    with pytest.raises(UserError, match="prompt id 'p-apples'"):
        check_lossless(ids, [a_out[0], b_out[1], b_out[2]], a_out)
    with pytest.raises(UserError, match="lengths 3 vs 2"):
        check_lossless(["x"], [[1, 2, 3]], [[1, 2]])


@pytest.mark.parametrize("cut", ["length", "eos"])
def test_oracle_drafter_accepts_whole_blocks(sharp, cut):
    target, tok, drafter, cfg = sharp
    prompt = encode(tok, PROMPTS["p-apples"])
    max_new = 1 + 3 * BS + 2
    # The target's greedy continuation, long enough to draft past the length limit, ignoring eos.
    reference = ARDecoder(target, []).generate(prompt, max_new + BS).tokens
    if cut == "length":
        stop = []
        want_committed = [BS, BS, BS, 2]
    else:
        # A token's first occurrence, mid-block (j % bs != 0), becomes the stop token: the output ends there.
        j = next(j for j in range(5, max_new) if j % BS and reference[j] not in reference[:j])
        stop = [reference[j]]
        full, rest = divmod(j, BS)
        want_committed = [BS] * full + ([rest] if rest else [])
    ar = ARDecoder(target, stop).generate(prompt, max_new)
    r = OracleDecoder(target, drafter, cfg, stop, reference=reference, prompt_len=len(prompt)).generate(prompt, max_new)
    assert r.tokens == ar.tokens
    assert r.stop_reason == cut
    assert r.committed == want_committed  # every step commits bs, except the cut last one
    assert r.accepted == [BS - 1] * len(want_committed)
    assert r.tau_uncut == BS  # counted before cutting
    assert r.tau == pytest.approx(sum(want_committed) / len(want_committed)) and r.tau < BS


@pytest.mark.parametrize("which", ["sharp", "sharp_dspark"])
def test_partially_wrong_drafts_crop_caches_correctly(which, request):
    """Step i corrupts draft i % (D+1) of D (D: none), so exactly that many are accepted; the output stays AR's
    (DSpark: D = bs drafts per block, one more than DFlash)."""
    target, tok, drafter, cfg = request.getfixturevalue(which)
    D = cfg.num_drafts
    prompt = encode(tok, PROMPTS["p-add"])
    reference = ARDecoder(target, []).generate(prompt, 40 + D + 1).tokens
    r = OracleDecoder(target, drafter, cfg, [], reference=reference, prompt_len=len(prompt),
                      corrupt=lambda i: i % (D + 1)).generate(prompt, 40)
    assert r.tokens == reference[:40]
    assert r.accepted == [min(i % (D + 1), D) for i in range(len(r.accepted))]
    assert max(r.accepted) == D
    _consistent(r, 40, D)


def test_sampled_mode_reproducible_and_valid(sharp):
    target, tok, drafter, cfg = sharp
    eos = eos_ids_of(tok, target)
    dflash, ar = DFlashDecoder(target, drafter, cfg, eos), ARDecoder(target, eos)
    V = target.config.vocab_size
    runs = {}
    for seed in (0, 0, 1):
        outs = [dflash.generate(encode(tok, PROMPTS[i]), 20, temperature=1.5, seed=seed) for i in PROMPTS]
        for r in outs:
            assert all(0 <= t < V for t in r.tokens) and 1 <= len(r.tokens) <= 20
            _consistent(r, 20)
        runs.setdefault(seed, []).append([r.tokens for r in outs])
    assert runs[0][0] == runs[0][1]  # same seed, same tokens
    assert runs[1][0] != runs[0][0]
    p = encode(tok, PROMPTS["p-add"])
    assert ar.generate(p, 20, temperature=1.5, seed=3).tokens == ar.generate(p, 20, temperature=1.5, seed=3).tokens


def test_speculative_sampling_rule_is_lossless(sharp):
    """With a one-hot drafter, committed tokens are distributed as the target's p (first and second position)."""
    target, tok, drafter, cfg = sharp
    dec = DFlashDecoder(target, drafter, cfg, [])
    V = target.config.vocab_size
    logits = torch.full((BS, V), -1e9, dtype=torch.float64)
    logits[:, :4] = torch.tensor([[0.0, 1.0, 0.5, -1.0], [1.0, 0.0, 0.0, 0.2], [0.0] * 4, [0.0] * 4], dtype=torch.float64)
    p = torch.softmax(logits, -1)[:, :4]
    draft = torch.tensor([1, 0, 3])
    gen = torch.Generator().manual_seed(0)
    n = 4000
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(n):
        a, toks = dec._accept(draft, logits, 1.0, gen)
        assert len(toks) == a + 1 and all(t < 4 for t in toks)
        first[toks[0]] += 1
        if a >= 1:  # the first draft (token 1) was accepted; the next token is then drawn from row 1
            second[toks[1]] += 1
    assert torch.allclose(first / n, p[0].float(), atol=0.03)
    assert torch.allclose(second / second.sum(), p[1].float(), atol=0.05)


def test_baselines_on_micro_target(micro, micro_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from conftest import PROMPTS as PROMPT_DIR
    from conftest import read_jsonl_gz
    from dflashpipe.evaluate.ar_draft import ARDraftConfig, train_ar_draft
    from dflashpipe.evaluate.baselines import assisted_generate, hf_generate, prompt_lookup_generate

    target, tok, _, _ = micro
    chats = [r["messages"] for r in read_jsonl_gz(PROMPT_DIR / "math_train.jsonl.gz", 16)]
    small = ARDraftConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                          seq_len=64, batch_size=4, warmup_steps=1, max_steps=4)
    m = train_ar_draft(chats, str(micro_target), str(tmp_path / "ar_draft"), small, log=lambda s: None)
    assert m["steps"] == 4
    draft = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ar_draft")).eval()
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 1
    eos = eos_ids_of(tok, target)
    prompt = encode(tok, PROMPTS["p-apples"])
    ar = ARDecoder(target, eos).generate(prompt, 20)
    for name, run in {
        "generate": lambda T: hf_generate(target, tok, prompt, 20, T, 0, eos),
        "prompt_lookup": lambda T: prompt_lookup_generate(target, tok, prompt, 20, T, 0, eos, num_tokens=5),
        "assisted": lambda T: assisted_generate(target, tok, draft, prompt, 20, T, 0, eos),
    }.items():
        r = run(0.0)
        assert r.tokens == ar.tokens, name  # greedy peers are lossless too
        assert r.target_forwards >= 1 and r.decode_tokens / r.target_forwards >= 1, name
        assert r.first_tokens + sum(r.committed) == len(r.tokens) and len(r.committed) == r.target_forwards, name
        assert r.decode_s > 0 and r.prefill_s > 0, name
        s = run(1.0)
        assert all(0 <= t < target.config.vocab_size for t in s.tokens) and s.decode_tokens / max(1, s.target_forwards) >= 1
    plain = hf_generate(target, tok, prompt, 20, 0.0, 0, eos)
    assert plain.decode_tokens == plain.target_forwards  # one token per forward


def test_evaluate_dataset_writes_samples_and_summary(micro, micro_target, tmp_path):
    from conftest import PROMPTS as PROMPT_DIR
    from conftest import read_jsonl_gz
    from dflashpipe.evaluate.ar_draft import ARDraftConfig, train_ar_draft
    from dflashpipe.evaluate.run import evaluate_dataset
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings

    target, tok, drafter, cfg = micro
    save_drafter(drafter, cfg, tmp_path / "drafter", target.config)
    rows = read_jsonl_gz(PROMPT_DIR / "math_heldout.jsonl.gz", 3)
    pd.DataFrame(
        {"id": [r["id"] for r in rows], "prompt": [r["messages"][:-1] for r in rows], "reference": [r["messages"][-1]["content"] for r in rows]}
    ).to_parquet(tmp_path / "prompts.parquet")
    small = ARDraftConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64,
                          seq_len=64, batch_size=2, warmup_steps=1, max_steps=2)
    train_ar_draft([r["messages"] for r in rows], str(micro_target), str(tmp_path / "ar"), small, log=lambda s: None)
    logs = []
    summary = evaluate_dataset(EvalRun(
        EvalSettings(max_new_tokens=12, num_prompts=2, prompt_lookup_num_tokens=4, timing_repeats=2),
        str(micro_target), str(tmp_path / "drafter"), str(tmp_path / "prompts.parquet"),
        str(tmp_path / "out" / "samples.parquet"), str(tmp_path / "out" / "summary.json"), ar_draft_dir=str(tmp_path / "ar"),
    ), log=logs.append)
    df = pd.read_parquet(tmp_path / "out" / "samples.parquet")
    assert sorted(df["method"].unique()) == ["ar", "assisted", "dflash", "hf_generate", "prompt_lookup"]
    assert len(df) == 10 and df["id"].nunique() == 2
    assert set(df["turn"]) == {1} and "category" not in df.columns  # a single-turn set: one turn, no groups
    for col in ("new_tokens", "decode_s", "tokens_per_s", "tau", "tau_uncut", "steps", "accept_lengths", "target_forwards"):
        assert col in df.columns
    assert df["matches_ar"].all()
    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["lossless"]["passed"] and summary["lossless"]["exact_matches"] == 2
    assert not {"turns", "categories", "n_samples", "skipped_turns"} & set(summary)
    dfl = summary["methods"]["dflash"]
    assert dfl["tau_mean"] >= 1 and dfl["tau_uncut_pooled"] >= dfl["tau_pooled"]
    assert sum(dfl["acceptance_histogram"]) == dfl["target_forwards"] and len(dfl["per_position_acceptance"]) == BS - 1
    for m, s in summary["methods"].items():
        assert s["tokens_per_target_forward"] >= 1 and s["peak_memory_bytes"] > 0 and s["speedup_vs_ar"] > 0, m
    assert summary["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    # every prompt timed twice per method; one row each, the run of median time
    assert {s["timing_repeats"] for s in summary["methods"].values()} == {2}
    assert {s["timing_rounds_mean"] for s in summary["methods"].values()} == {2}
    assert any("timed in 2-2 rounds" in line for line in logs)
    assert all(s["other_busy_cores"] is None or s["other_busy_cores"] >= 0 for s in summary["methods"].values())
    assert any("cores busy while the decodes were timed" in line or "load average" in line for line in logs)
    with pytest.raises(UserError, match="methods"):
        evaluate_dataset(EvalRun(EvalSettings(methods=["assisted"]), str(micro_target), str(tmp_path / "drafter"),
                                 str(tmp_path / "prompts.parquet"), str(tmp_path / "s2.parquet"), str(tmp_path / "s2.json")))


def test_evaluate_decodes_every_user_turn_after_ar_s_own_reply(micro, micro_target, tmp_path):
    """MT-Bench's layout (user, an assistant turn the target fills in, user; a category) through the prompts stage
    and evaluate_dataset: each turn is one sample row per method, turn 2's context holds AR's turn-1 reply, the
    lossless check compares both turns, and the summary reports per turn and per category."""
    from dflashpipe.evaluate.run import encode_prompt, evaluate_dataset, reply_text
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings
    from dflashpipe.inputs.data import prepare_prompts

    target, tok, drafter, cfg = micro
    save_drafter(drafter, cfg, tmp_path / "drafter", target.config)
    asks = [(PROMPTS["p-add"], "Now add 5 to that.", "math"), (PROMPTS["p-short"], "Say it again.", "writing"),
            ("What is 3 + 4?", "And 30 + 40?", "math")]
    rows = [{"id": f"q{k}", "messages": [{"role": "user", "content": t1}, {"role": "assistant", "content": None},
                                          {"role": "user", "content": t2}], "category": cat}
            for k, (t1, t2, cat) in enumerate(asks)]
    (tmp_path / "mt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = prepare_prompts({"path": str(tmp_path / "mt.jsonl"), "messages_column": "messages"}, "mt",
                         str(tmp_path / "prompts.parquet"))
    assert list(df["category"]) == ["math", "writing", "math"] and df["prompt"].map(len).tolist() == [3, 3, 3]
    out = tmp_path / "out"
    logs = []
    summary = evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=12, num_prompts=3, methods=["dflash", "ar"]),
                                       str(micro_target), str(tmp_path / "drafter"), str(tmp_path / "prompts.parquet"),
                                       str(out / "s.parquet"), str(out / "s.json")), log=logs.append)
    samples = pd.read_parquet(out / "s.parquet")
    assert len(samples) == 2 * 3 * 2 and set(samples["method"]) == {"dflash", "ar"}
    ar = samples[samples["method"] == "ar"]
    assert ar[["id", "turn", "category"]].values.tolist() == [
        ["q0", 1, "math"], ["q0", 2, "math"], ["q1", 1, "writing"], ["q1", 2, "writing"], ["q2", 1, "math"], ["q2", 2, "math"]]
    eos = eos_ids_of(tok, target)
    for k, (t1, t2, _) in enumerate(asks):  # turn 2 was decoded from turn 1, AR's own reply, turn 2
        first = ar[(ar["id"] == f"q{k}") & (ar["turn"] == 1)].iloc[0]
        context = [{"role": "user", "content": t1}, {"role": "assistant", "content": reply_text(tok, list(first["output_ids"]), eos)},
                   {"role": "user", "content": t2}]
        second = samples[(samples["id"] == f"q{k}") & (samples["turn"] == 2)]
        assert (second["prompt_tokens"] == len(encode_prompt(tok, context))).all()
        assert first["prompt_tokens"] == len(encode_prompt(tok, context[:1]))
    assert samples["matches_ar"].all()
    lossless = summary["lossless"]
    assert lossless["passed"] and lossless["n_prompts"] == 6 and lossless["exact_matches_per_turn"] == {"1": 3, "2": 3}
    dfl = summary["methods"]["dflash"]
    assert summary["n_prompts"] == dfl["n_prompts"] == 3 and dfl["n_samples"] == summary["n_samples"] == 6
    assert summary["skipped_turns"] == {}
    assert set(summary["turns"]) == {"1", "2"} and set(summary["categories"]) == {"math", "writing"}
    for groups, n in ((summary["turns"], {"1": 3, "2": 3}), (summary["categories"], {"math": 4, "writing": 2})):
        for g, per in groups.items():
            assert set(per) == {"dflash", "ar"} and per["dflash"]["n_samples"] == n[g], g
            assert per["dflash"]["tau_pooled"] >= 1 and per["dflash"]["speedup_vs_ar"] > 0
            assert per["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert summary["categories"]["math"]["dflash"]["n_prompts"] == 2
    # the turns' figures pool into the set's: decode tokens over decode time, turn by turn
    t1, t2 = summary["turns"]["1"]["dflash"], summary["turns"]["2"]["dflash"]
    assert min(t1["tau_pooled"], t2["tau_pooled"]) <= dfl["tau_pooled"] <= max(t1["tau_pooled"], t2["tau_pooled"])
    assert any("6 user turns" in line for line in logs)
    # evaluate.turns: first: the first turns only, as a single-turn set (no per-turn entries)
    first_only = evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=12, num_prompts=3, methods=["dflash", "ar"], turns="first"),
                                          str(micro_target), str(tmp_path / "drafter"), str(tmp_path / "prompts.parquet"),
                                          str(out / "f.parquet"), str(out / "f.json")))
    assert "turns" not in first_only and set(first_only["categories"]) == {"math", "writing"}
    f = pd.read_parquet(out / "f.parquet")
    assert set(f["turn"]) == {1} and len(f) == 6
    assert (f.set_index(["id", "method"])["output_ids"].map(list).sort_index()
            == samples[samples["turn"] == 1].set_index(["id", "method"])["output_ids"].map(list).sort_index()).all()
    # a later turn that does not fit the target's context (4096) is left out and counted; its first turn counts
    long = [{"role": "user", "content": PROMPTS["p-add"]}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "seven " * 5000}]
    pd.DataFrame({"id": ["long"], "prompt": [long], "reference": [None]}).to_parquet(tmp_path / "long.parquet")
    cut = evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=12, methods=["dflash", "ar"]), str(micro_target),
                                   str(tmp_path / "drafter"), str(tmp_path / "long.parquet"), str(out / "l.parquet"),
                                   str(out / "l.json")))
    assert cut["skipped_turns"] == {"skipped_prompt_too_long": 1} and set(cut["turns"]) == {"1"} and cut["n_samples"] == 1


def test_evaluate_skips_unusable_prompts_and_keeps_a_failed_check(micro, micro_target, tmp_path, monkeypatch):
    """An empty prompt and one longer than the target's context (4096) never enter the tables;
    a failed lossless check keeps its samples and summary for inspection (Snakemake removes
    the job's outputs)."""
    import dflashpipe.evaluate.run as run
    from dflashpipe.evaluate.settings import EvalRun, EvalSettings

    target, tok, drafter, cfg = micro
    save_drafter(drafter, cfg, tmp_path / "drafter", target.config)
    turns = [[{"role": "user", "content": PROMPTS["p-add"]}], [{"role": "user", "content": "  "}],
             [{"role": "user", "content": "seven " * 5000}], [{"role": "user", "content": PROMPTS["p-short"]}]]
    pd.DataFrame({"id": ["ok", "empty", "long", "ok2"], "prompt": turns, "reference": [None] * 4}).to_parquet(tmp_path / "p.parquet")
    out = tmp_path / "eval"
    args = (str(micro_target), str(tmp_path / "drafter"), str(tmp_path / "p.parquet"), str(out / "d.samples.parquet"),
            str(out / "d.summary.json"))
    s = run.evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=6, methods=["dflash", "ar"]), *args), log=lambda m: None)
    assert s["n_prompts"] == 2 and s["skipped_prompts"] == {"skipped_empty_prompt": 1, "skipped_prompt_too_long": 1}
    assert set(pd.read_parquet(out / "d.samples.parquet")["id"]) == {"ok", "ok2"}

    def diverges(ids, *a, **k):
        raise UserError(f"lossless check failed: prompt id {ids[0]!r} diverges from AR")

    monkeypatch.setattr(run, "check_lossless", diverges)
    for f in out.glob("d.*"):
        f.unlink()
    with pytest.raises(UserError, match=r"diverges from AR; samples and summary kept for inspection: .*failed/d\.samples\.parquet") as e:
        run.evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=6, methods=["dflash", "ar"], lossless="exact"), *args),
                             log=lambda m: None)
    assert "\n" not in str(e.value)
    kept = json.loads((out / "failed/d.summary.json").read_text())
    assert kept["lossless"]["passed"] is False and len(pd.read_parquet(out / "failed/d.samples.parquet")) == 4
    assert not (out / "d.summary.json").exists()  # nothing that looks like a finished evaluation

    pd.DataFrame({"id": ["e"], "prompt": [turns[1]], "reference": [None]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(UserError, match=r"p.parquet: no prompt to evaluate \(1 rows; skipped \{'skipped_empty_prompt': 1\}\)"):
        run.evaluate_dataset(EvalRun(EvalSettings(max_new_tokens=6, methods=["dflash", "ar"]), *args), log=lambda m: None)


@pytest.mark.parametrize("which,attention", [("micro", "auto"), ("sharp", "auto"), ("sharp_dspark", "auto"),
                                             ("sharp", "flex"), ("sharp_dspark", "flex")])
def test_static_target_step_decodes_what_the_dynamic_one_does(which, attention, request):
    """The static-KV target step (CUDA graphs on a GPU; uncaptured here; its layers written out with
    fused projections) gives the same greedy tokens, the same accepted drafts per verify step, and
    the same logits as HF with a DynamicCache; also with the compiled steps' flex attention (its live
    key blocks and masks; eager here) in the target's steps of 1 and D+1 tokens and the drafter's."""
    from dflashpipe.decode.speculative import TargetRunner, drafter_runner, target_runner
    from dflashpipe.decode.static_target import StaticTargetRunner

    target, tok, drafter, cfg = request.getfixturevalue(which)
    eos = eos_ids_of(tok, target)
    static = StaticTargetRunner(target, cfg.target_layer_ids, capacity=256, graph_sizes=(1, cfg.num_drafts + 1),
                                attention=attention)
    draft = drafter_runner(drafter, static, "auto", capacity=256)  # one cache each, reused for every prompt
    flex = "+flex" if attention == "flex" else ""  # auto: flex only when compiled
    assert draft.mode == "static" + flex and drafter_runner(drafter, TargetRunner(target)).mode == "eager"
    # a Qwen3: its layers written out with q/k/v and gate/up fused (dflashpipe.decode.layer)
    assert static.mode == "static+fused" + flex and target_runner(target, "auto").mode == "dynamic"  # auto: compiled only on a GPU
    assert target_runner(target, "static").mode == target_runner(target, "compiled").mode == "static+fused"  # no graphs: no compile
    # flex's masks hold one key block of queries: a longer step attends with SDPA
    assert StaticTargetRunner(target, capacity=256, graph_sizes=(1, 129), attention=attention).mode == "static+fused"
    ids = encode(tok, PROMPTS["p-apples"])
    ref_logits, ref_feats = TargetRunner(target, cfg.target_layer_ids).forward(
        TargetRunner(target).new_cache(), torch.tensor([ids]), 0, features=True)
    logits, feats = static.forward(static.new_cache(), torch.tensor([ids]), 0, features=True)
    tol = dict(atol=1e-4, rtol=1e-4) if which == "micro" else dict(atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(logits, ref_logits, **tol)
    torch.testing.assert_close(feats, ref_feats, **tol)
    ar_static = ARDecoder(target, eos, runner=StaticTargetRunner(target, capacity=256, attention=attention))  # reused
    for p in PROMPTS.values():
        prompt = encode(tok, p)
        a_dyn = ARDecoder(target, eos).generate(prompt, 24)
        a_sta = ar_static.generate(prompt, 24)
        assert a_sta.tokens == a_dyn.tokens
        d_dyn = DFlashDecoder(target, drafter, cfg, eos).generate(prompt, 24)
        d_sta = DFlashDecoder(target, drafter, cfg, eos, runner=static, draft_runner=draft).generate(prompt, 24)
        assert d_sta.tokens == d_dyn.tokens == a_dyn.tokens and d_sta.accepted == d_dyn.accepted


@pytest.mark.parametrize("which,attention", [("sharp", "sdpa"), ("sharp_dspark", "sdpa"), ("sharp", "flex")])
def test_static_drafter_hides_rejected_positions_like_the_growing_cache(which, attention, request):
    """Blocks verified with 1..D+1 kept positions: the static drafter (whole verified block written, the
    rejected tail hidden, then overwritten) drafts exactly what the eager drafter with its growing cache drafts;
    also with the compiled pieces' flex attention (eager here): the context's live blocks past the first."""
    from dflashpipe.decode.speculative import DrafterRunner
    from dflashpipe.decode.static_drafter import StaticDrafterRunner

    import copy

    target, tok, drafter, cfg = request.getfixturevalue(which)
    verified = cfg.num_drafts + 1
    drafter = copy.deepcopy(drafter)
    with torch.no_grad():  # a drafter whose drafts depend on its context (the fixture's barely does)
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.mul_(50.0)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    eager = DrafterRunner(drafter, embed, head, cfg.mask_token_id)
    static = StaticDrafterRunner(drafter, embed, head, cfg.mask_token_id, capacity=256, attention=attention)
    caches = eager.new_cache(), static.new_cache()
    g = torch.Generator().manual_seed(0)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    prompt = torch.randn(1, 125, width, generator=g, dtype=torch.float64)  # blocks from the second key block on
    for runner, cache in zip((eager, static), caches):
        runner.extend(cache, prompt, 0, 125)
    n, drafts = 126, set()
    for keep in (1, verified, 2, 3, 1, verified):
        last = torch.randint(5, target.config.vocab_size, (1, 1), generator=g)
        a, b = (runner.propose(cache, n, last) for runner, cache in zip((eager, static), caches))
        assert a.tolist() == b.tolist()
        drafts.add(tuple(a.tolist()))
        feats = torch.randn(1, verified, width, generator=g, dtype=torch.float64)  # the verify's features
        for runner, cache in zip((eager, static), caches):
            runner.extend(cache, feats, n - 1, keep)
        n += keep
    assert len(drafts) > 1  # the drafts depend on the context: a real comparison
