"""The benchmark harness. benchmarks/recipes.py's data keys: a dataset added by --set reaches the
config, and a mix with another training dataset, a dataset with another spec or other expansion
settings, gets files of its own (never the old ones); its table; benchmarks/plot_data_curve.py's inputs."""

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXTRA = "datasets.extra={path: resources/prompts/reasoning_heldout.jsonl.gz, messages_column: messages}"


def _recipes():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("recipes_harness", REPO / "benchmarks" / "recipes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_dataset_set_on_the_command_line_joins_the_files_datasets(tmp_path):
    recipes = _recipes()
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump({"datasets": {
        "r": {"path": "resources/prompts/reasoning_train.jsonl.gz", "messages_column": "messages"},
        "h": {"path": "resources/prompts/reasoning_heldout.jsonl.gz", "messages_column": "messages", "use": "eval"}}}))
    assert sorted(recipes.merged_config([str(own)], [])["datasets"]) == ["h", "r"]  # the file's replace the shipped
    cfg = recipes.merged_config([str(own)], [EXTRA])
    assert sorted(cfg["datasets"]) == ["extra", "h", "r"] and cfg["datasets"]["extra"]["use"] == "train"


def test_another_mix_or_spec_gets_a_tokenized_set_and_prompts_of_its_own(tmp_path):
    recipes = _recipes()
    base = recipes.merged_config([], [])
    data = tmp_path / "data"
    first = recipes.tokenized_dir(base, data)
    assert recipes.tokenized_dir(recipes.merged_config([], []), data) == first  # the same mix: the same set
    assert recipes.tokenized_dir(recipes.merged_config([], [EXTRA]), data) != first
    # an eval-only dataset changes no training data
    held = EXTRA.replace("messages}", "messages, use: eval}")
    assert recipes.tokenized_dir(recipes.merged_config([], [held]), data) == first
    limited = recipes.merged_config([], ["datasets.math.limit=10"])
    assert recipes.tokenized_dir(limited, data) != first
    assert recipes.digest(limited["datasets"]["math"]) != recipes.digest(base["datasets"]["math"])


def test_changed_expansion_settings_get_replies_and_a_tokenized_set_of_their_own(tmp_path):
    recipes = _recipes()
    data = tmp_path / "data"
    base = recipes.merged_config([], [])
    first = recipes.expanded_path(base, "math", data)
    assert first.name.startswith("expanded_math_") and first == recipes.expanded_path(recipes.merged_config([], []), "math", data)
    longer = recipes.merged_config([], ["expand.max_new_tokens=17"])
    assert recipes.expanded_path(longer, "math", data) != first
    assert recipes.tokenized_dir(longer, data) != recipes.tokenized_dir(base, data)
    assert recipes.expanded_path(longer, "code", data) != recipes.expanded_path(base, "code", data)
    # a key that changes no reply (operational: threads) keeps the replies
    assert recipes.expanded_path(recipes.merged_config([], ["expand.threads=7"]), "math", data) == first
    # the tokenize section and the block size name the tokenized set, not the replies
    other = recipes.merged_config([], ["tokenize.buckets=[64]"])
    assert recipes.expanded_path(other, "math", data) == first
    assert recipes.tokenized_dir(other, data) != recipes.tokenized_dir(base, data)
    block = recipes.merged_config([], ["drafter.block_size=4"])
    assert recipes.tokenized_dir(block, data) != recipes.tokenized_dir(base, data)


TRAIN = {"heldout_sim_tau": 4.1, "heldout_acc": 0.6, "heldout_loss": 1.0, "tokens_per_s": 1e4, "steps": 10,
         "ranks": [{"peak_mem_mb": 100.0}], "wall_s": 1.0}


def _ev(tau, speedup):
    """An evaluation's figures on one set, as evaluate_one returns them."""
    return {"methods": {"dflash": {"tau_pooled": tau, "tau_mean": tau, "speedup_vs_ar": speedup, "tokens_per_s": 2e3},
                        "ar": {"tokens_per_s": 800.0, "mode": "compiled"}}, "lossless": {"passed": True}}


