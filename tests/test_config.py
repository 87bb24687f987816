import copy

import pytest
import yaml

from conftest import REPO, mini_config
from dflashpipe.config import validate_config
from dflashpipe.jobs.errors import UserError

SCHEMA = str(REPO / "workflow/schemas/config.schema.yaml")


def check(cfg):
    return validate_config(copy.deepcopy(cfg), SCHEMA, "my.yaml")


def test_default_config_is_valid_and_gets_defaults():
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    out = check(cfg)
    assert out["datasets"]["math"]["split"] == "train"  # default filled inside a dataset entry
    assert out["expand"]["temperature"] == 0.0


def test_defaults_fill_missing_sections():
    out = check({"target": {"path": "some/model"}, "datasets": {"d": {"path": "x.jsonl"}}})
    assert out["expand"]["batch_size"] == 64
    assert out["target"]["tiny"]["num_layers"] == 4
    assert out["datasets"]["d"]["use"] == "train"


def test_typo_names_key_and_suggests():
    cfg = mini_config()
    cfg["expand"]["batch_szie"] = 3
    with pytest.raises(UserError) as e:
        check(cfg)
    msg = str(e.value)
    assert msg == "my.yaml: expand.batch_szie: unknown key (did you mean 'batch_size'?)"


def test_wrong_type_names_key():
    cfg = mini_config()
    cfg["expand"]["max_new_tokens"] = "many"
    with pytest.raises(UserError, match=r"^my.yaml: expand.max_new_tokens: 'many' is not of type 'integer'$"):
        check(cfg)


def test_dataset_needs_exactly_one_source():
    cfg = mini_config()
    cfg["datasets"]["math"]["hf"] = "openai/gsm8k"
    with pytest.raises(UserError, match=r"datasets.math: give exactly one of `path`"):
        check(cfg)


def test_unknown_dataset_reference():
    cfg = mini_config()
    cfg["target"]["tiny"]["train_datasets"] = ["maths"]
    with pytest.raises(UserError, match="target.tiny.train_datasets: no dataset named 'maths'"):
        check(cfg)


def test_repeat_names_a_training_dataset():
    cfg = mini_config()
    cfg["train"]["repeat"] = {"math_heldout": 2}  # an eval set: not in the training mix
    with pytest.raises(UserError, match=r"train.repeat.math_heldout: no dataset named 'math_heldout' with `use: train`"):
        check(cfg)


def test_greedy_with_several_samples_is_refused():
    cfg = mini_config()
    cfg["expand"]["temperature"] = 0.0
    cfg["expand"]["num_samples"] = 4
    with pytest.raises(UserError, match="expand.num_samples"):
        check(cfg)


def test_error_is_one_line():
    cfg = mini_config()
    cfg["tokenize"] = {"buckets": "big"}
    with pytest.raises(UserError) as e:
        check(cfg)
    assert "\n" not in str(e.value)


