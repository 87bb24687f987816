"""Batched greedy AR and DFlash (continuous batching over a slotted static KV cache) against batch 1.

The micro target's config with seeded random weights (replies that vary from token to token), in
float64 so that no near-tie can flip an argmax between a batched block forward and a one-token
forward: every row must decode exactly what batch-1 AR decodes for its prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from dflashpipe.decode.batched import BatchedDecoder, BatchSettings, SlotDrafter, forced_acceptance
from dflashpipe.decode.speculative import ARDecoder, DFlashDecoder, DrafterRunner
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BS = 4
NEW = 16
LENGTHS = (3, 17, 9, 30, 1, 12, 25)  # mixed prompt lengths


@pytest.fixture(scope="module")
def model64(random_target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float64).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def case(model64):
    """7 prompts, end tokens that stop two replies mid-way, and every prompt's batch-1 AR reply."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, model64.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    free = [ARDecoder(model64, []).generate(p, NEW).tokens for p in prompts[:2]]
    eos = [free[0][5], free[1][9]]
    ref = [ARDecoder(model64, eos).generate(p, NEW) for p in prompts]
    assert {r.stop_reason for r in ref} == {"eos", "length"}  # both ways of ending are exercised
    return prompts, eos, ref


def test_ar_reads_tokens_back_in_chunks_with_the_same_output(model64):
    """AR reads its tokens back every READ_EVERY forwards: an end token anywhere in a chunk (first, last,
    across a boundary) and a token budget that is no multiple of it still end the output where one
    token at a time would: at the first end token (kept) or at max_new_tokens."""
    prompt = list(range(5, 16))
    free = ARDecoder(model64, []).generate(prompt, 21).tokens
    assert len(free) == 21 and ARDecoder.READ_EVERY == 8
    for i in (0, 6, 7, 8, 9, 15, 16, 20):
        got = ARDecoder(model64, [free[i]]).generate(prompt, 21)
        first = free.index(free[i])
        assert got.tokens == free[: first + 1] and got.stop_reason == "eos"
        assert got.target_forwards == first and got.committed == [1] * first
    for budget in (1, 7, 8, 9, 13):
        got = ARDecoder(model64, []).generate(prompt, budget)
        assert got.tokens == free[:budget] and got.stop_reason == "length"


def make_drafter(model, seed=0, **arch):
    cfg = DrafterConfig.from_target_config(model.config, num_hidden_layers=2, block_size=BS, mask_token_id=3, **arch)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # large weights: drafts that change with the context (and with DSpark's Markov head
        for name, p in drafter.named_parameters():  # and DFlash 2's candidate selector)
            if p.dim() >= 2 and "conv" not in name:
                p.normal_(0.0, 0.5 if "proj" in name or "fc" in name else 1.0)
    return drafter.to(torch.float64).eval()


def assert_like_ar(run, ref):
    for i, (got, want) in enumerate(zip(run.results, ref)):
        assert got.tokens == want.tokens, f"prompt {i}"
        assert got.stop_reason == want.stop_reason


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_batched_ar_equals_batch1_ar(model64, case, slots):
    """1 and 3 rows: more prompts than rows (rows reused); 8: one row stays free (decodes garbage)."""
    prompts, eos, ref = case
    dec = BatchedDecoder(model64, BatchSettings(slots=slots, max_new_tokens=NEW), eos)
    run = dec.generate(prompts)
    assert_like_ar(run, ref)
    assert max(run.busy_rows) == min(slots, len(prompts)) and run.steps >= NEW - 1
    assert dec.mode == "slots+dense"
    assert [r.tokens for r in dec.generate(prompts).results] == [r.tokens for r in run.results]  # reused buffers


@pytest.mark.parametrize("arch", ["dflash", "dflash2", "dspark", "sliding"])
@pytest.mark.parametrize("slots", [1, 3])
def test_batched_dflash_equals_batch1_ar_and_drafts_as_batch1(model64, case, arch, slots):
    """A random drafter through the real path (features, per-row contexts): lossless, and each row's
    acceptance per step is batch-1 DFlash's (so each row drafted what batch 1 drafts)."""
    prompts, eos, ref = case
    sliding = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    kw = {"arch": arch} if arch != "sliding" else sliding
    drafter = make_drafter(model64, **kw)
    run = BatchedDecoder(model64, BatchSettings(slots=slots, max_new_tokens=NEW), eos, drafter).generate(prompts)
    assert_like_ar(run, ref)
    one = DFlashDecoder(model64, drafter, drafter.cfg, eos)
    assert [r.accepted for r in run.results] == [one.generate(p, NEW).accepted for p in prompts]


