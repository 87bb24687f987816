"""Evaluation metrics on hand-made acceptance sequences with hand-computed answers."""

import math

import pytest

from conftest import PROMPTS
from dflashpipe.evaluate.metrics import (
    account_steps,
    acceptance_histogram,
    finite_or_none,
    interleaved_order,
    per_position_acceptance,
    speedup,
    speedup_spread,
    tau,
    tau_mean,
    tau_pooled,
    tokens_per_second,
)
from dflashpipe.decode.speculative import DecodeResult
from dflashpipe.decode.stop import cut_step

EOS = 99


def test_cut_step():
    assert cut_step([1, 2, 3], 0, 10, [EOS]) == ([1, 2, 3], None)
    assert cut_step([1, EOS, 3], 0, 10, [EOS]) == ([1, EOS], "eos")  # stop token kept, rest dropped
    assert cut_step([1, 2, 3], 8, 10, [EOS]) == ([1, 2], "length")
    assert cut_step([1, 2], 8, 10, [EOS]) == ([1, 2], "length")  # exactly fills the budget
    assert cut_step([1, EOS], 8, 10, [EOS]) == ([1, EOS], "eos")  # eos wins when both apply
    assert cut_step([5, 6], 0, 10, [EOS, 6]) == ([5, 6], "eos")  # any of several stop ids


def test_account_steps_eos_cut():
    # bs = 4: the prefill gives 5; three verify steps commit (before cutting) 4, 2 and 4 tokens.
    acc = account_steps([5], [[1, 2, 3, 4], [6, 7], [8, EOS, 9, 10]], max_new_tokens=20, stop_ids=[EOS])
    assert acc.output == [5, 1, 2, 3, 4, 6, 7, 8, EOS]
    assert acc.committed == [4, 2, 2]
    assert acc.committed_raw == [4, 2, 4]
    assert acc.stop_reason == "eos"
    assert tau(acc.committed) == pytest.approx(8 / 3)  # only tokens that reach the output
    assert tau(acc.committed_raw) == pytest.approx(10 / 3)  # counted before the cut: overstates
    assert 1 + sum(acc.committed) == len(acc.output)


def test_account_steps_length_cut_and_ignored_steps():
    acc = account_steps([5], [[1, 2, 3, 4], [6, 7, 8], [11, 12]], max_new_tokens=6, stop_ids=[EOS])
    assert acc.output == [5, 1, 2, 3, 4, 6]
    assert acc.committed == [4, 1]
    assert acc.committed_raw == [4, 3]  # the third step never runs
    assert acc.stop_reason == "length"
    # The prefill token alone can end the output: no verify steps at all.
    acc = account_steps([EOS], [[1, 2]], max_new_tokens=6, stop_ids=[EOS])
    assert (acc.output, acc.committed, acc.stop_reason) == ([EOS], [], "eos")
    assert math.isnan(tau(acc.committed))


def test_tau_mean_vs_pooled():
    per_response = [[4, 4], [1]]
    assert tau_mean(per_response) == pytest.approx((4 + 1) / 2)
    assert tau_pooled(per_response) == pytest.approx(9 / 3)
    assert tau_mean([[], [2, 3]]) == pytest.approx(2.5)  # responses without steps are skipped
    assert math.isnan(tau_pooled([[], []]))


def test_histogram_and_per_position_acceptance():
    accepted = [0, 3, 1, 3, 2]  # bs = 4
    assert acceptance_histogram(accepted, 4) == [1, 1, 1, 2]
    # k=1: #(a>=1)/#(a>=0) = 4/5; k=2: #(a>=2)/#(a>=1) = 3/4; k=3: #(a>=3)/#(a>=2) = 2/3
    assert per_position_acceptance(accepted, 4) == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    rates = per_position_acceptance([0, 0], 4)
    assert rates[0] == 0 and math.isnan(rates[1]) and math.isnan(rates[2])
    with pytest.raises(ValueError):
        acceptance_histogram([4], 4)


def test_speed():
    assert tokens_per_second(50, 2.0) == 25
    assert math.isnan(tokens_per_second(5, 0.0))
    assert speedup(10.0, 100, 4.0, 100) == pytest.approx(2.5)
    assert speedup(10.0, 100, 5.0, 50) == pytest.approx(1.0)  # per token, not per response
    assert math.isnan(speedup(10.0, 100, 1.0, 0))
    assert finite_or_none({"a": [1.0, float("nan")], "b": float("inf"), "c": 2}) == {"a": [1.0, None], "b": None, "c": 2}


def test_decode_result_conventions():
    r = DecodeResult(tokens=[5, 1, 2, 3, 4, 6, 7, 8, EOS], committed=[4, 2, 2], committed_raw=[4, 2, 4], accepted=[3, 1, 3], decode_s=2.0)
    assert r.verify_steps == 3 and r.new_tokens == 9 and r.decode_tokens == 8
    assert r.tau == pytest.approx(8 / 3) and r.tau_uncut == pytest.approx(10 / 3)
    assert r.tokens_per_second == pytest.approx(4.0)