def _merge(base: dict, over: dict) -> dict:
    """Snakemake's --configfile overlay: nested dicts merge, other values replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def test_example_configs_are_valid():
    eight = check(yaml.safe_load((REPO / "config/qwen3_8b_8gpu.yaml").read_text()))
    assert eight["train"]["shards"] == eight["gpu"]["slots"] == 8 and eight["train"]["compile"] == "layers"
    base = yaml.safe_load((REPO / "config/config.yaml").read_text())
    one_gpu = check(_merge(base, yaml.safe_load((REPO / "config/gpu_1x_tiny.yaml").read_text())))
    assert one_gpu["gpu"]["slots"] == 1 and one_gpu["target"]["path"] == base["target"]["path"] == "resources/tiny_target"
    assert one_gpu["datasets"] == check(base)["datasets"]  # the overlay changes only what it names
    smol = check(_merge(base, yaml.safe_load((REPO / "config/smollm2.yaml").read_text())))
    assert smol["train"]["repeat"] == {"code": 3, "code_more": 3} and "chat" in smol["datasets"]
    for runs_file, n in (("recipes.yaml", 12), ("seeds.yaml", 3)):  # the shipped runs overlays, on smollm2's recipe
        runs = check(_merge(copy.deepcopy(smol), yaml.safe_load((REPO / "config" / runs_file).read_text())))["runs"]
        assert len(runs) == n
    assert runs_file and check(_merge(smol, yaml.safe_load((REPO / "config/recipes.yaml").read_text())))["runs"][
        "dspark_s2"] == {"drafter": {"arch": "dspark", "block_size": 7}, "train": {"loss": "dspark"}, "seed": 2}
    bad = _merge(base, {"train": {"compile": "everything"}})
    with pytest.raises(UserError, match=r"train.compile: 'everything' is not one of"):
        check(bad)


def test_a_dataset_name_that_cannot_name_a_file_is_refused_in_one_line():
    cfg = mini_config()
    cfg["datasets"]["openai/gsm8k"] = cfg["datasets"].pop("math")
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == ("my.yaml: datasets.openai/gsm8k: a dataset name holds only letters, digits, '_', '.' and "
                            "'-' (it names the files results/prompts/<name>.parquet, ...); rename it, e.g. 'openai_gsm8k'")


def test_drafter_keys_that_do_not_fit_the_target_are_refused_before_anything_runs(tmp_path):
    """Tapped layers past the target's depth, or DFlash 2 convolution groups that do not divide its hidden
    size, are refused by the checks the workflow runs before planning (python -m dflashpipe.config runs
    the same): a real target's sizes come from its config.json, the tiny default's from its settings."""
    import subprocess
    import sys

    from dflashpipe.config import prepare_config

    mine = tmp_path / "my.yaml"
    mine.write_text(yaml.safe_dump({"drafter": {"target_layer_ids": [1, 4]}}))  # the shipped target has 4 layers
    res = subprocess.run([sys.executable, "-m", "dflashpipe.config", str(mine)], capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.strip() == (
        f"ERROR: {mine}: drafter.target_layer_ids: [4] are not layers of the target, which has 4 (0..3; "
        f"{REPO}/resources/tiny_target/config.json); use ids in 0..3, or null to spread the taps over it")
    mine.write_text(yaml.safe_dump({"drafter": {"target_layer_ids": [0, 3]}}))
    assert subprocess.run([sys.executable, "-m", "dflashpipe.config", str(mine)], capture_output=True, cwd=tmp_path).returncode == 0

    cfg = mini_config()  # the tiny default: hidden size 32
    cfg["drafter"]["conv_group_size"] = 12
    with pytest.raises(UserError) as e:
        prepare_config(cfg, "my.yaml")
    assert str(e.value) == ("my.yaml: drafter.conv_group_size: 12 does not divide the target's hidden size 32 "
                            "(target.tiny.hidden_size); use a divisor of it, e.g. 8")
    cfg = mini_config()
    cfg["drafter"].update(arch="dflash", conv_group_size=12)  # no convolutions in the paper's drafter
    prepare_config(cfg, "my.yaml")


def test_a_config_file_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    """`python -m dflashpipe.config` on a file of a list (a stray '- ') gave an AttributeError traceback."""
    from dflashpipe.config import main

    bad = tmp_path / "my.yaml"
    bad.write_text("- results: out\n")
    assert main([str(bad)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}: a config maps keys to values at the top level (e.g. `train: {{max_steps: 100}}`), but this "
        "file holds a list; write its settings as `key: value` lines without a leading '- '")


def test_a_number_yaml_reads_as_text_says_how_to_write_it():
    """YAML reads `1e-4` (no dot) as a string: the error said only "'1e-4' is not of type 'number'"."""
    cfg = mini_config()
    cfg["train"]["lr"] = yaml.safe_load("lr: 1e-4")["lr"]
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == ("my.yaml: train.lr: '1e-4' is not of type 'number' (YAML reads 1e-4 as text, not a "
                            "number: write 1.0e-4)")
    assert yaml.safe_load("lr: 1.0e-4")["lr"] == 1e-4  # the spelling it suggests is a number


def test_a_typo_is_matched_against_the_words_of_a_key():
    """`train.stpes` suggested 'dtype' (the closest whole name), not 'max_steps'."""
    cfg = mini_config()
    cfg["train"]["stpes"] = 100
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == "my.yaml: train.stpes: unknown key (did you mean 'max_steps'?)"


def test_a_dataset_file_of_another_format_is_refused_while_planning(tmp_path):
    """A .csv dataset passed the dry run and failed only in the prompts job: now one line before planning."""
    from dflashpipe.config import prepare_config

    data = tmp_path / "mine.csv"
    data.write_text("prompt\nhello\n")
    cfg = mini_config()
    cfg["datasets"]["math"]["path"] = str(data)
    with pytest.raises(UserError) as e:
        prepare_config(cfg, "my.yaml")
    assert str(e.value) == (f"my.yaml: datasets.math.path: {data} is not a file the prompts stage reads; give it as "
                            "one of .jsonl, .jsonl.gz, .json, .json.gz, .parquet (README: A real target and real datasets)")
    data.rename(tmp_path / "mine.JSONL")  # the stage matches the name case-blind
    cfg["datasets"]["math"]["path"] = str(tmp_path / "mine.JSONL")
    prepare_config(cfg, "my.yaml")


def test_a_value_where_a_section_goes_names_its_keys():
    """`gpu: 2` said only "2 is not of type 'object'"."""
    cfg = mini_config()
    cfg["gpu"] = 2
    with pytest.raises(UserError) as e:
        check(cfg)
    assert str(e.value) == ("my.yaml: gpu: 2 is not a section of keys; write it as `gpu: {slots: ...}` "
                            "(its keys: slots, lock_dir, lease_timeout_s)")
