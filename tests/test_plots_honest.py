"""Plots that do not mislead (issue 63, item 6), and a held-out split that scales with the corpus.

The figures are drawn from small real tables by the library's own functions; each test reads the
PNG it wrote and the matplotlib figure behind it (texts, labels, ticks, lines).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd
import pytest

from dflashpipe.stages import plots
from dflashpipe.stages.tables import SIMULATED
from dflashpipe.wiring import Pipeline

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save (saved as usual too)."""
    drawn, save = [], plots.save_png
    monkeypatch.setattr(plots, "save_png", lambda fig, path: (drawn.append(fig), save(fig, path)))
    return drawn


def _png(path) -> bool:
    return path.read_bytes()[:8] == PNG


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [
        t.get_text() for leg in fig.legends for t in leg.get_texts()]


def _eval_csv(path):
    """Two eval sets; DFlash reached 1.13 and 1.4 per prompt while training's held-out simulation said 3.86."""
    rows = []
    for dataset, dflash_mean in (("math_heldout", 1.13), ("code_heldout", 1.4)):
        rows += [
            {"dataset": dataset, "method": "dflash", "tau_mean": dflash_mean, "tau_pooled": dflash_mean + 0.2,
             "tokens_per_target_forward": 9.99, "speedup_vs_ar": 0.4, "simulated_tau": 3.86},
            {"dataset": dataset, "method": "ar", "tau_mean": 1.0, "tau_pooled": 1.0,
             "tokens_per_target_forward": 1.0, "speedup_vs_ar": 1.0, "simulated_tau": None},
        ]
    pd.DataFrame(rows).to_csv(path, index=False)


def test_tau_plot_draws_the_simulated_tau_once_as_the_training_mix_s(tmp_path, figures):
    _eval_csv(tmp_path / "eval.csv")
    plots.tau_speedup(str(tmp_path / "eval.csv"), str(tmp_path / "tau.png"), Pipeline.method_labels())
    assert _png(tmp_path / "tau.png")
    (fig,) = figures
    ax_tau = fig.axes[0]
    bar_labels = [t.get_text() for t in ax_tau.texts]
    # the bars are eval.csv's tau_mean (not tokens_per_target_forward), and no bar carries 3.86
    assert sorted(bar_labels) == ["1.00", "1.00", "1.13", "1.40"]
    assert ax_tau.get_ylabel().startswith("tau_mean") and "tau_mean" in ax_tau.get_title()
    # one line at 3.86 across the whole panel (axes coordinates 0..1), not a mark per eval set
    sim = [ln for ln in ax_tau.lines if list(ln.get_ydata()) == [3.86, 3.86]]
    assert len(sim) == 1 and list(sim[0].get_xdata()) == [0, 1]
    legend = _texts(fig)
    (label,) = [t for t in legend if "3.86" in t]
    assert label.startswith("simulated_tau") and "training mix's held-out" in label and "no eval set" in label
    # tau_pooled: named as its column, one dot per DFlash and AR bar, at the pooled values
    assert any(t.startswith("tau_pooled") for t in legend)
    dots = sorted(y for ln in ax_tau.lines if ln.get_marker() == "." for y in ln.get_ydata())
    assert dots == pytest.approx([1.0, 1.0, 1.33, 1.6])
    assert fig.axes[1].get_ylabel().startswith("speedup_vs_ar")


def test_tau_plot_without_a_simulated_tau_has_no_reference_line(tmp_path, figures):
    _eval_csv(tmp_path / "eval.csv")
    df = pd.read_csv(tmp_path / "eval.csv").assign(simulated_tau=None)
    df.to_csv(tmp_path / "eval.csv", index=False)
    plots.tau_speedup(str(tmp_path / "eval.csv"), str(tmp_path / "tau.png"), Pipeline.method_labels())
    assert not any("simulated" in t for t in _texts(figures[0]))