def test_the_uncut_tau_columns_are_named_by_what_they_count_and_old_summaries_still_make_tables(tmp_path):
    """tau_uncut_* count a + 1 for every verify step before the cut (the authors' benchmark before
    z-lab/dflash 10129599; since then it counts like tau_mean): not "the authors'" figure. A summary
    written under the old names (tau_authors_*) still gives the table's columns."""
    import json

    from dflashpipe.stages.tables import EVAL_COLUMNS, eval_tables

    assert {"tau_uncut_mean", "tau_uncut_pooled"} <= set(EVAL_COLUMNS) and not any("authors" in c for c in EVAL_COLUMNS)
    old = {"methods": {"dflash": {"tau_mean": 2.5, "tau_pooled": 2.6, "tau_authors_mean": 2.9, "tau_authors_pooled": 3.0}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    rows, _, _ = eval_tables({"math": str(tmp_path / "old.json")})
    assert (rows["tau_uncut_mean"][0], rows["tau_uncut_pooled"][0], rows["tau_pooled"][0]) == (2.9, 3.0, 2.6)


def test_interleaved_order_rotates_so_every_method_leads_equally():
    methods = ["dflash", "ar", "hf_generate"]
    orders = [interleaved_order(methods, i) for i in range(6)]
    assert orders[0] == methods and orders[1] == ["ar", "hf_generate", "dflash"] and orders[3] == methods
    for m in methods:  # each method first, and right after each other method, equally often
        assert sum(o[0] == m for o in orders) == 2
    assert all(sorted(o) == sorted(methods) for o in orders)
    assert interleaved_order([], 3) == []


def test_speedup_spread_on_fixed_timings():
    # AR: 1 s for 10 tokens per prompt; the method: 0.5 s (2x) on three prompts and 1 s (1x) on one
    ar = [(1.0, 10)] * 4
    method = [(0.5, 10), (0.5, 10), (0.5, 10), (1.0, 10)]
    spread = speedup_spread(ar, method, resamples=4000, seed=1)
    assert spread["median_per_prompt"] == 2.0  # the median of 2, 2, 2, 1
    pooled = speedup(4.0, 40, 2.5, 40)  # 1.6
    assert spread["ci_low"] < pooled < spread["ci_high"]
    # the interval's ends are pooled speed-ups of resampled prompts: all four at 1x ... none at 1x
    assert spread["ci_low"] >= 1.0 and spread["ci_high"] <= 2.0 and spread["ci_low"] < 1.5 < 1.75 < spread["ci_high"]
    assert speedup_spread(ar, method, resamples=4000, seed=1) == spread  # seeded: the same timings, the same interval
    # identical timings: no spread
    same = speedup_spread(ar, [(0.5, 10)] * 4)
    assert same == {"median_per_prompt": 2.0, "ci_low": 2.0, "ci_high": 2.0}
    # one prompt: no interval
    one = speedup_spread([(1.0, 10)], [(0.5, 10)])
    assert one["median_per_prompt"] == 2.0 and math.isnan(one["ci_low"]) and math.isnan(one["ci_high"])


def test_repeated_decodes_run_in_rotated_rounds_and_each_prompt_counts_its_median_run(monkeypatch):
    """evaluate.timing_repeats: each prompt's decodes run in r rounds, each round's order rotated on, and each
    method's result for the prompt is its run of median decode time (fixed timings, no model)."""
    import torch

    from dflashpipe.decode.speculative import DecodeResult
    from dflashpipe.evaluate import run as R
    from dflashpipe.evaluate.settings import EvalSettings

    calls = []
    times = {"dflash": iter([0.9, 0.2, 0.4, 0.5, 0.3, 0.1]), "ar": iter([1.0, 1.2, 0.8, 1.1, 5.0, 0.9])}

    class Fixed:
        def __init__(self, name):
            self.name = name

        def decode(self, prompt, max_new_tokens, seed):
            calls.append((prompt[0], self.name))
            return DecodeResult(tokens=[1, 2, 3], decode_s=next(times[self.name]))

    s = EvalSettings(max_new_tokens=3, warmup=False, timing_repeats=3)
    results, measured = R._decode_all({"dflash": Fixed("dflash"), "ar": Fixed("ar")}, [[10], [11]], s, torch.device("cpu"),
                                      lambda *_: None)
    # prompt 0: rounds 0, 1, 2 lead with dflash, ar, dflash; prompt 1 (round 3, 4, 5): ar, dflash, ar
    assert calls == [(10, "dflash"), (10, "ar"), (10, "ar"), (10, "dflash"), (10, "dflash"), (10, "ar"),
                     (11, "ar"), (11, "dflash"), (11, "dflash"), (11, "ar"), (11, "ar"), (11, "dflash")]
    assert [r.decode_s for r in results["dflash"]] == [0.4, 0.3]  # medians of (0.9, 0.2, 0.4), (0.5, 0.3, 0.1)
    assert [r.decode_s for r in results["ar"]] == [1.0, 1.1]  # the 5.0 s hiccup does not count
    assert measured["ar"]["timing_repeats"] == 3 and measured["dflash"]["timing_rounds_mean"] == 3


def test_auto_timing_repeats_repeat_only_where_a_round_is_cheap():
    """timing_repeats: auto times a prompt again while its rounds fit 0.5 s: 3 rounds of millisecond decodes,
    one of decodes that take seconds."""
    import time

    import torch

    from dflashpipe.decode.speculative import DecodeResult
    from dflashpipe.evaluate import run as R
    from dflashpipe.evaluate.metrics import auto_rounds
    from dflashpipe.evaluate.settings import EvalSettings

    assert [auto_rounds(t) for t in (0.0, 0.1, 0.2, 0.25, 0.3, 0.6, 5.0)] == [3, 3, 2, 2, 1, 1, 1]

    class Sleeper:
        def __init__(self, seconds):
            self.seconds = seconds

        def decode(self, prompt, max_new_tokens, seed):
            time.sleep(self.seconds)
            return DecodeResult(tokens=[1], decode_s=self.seconds)

    s = EvalSettings(max_new_tokens=1, warmup=False, timing_repeats="auto")
    for seconds, rounds in ((0.001, 3), (0.3, 1)):
        _, measured = R._decode_all({"dflash": Sleeper(seconds), "ar": Sleeper(seconds)}, [[1], [2]], s,
                                    torch.device("cpu"), lambda *_: None)
        assert measured["ar"]["timing_rounds_mean"] == rounds and measured["ar"]["timing_repeats"] == "auto"


def test_other_busy_cores_on_fixed_readings_and_a_real_busy_process():
    """The log's busy-machine line: other processes' CPU time over the timed span (not the lagging load average)."""
    import subprocess
    import sys
    import time

    from dflashpipe.evaluate.metrics import machine_busy, other_busy_cores
    from dflashpipe.evaluate.run import _cpu_reading

    # 10 s of wall time; the machine was busy 14 CPU-seconds, 4 of them this process's own: 1 core of others
    assert other_busy_cores((100.0, 50.0, 3.0), (110.0, 64.0, 7.0)) == 1.0
    assert other_busy_cores((100.0, 50.0, 3.0), (110.0, 52.0, 7.0)) == 0.0  # never below 0 (tick rounding)
    assert other_busy_cores((100.0, 50.0, 3.0), (100.0, 60.0, 3.0)) == 0.0  # no time passed
    # 2 cores, a 1-thread evaluation: a second evaluation on the other core is no competition; two spinners are
    assert not machine_busy(1.02, 2, 1) and machine_busy(2.0, 2, 1) and machine_busy(0.6, 2, 2)
    assert not machine_busy(0.05, 2, 2)
    before = _cpu_reading()
    if before is None:
        return  # no /proc/stat here: the evaluation falls back to the load average
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    spin.wait()
    assert other_busy_cores(before, _cpu_reading()) > 0.3  # one spinning process: about one core
    quiet = _cpu_reading()
    time.sleep(0.2)
    assert other_busy_cores(quiet, _cpu_reading()) >= 0.0


def test_a_cut_of_a_set_with_categories_takes_each_category_in_turn(micro_target, tmp_path):
    """32 of MT-Bench's 80 questions (8 categories in blocks of 10, the shipped file): 4 of each category, kept in
    file order, where the first 32 rows would hold 3 categories and 2 math questions; a set without categories
    is read in file order."""
    import pandas as pd
    from transformers import AutoConfig, AutoTokenizer

    from dflashpipe.evaluate.run import category_order, eval_prompts
    from dflashpipe.evaluate.settings import EvalSettings
    from dflashpipe.inputs.data import prepare_prompts

    assert category_order(["a", "a", "a", "b", None, "b"]) == [0, 3, 4, 1, 5, 2]
    spec = {"path": str(PROMPTS / "mt_bench.jsonl.gz"), "messages_column": "messages"}
    table = prepare_prompts(spec, "mt_bench", str(tmp_path / "mt.parquet"))
    assert table["category"].iloc[:32].nunique() == 4

    class Target:  # the micro target's config with a context that holds MT-Bench's questions
        config = AutoConfig.from_pretrained(micro_target)

    Target.config.max_position_embeddings = 4096
    tok = AutoTokenizer.from_pretrained(micro_target)
    kept, skipped = eval_prompts(tmp_path / "mt.parquet", tok, Target, 4, EvalSettings(num_prompts=32), print)
    assert not skipped and len(kept) == 32
    cats = pd.Series([p.category for p in kept])
    assert cats.nunique() == 8 and set(cats.value_counts()) == {4}
    rows = [int(p.id.split("-")[1]) for p in kept]
    assert rows == sorted(rows) and all(p.turns == 2 for p in kept)

    spec = {"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "limit": 6}
    plain = prepare_prompts(spec, "math_heldout", str(tmp_path / "math.parquet"))
    kept, _ = eval_prompts(tmp_path / "math.parquet", tok, Target, 4, EvalSettings(num_prompts=3), print)
    assert [p.id for p in kept] == list(plain["id"].iloc[:3]) and all(p.category is None for p in kept)