def test_a_tau_only_run_adds_its_tau_and_no_speed_to_the_table(tmp_path):
    """Runs that shared the GPU (--tau-only) count for tau; the speed-up is the mean of the runs timed alone."""
    recipes = _recipes()
    alone = recipes.row_of("r", 0, "math", TRAIN, _ev(4.0, 2.5))
    shared = recipes.row_of("r", 1, "math", TRAIN, _ev(5.0, 0.9), timed=False)  # its 0.9x: a GPU shared by others
    assert shared["tau_pooled"] == 5.0 and shared["speedup_vs_ar"] is None and shared["ar_tokens_per_s"] is None
    recipes.summarise([alone, shared], tmp_path)
    row = (tmp_path / "summary.md").read_text().splitlines()[2]
    assert "| 4.50 (4.00-5.00) |" in row and "| 2.50 (2.50-2.50) (1) |" in row and row.endswith("| 2 |")
    recipes.summarise([shared], tmp_path)  # no run timed: no speed-up
    assert "| - (0) |" in (tmp_path / "summary.md").read_text().splitlines()[2]


def test_combined_tables_name_a_variant_by_its_recipe(tmp_path, monkeypatch):
    """--combine: earlier tables' runs.csv in one table; --rename: a variant's label, the recipe it now is."""
    recipes = _recipes()
    mix = recipes.row_of("mix", 0, "math", TRAIN, _ev(4.0, 2.5))
    shared = recipes.row_of("r", 1, "math", TRAIN, _ev(5.0, 0.9), timed=False)
    for name, rows in (("a", [mix]), ("b", [shared])):
        (tmp_path / name).mkdir()
        recipes.summarise(rows, tmp_path / name)
    monkeypatch.setattr(sys, "argv", ["recipes.py", "--out", str(tmp_path / "ab"), "--rename", "mix=r",
                                      "--combine", str(tmp_path / "a"), str(tmp_path / "b")])
    assert recipes.main() == 0
    rows = (tmp_path / "ab" / "summary.md").read_text().splitlines()[2:]
    assert len(rows) == 1 and rows[0].startswith("| math | r | 4.50 (4.00-5.00) |") and "| 2.50 (2.50-2.50) (1) |" in rows[0]
    monkeypatch.setattr(sys, "argv", ["recipes.py", "--out", str(tmp_path / "aab"), "--rename", "mix=r",
                                      "--combine", str(tmp_path / "a"), str(tmp_path / "ab")])
    with pytest.raises(SystemExit, match=f"r seed 0 on math is in {tmp_path / 'a'} and {tmp_path / 'ab'}: combine"):
        recipes.main()  # "ab" holds a's run already: it would count as a second seed


def test_the_data_curve_reads_run_trees_and_committed_reports_together(tmp_path, capsys):
    """plot_data_curve.py: a run tree is plotted against samples (its summary's batch), a report's
    NAME_metrics.csv copies against steps; several folders and single files in one figure."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_data_curve

    report = REPO / "benchmarks" / "results" / "smollm2_h200_s23" / "train"
    run = tmp_path / "seeds" / "ce" / "runs" / "dflash_ce_s0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text((report / "dflash_ce_s0_metrics.csv").read_text())
    (run / "summary.json").write_text('{"global_batch": 16}')
    assert plot_data_curve.main(str(tmp_path / "seeds"), str(tmp_path / "a.png")) == 0
    assert "ce (dflash_ce_s0): simulated tau 3.99 at 48,000 samples; within 2% of it from 41,600 samples" in capsys.readouterr().out
    s22 = REPO / "benchmarks" / "results" / "smollm2_h200_s22" / "train" / "dflash2_mix_s0_metrics.csv"
    assert plot_data_curve.main(str(report), str(s22), str(tmp_path / "b.png")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["dflash_ce_s0 (smollm2_h200_s23/train): simulated tau 3.99 at 3,000 steps; within 2% of it from 2,600 steps",
                   "dflash_kl_s0 (smollm2_h200_s23/train): simulated tau 3.92 at 3,000 steps; within 2% of it from 2,600 steps",
                   "dflash2_mix_s0 (smollm2_h200_s22/train): simulated tau 4.69 at 3,000 steps; within 2% of it from 2,600 steps"]
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