def oracle_drafts(ref, req: int, done: int, D: int, vocab: int) -> list[int]:
    """The reference reply's next D tokens, one of them wrong at a place that varies with the request and
    the step (or none): every accepted length 0..D occurs."""
    want = ref[req].tokens[done : done + D]
    want = want + [0] * (D - len(want))
    bad = (7 * req + 5 * done) % (D + 2)  # D or D+1: no wrong draft
    if bad < D:
        want[bad] = (want[bad] + 1) % vocab
    return want


class Oracle(BatchedDecoder):
    """Drafts :func:`oracle_drafts`; records what the real drafter drafted for each request at each step
    (its context then holds the verified positions of the oracle's steps)."""

    def __init__(self, *args, ref, off_by_one=False, **kw):
        super().__init__(*args, **kw)
        self.ref, self.off_by_one, self.real = ref, off_by_one, [[] for _ in ref]

    def _propose(self, book, last, start):
        real = self.draft.propose(last, start).tolist()
        rows = []
        for r, req in enumerate(book.owner):
            if req < 0:
                rows.append([0] * (self.block - 1))
                continue
            done = len(book.results[req].tokens)
            self.real[req].append(real[r])
            rows.append(oracle_drafts(self.ref, req, done, self.block - 1, self.model.config.vocab_size))
        return torch.tensor(rows, device=last.device)

    def _accept(self, drafts, greedy):
        a = super()._accept(drafts, greedy)
        return min(a + 1, len(drafts)) if self.off_by_one else a


class Oracle1(DFlashDecoder):
    """The batch-1 loop with the same oracle and the same record."""

    def __init__(self, *args, ref, **kw):
        super().__init__(*args, **kw)
        self.ref, self.req, self.real = ref, 0, [[] for _ in ref]

    def _propose(self, dcache, seq, last):
        self.real[self.req].append(super()._propose(dcache, seq, last).tolist())
        done = len(seq) - self.ref[self.req].prompt_tokens
        return torch.tensor(oracle_drafts(self.ref, self.req, done, self.n_drafts, self.target.model.config.vocab_size))


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
@pytest.mark.parametrize("slots", [1, 3])
def test_accepted_drafts_are_lossless_and_a_broken_verifier_is_caught(model64, case, slots, arch):
    """Every accepted length occurs: outputs are AR's, and each row's real drafter (its context grown by
    the verified positions) drafts at every step what the batch-1 drafter drafts."""
    prompts, eos, ref = case
    drafter = make_drafter(model64, arch=arch)
    dec = Oracle(model64, BatchSettings(slots=slots, max_new_tokens=NEW), eos, drafter, ref=ref)
    run = dec.generate(prompts)
    assert_like_ar(run, ref)
    D = drafter.cfg.num_drafts
    assert {a for r in run.results for a in r.accepted} == set(range(D + 1)) and run.tau > 1.5
    one = Oracle1(model64, drafter, drafter.cfg, eos, ref=ref)
    for one.req, p in enumerate(prompts):
        assert one.generate(p, NEW).accepted == run.results[one.req].accepted
    assert dec.real == one.real
    broken = Oracle(model64, BatchSettings(slots=slots, max_new_tokens=NEW), eos, drafter, ref=ref, off_by_one=True)
    assert [r.tokens for r in broken.generate(prompts).results] != [r.tokens for r in ref]


