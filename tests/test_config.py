import copy

import pytest
import yaml

from conftest import REPO, mini_config
from dflashpipe.config import validate_config
from dflashpipe.errors import UserError

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
    bad = _merge(base, {"train": {"compile": "everything"}})
    with pytest.raises(UserError, match=r"train.compile: 'everything' is not one of"):
        check(bad)