def _stamp(path, slot: int, misses: int, hits: int = 0) -> str:
    counters = {"fxgraph_cache_miss": misses, "fxgraph_cache_hit": hits, "fxgraph_cache_bypass": 0,
                "autograd_cache_miss": 0, "autograd_cache_hit": 0, "autograd_cache_bypass": 0}
    path.write_text(json.dumps({"slot": slot, "compile_seconds": 0.04, "counters": counters,
                                "device_name": "cpu (x86_64)",
                                "parts": {"config": {"compile": "none", "attention": "sdpa"}}}))
    return str(path)


def _compile_csv(path, misses: int) -> None:
    pd.DataFrame([{"slot": 0, "phase": "warm job", "seconds": 0.04, "cache_misses": misses},
                  {"slot": 0, "phase": "training shard (warm cache)", "seconds": 0.05, "cache_misses": 0}]
                 ).to_csv(path, index=False)


def test_groups_plot_draws_dflash_per_turn_and_category_or_says_there_are_none(tmp_path, figures):
    """eval_groups.png from the table the tables job writes: one panel per set that has turns or categories, a
    bar per group labelled with its speed-up and tau; a run without such a set gets a line saying so."""
    from dflashpipe.stages.tables import group_table, write_csv

    fig = {"n_prompts": 2, "n_samples": 2, "tau_mean": 2.0, "tau_pooled": 2.1, "tokens_per_s": 100.0,
           "speedup_vs_ar": 1.5, "speedup_vs_ar_median_per_prompt": 1.4, "speedup_vs_ar_ci_low": 1.2,
           "speedup_vs_ar_ci_high": None, "matches_ar": 1.0}
    both = {m: fig for m in ("dflash", "ar")}
    (tmp_path / "mt.json").write_text(json.dumps({"methods": {}, "turns": {"1": both, "2": both},
                                                  "categories": {"writing": both, "math": both}}))
    (tmp_path / "math.json").write_text(json.dumps({"methods": {}}))
    table = group_table({"mt_bench": str(tmp_path / "mt.json"), "math": str(tmp_path / "math.json")})
    assert len(table) == 8 and set(table["dataset"]) == {"mt_bench"}
    write_csv(table, tmp_path / "g.csv")
    plots.groups(str(tmp_path / "g.csv"), str(tmp_path / "g.png"))
    assert _png(tmp_path / "g.png") and len(figures[-1].axes) == 1
    ax = figures[-1].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["turn 1", "turn 2", "writing", "math"]
    assert sum("1.50x" in t for t in _texts(figures[-1])) == 4 and "mt_bench" in ax.get_title()
    write_csv(group_table({"math": str(tmp_path / "math.json")}), tmp_path / "e.csv")
    plots.groups(str(tmp_path / "e.csv"), str(tmp_path / "e.png"))
    assert _png(tmp_path / "e.png") and "no eval set has several user turns" in figures[-1].axes[0].get_title()


def test_compile_plot_says_nothing_compiled_instead_of_bars(tmp_path, figures):
    _compile_csv(tmp_path / "compile.csv", 0)
    stamps = [_stamp(tmp_path / f"slot{s}.json", s, 0) for s in (0, 1)]
    plots.compile_times(str(tmp_path / "compile.csv"), str(tmp_path / "compile.png"), stamps)
    assert _png(tmp_path / "compile.png")  # Snakemake's output exists all the same
    (ax,) = figures[0].axes
    assert ax.get_title().startswith("Nothing compiled") and not ax.patches and not ax.axison
    (text,) = ax.texts
    assert "train.compile: none" in text.get_text() and "2 warm stamps" in text.get_text()


def test_compile_plot_draws_bars_when_a_warm_job_compiled(tmp_path, figures):
    _compile_csv(tmp_path / "compile.csv", 12)
    stamps = [_stamp(tmp_path / "slot0.json", 0, 12), _stamp(tmp_path / "slot1.json", 1, 0, hits=12)]
    plots.compile_times(str(tmp_path / "compile.csv"), str(tmp_path / "compile.png"), stamps)
    (ax,) = figures[0].axes
    assert ax.get_title() == "Compile: warm jobs vs. hot shard start" and len(ax.patches) == 2
    assert plots.compiled_nothing([stamps[1]]) is False  # loading from the cache counts as compiled work