@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("arch", ["dflash", "dflash2", "dspark"])
def test_slot_drafter_rows_draft_as_the_batch1_drafter(model64, arch, vocab):
    """Rows with contexts of different lengths, then a verified block each (different accepted counts):
    every row's drafts equal the batch-1 drafter's (eager DraftCache) on the same context; with a draft
    vocabulary (evaluate.draft_vocab) too, every draft one of its tokens."""
    drafter = make_drafter(model64, seed=1, arch=arch)
    cfg, F = drafter.cfg, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    embed, head = model64.get_input_embeddings(), model64.get_output_embeddings()
    ids = torch.arange(1, model64.config.vocab_size, 3)
    if vocab:
        drafter.use_draft_vocab(ids, head.weight)
    g = torch.Generator().manual_seed(3)
    lengths, accepted = [5, 11, 2], [0, 3, 1]
    feats = torch.randn(3, 11, F, generator=g, dtype=torch.float64)
    block = torch.randn(3, cfg.num_drafts + 1, F, generator=g, dtype=torch.float64)
    last = torch.tensor([7, 8, 9])
    slots = SlotDrafter(drafter, embed, head, slots=3, capacity=64, cuda_graphs=False)
    slots.prefill([2, 0, 1], feats, lengths)  # row r holds request order[r]
    order = [1, 2, 0]
    start = torch.tensor([lengths[q] for q in order])
    first = slots.propose(last, start)
    slots.extend(block[order], start, start + torch.tensor([accepted[q] for q in order]) + 1)
    second = slots.propose(last, start + torch.tensor([accepted[q] for q in order]) + 1)
    one = DrafterRunner(drafter, embed, head, cfg.mask_token_id)
    for r, q in enumerate(order):
        cache, n = one.new_cache(), lengths[q]
        one.extend(cache, feats[q : q + 1], 0, n)
        assert first[r].tolist() == one.propose(cache, n + 1, last[r].view(1, 1)).tolist()
        one.extend(cache, block[q : q + 1], n, accepted[q] + 1)
        assert second[r].tolist() == one.propose(cache, n + accepted[q] + 2, last[r].view(1, 1)).tolist()
    drafted = set(first.flatten().tolist()) | set(second.flatten().tolist())
    assert (drafted <= set(ids.tolist())) == vocab  # without one, some draft lies outside it


def test_forced_tau_draws_the_asked_acceptance(model64, case):
    """The benchmark's fixed-tau mode (not lossless): acceptance drawn with the asked mean length."""
    prompts, _, _ = case
    for tau in (1.0, 2.5, BS):
        p = forced_acceptance(BS - 1, tau)
        assert abs(1 + sum(p**k for k in range(1, BS)) - tau) < 1e-9
    with pytest.raises(ValueError):
        forced_acceptance(BS - 1, BS + 0.5)
    dec = BatchedDecoder(model64, BatchSettings(slots=4, max_new_tokens=64, forced_tau=2.5), [], make_drafter(model64))
    run = dec.generate(prompts)
    raw = [c for r in run.results for c in r.committed_raw]
    assert abs(sum(raw) / len(raw) - 2.5) < 0.25 and all(r.new_tokens == 64 for r in run.results)


def load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("concurrency_benchmark", REPO / "benchmarks" / "concurrency.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def finished_run(random_target, tmp_path):
    """A results directory laid out as a finished pipeline run's: target, drafter, prompts, an eval summary."""
    import shutil

    from conftest import PROMPTS
    from dflashpipe.export.write import save_drafter
    from dflashpipe.inputs.data import prepare_prompts
    from dflashpipe.inputs.target import load_target

    run = tmp_path / "results"
    shutil.copytree(random_target, run / "target" / "model")
    target, tok = load_target(str(random_target))
    cfg = DrafterConfig.from_target_config(target.config, num_hidden_layers=1, block_size=BS,
                                           mask_token_id=tok.mask_token_id)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), cfg, run / "drafter", target.config)
    prepare_prompts({"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "limit": 3},
                    "math_heldout", str(run / "prompts" / "math_heldout.parquet"))
    (run / "eval").mkdir()
    (run / "eval" / "math_heldout.summary.json").write_text(json.dumps({"chat_template_kwargs": {}}))
    return run


def test_benchmark_smoke_both_modes(finished_run, tmp_path):
    """benchmarks/concurrency.py on the CPU: the tiny shapes (forced and real acceptance) and a finished
    run's target, drafter and prompts (real acceptance, lossless rows), JSON and plot written."""
    out = tmp_path / "out"
    bench = load_benchmark()
    assert bench.main(["--device", "cpu", "--tiny", "--run", str(finished_run), "--concurrency", "1,2",
                       "--new", "6", "--tau", "2.5,real", "--prompt-len", "12", "--block-size", "4", "--layers", "1",
                       "--out", str(out)]) == 0
    res = json.loads((out / "concurrency.json").read_text())
    assert set(res["modes"]) == {"tiny", "run:math_heldout"}
    for label, section in res["modes"].items():
        assert [r["concurrency"] for r in section["by_concurrency"]] == [1, 2]
        for row in section["by_concurrency"]:
            assert row["ar"]["total_tok_s"] > 0 and row["ar_slot_decoder"]["total_tok_s"] > 0
            assert row["dflash"]["speedup_total"] > 0 and row["dflash"]["lossless_exact_rows"] == row["prompts"]
            assert row["dflash"]["tau"] >= 1
    forced = res["modes"]["tiny"]["by_concurrency"][1]["dflash_forced_tau_2.5"]
    assert forced["tau_uncut"] >= forced["tau"] > 1.2
    assert (out / "speedup_vs_concurrency.png").stat().st_size > 0


class FakeGraph:
    """A CUDA graph's contract on the CPU: replay reruns the captured function on the same input buffers
    and writes into the same output tensors (read before the next replay)."""

    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs

    def replay(self):
        def copy(dst, src):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
            elif isinstance(dst, tuple):
                for d, s in zip(dst, src):
                    copy(d, s)

        copy(self.outputs, self.fn())


def fake_capture(fn, device, warmups=2):
    for _ in range(warmups):
        fn()
    outputs = fn()
    return FakeGraph(fn, outputs), outputs


@pytest.mark.parametrize("arch", ["dflash", "dspark"])
def test_graph_path_static_buffers(model64, case, arch, monkeypatch):
    """The GPU path's plumbing on the CPU (capture replaced by a replay on the same buffers): inputs copied
    in before each replay, outputs read before the next. Oracle drafts (every accepted length) and the
    real drafter's record as in the eager run."""
    import dflashpipe.decode.batched as batched

    monkeypatch.setattr(batched, "capture", fake_capture)
    prompts, eos, ref = case
    drafter = make_drafter(model64, arch=arch)
    runs = {}
    for graphs in (False, True):
        dec = Oracle(model64, BatchSettings(slots=3, max_new_tokens=NEW, cuda_graphs=graphs), eos, drafter, ref=ref)
        runs[graphs] = (dec.generate(prompts), dec.real)
        assert dec.mode == "slots+dense" + ("+cuda_graphs" if graphs else "")
        if graphs:
            assert set(dec.target._graphs) == {(drafter.cfg.num_drafts + 1, True)}
            assert set(dec.draft._graphs) == {"propose", "extend"}
    assert_like_ar(runs[True][0], ref)
    assert [r.accepted for r in runs[True][0].results] == [r.accepted for r in runs[False][0].results]
    assert runs[True][1] == runs[False][1]
    ar = BatchedDecoder(model64, BatchSettings(slots=3, max_new_tokens=NEW, cuda_graphs=True), eos)
    assert_like_ar(ar.generate(prompts), ref)
    assert set(ar.target._graphs) == {(1, False)}


def test_slot_target_prefills_into_any_rows(model64, case):
    """Prompts prefilled into rows in any order (all rows at once), then decoded a step at a time."""
    from dflashpipe.decode.batched import SlotTarget

    prompts, _, _ = case
    prompts = prompts[:3]
    want = [ARDecoder(model64, []).generate(p, 4).tokens for p in prompts]
    target = SlotTarget(model64, slots=3, capacity=64, cuda_graphs=False)
    rows = [2, 0, 1]
    first, _ = target.prefill(rows, prompts)
    got = {r: [t] for r, t in zip(rows, first.tolist())}
    pos = {r: len(p) for r, p in zip(rows, prompts)}
    for _ in range(3):
        ids = torch.tensor([[got[r][-1]] for r in range(3)])
        tokens, _ = target.step(ids, torch.tensor([pos[r] for r in range(3)]))
        for r in range(3):
            got[r].append(int(tokens[r, 0]))
            pos[r] += 1
    assert [got[r] for r in rows] == want


def test_static_drafter_with_shared_block_masks_drafts_as_the_eager_drafter(model64):
    """The batch-1 static drafter (block masks shared with the batched one) on a drafter with a sliding
    layer: the eager drafter's drafts, before and after a verified block."""
    from dflashpipe.decode.static_drafter import StaticDrafterRunner

    drafter = make_drafter(model64, seed=2, sliding_window=BS, layer_types=["sliding_attention", "full_attention"])
    cfg, F = drafter.cfg, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    embed, head = model64.get_input_embeddings(), model64.get_output_embeddings()
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 13, F, generator=g, dtype=torch.float64)
    block = torch.randn(1, cfg.num_drafts + 1, F, generator=g, dtype=torch.float64)
    last = torch.tensor([[11]])
    runners = [DrafterRunner(drafter, embed, head, cfg.mask_token_id),
               StaticDrafterRunner(drafter, embed, head, cfg.mask_token_id, capacity=64, cuda_graphs=False)]
    drafts = []
    for one in runners:
        cache = one.new_cache()
        one.extend(cache, feats, 0, 13)
        first = one.propose(cache, 14, last).tolist()
        one.extend(cache, block, 13, 2)
        drafts.append((first, one.propose(cache, 16, last).tolist()))
    assert drafts[0] == drafts[1]