@pytest.mark.parametrize("loss", ["ce", "kl", "dspark"])
def test_loss_plot_names_the_loss_that_ran(tmp_path, figures, loss):
    pd.DataFrame({"step": [1, 2, 3], "loss": [3.0, 2.5, 2.0], "acc": [0.1, 0.2, 0.3], "tokens_per_s": [100.0] * 3,
                  "tokens_per_s_per_gpu": [100.0] * 3, "heldout_loss": [None, None, 2.1],
                  "heldout_acc": [None, None, 0.25]}).to_csv(tmp_path / "training.csv", index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"loss": loss, "heldout_samples": 14}))
    plots.training_curves(str(tmp_path / "training.csv"), str(tmp_path / "loss.png"), str(tmp_path / "tokens.png"),
                          str(tmp_path / "summary.json"))
    assert _png(tmp_path / "loss.png") and _png(tmp_path / "tokens.png")
    title = figures[0].axes[0].get_title()
    assert f"train.loss: {loss}" in title and plots.LOSSES[loss] in title


def test_per_position_plots_tick_whole_positions(tmp_path, figures):
    # one finite point: left to a locator, the axis would tick 0.95, 0.975, ...
    pd.DataFrame([{"dataset": d, "position": k, "acceptance_rate": 0.5 if k == 1 else None}
                  for d in ("math_heldout", SIMULATED) for k in (1, 2, 3)]).to_csv(tmp_path / "pos.csv", index=False)
    pd.DataFrame([{"dataset": d, "accepted": a, "steps": 1, "fraction": 0.25}
                  for d in ("math_heldout", "code_heldout") for a in range(4)]).to_csv(tmp_path / "hist.csv", index=False)
    plots.per_position(str(tmp_path / "pos.csv"), str(tmp_path / "pos.png"))
    plots.histogram(str(tmp_path / "hist.csv"), str(tmp_path / "hist.png"))
    assert _png(tmp_path / "pos.png") and _png(tmp_path / "hist.png")
    pos, hist = (f.axes[0] for f in figures)
    assert list(pos.get_xticks()) == [1, 2, 3]
    assert [t.get_text() for t in hist.get_xticklabels()] == ["0", "1", "2", "3"]
    # the histogram's ticks sit under the middle of each group of bars (two datasets)
    assert list(hist.get_xticks()) == pytest.approx([a + 0.2 for a in range(4)])


# -- the held-out split scales with the corpus ---------------------------------------------------------------


def test_heldout_size_is_a_fraction_capped_by_heldout_samples():
    from dflashpipe.training.data import heldout_size

    assert heldout_size(295, 64, 0.05) == 14  # 5% of a small corpus, not 22%
    assert heldout_size(10_000, 64, 0.05) == 64  # the cap on a large one
    assert heldout_size(1_280, 64, 0.05) == 64
    assert heldout_size(10, 64, 0.05) == 1  # always something to evaluate
    assert heldout_size(300, 64, 0.07) == 21


@pytest.mark.parametrize("n, logged", [(295, True), (10_000, False)])
def test_run_data_holds_out_a_share_of_a_small_corpus_and_says_so(one_rank_group, n, logged):
    from datasets import Dataset

    from dflashpipe.training.data import run_data
    from dflashpipe.training.run import TrainConfig

    assert (TrainConfig.heldout_samples, TrainConfig.heldout_fraction) == (64, 0.05)  # the schema's defaults
    ds = Dataset.from_dict({"dataset": ["math"] * n, "id": [str(i) for i in range(n)], "bucket": [128] * n,
                            "num_loss_tokens": [16] * n})
    cfg = SimpleNamespace(heldout_samples=64, heldout_fraction=0.05, seed=0, batch_size=4, epochs=1.0,
                          max_steps=None, repeat={}, block_size=4)
    lines = []
    data = run_data(ds, cfg, pad_id=0, source="t", log=lines.append)
    expected = 14 if n == 295 else 64  # one sample per prompt: exactly N
    assert len(data.heldout_idx) == expected and len(data.train_idx) == n - expected
    if logged:
        assert lines == ["held out 14 of 295 samples (5%, train.heldout_samples 64 capped by train.heldout_fraction 0.05)"]
    else:
        assert lines == []
