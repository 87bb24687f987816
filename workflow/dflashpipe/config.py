"""Config validation with one-line errors that name the key.

The schema (workflow/schemas/config.schema.yaml) is the single source of
truth for keys, types and defaults. ``validate_config`` fills defaults in place,
then reports the first problem as ONE line, e.g.::

    config/config.yaml: expand.batch_szie: unknown key (did you mean 'batch_size'?)
"""

from __future__ import annotations

import copy
import difflib

import jsonschema
import yaml

from dflashpipe.errors import UserError


def _fill_defaults(instance, schema):
    if not isinstance(instance, dict) or schema.get("type") != "object":
        return
    for key, sub in schema.get("properties", {}).items():
        if key not in instance and "default" in sub:
            instance[key] = copy.deepcopy(sub["default"])
        if key in instance:
            _fill_defaults(instance[key], sub)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for key, value in instance.items():
            if key not in schema.get("properties", {}):
                _fill_defaults(value, extra)


def _dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def _message(err: jsonschema.ValidationError) -> str:
    where = _dotted(err.absolute_path)
    if err.validator == "additionalProperties":
        known = list(err.schema.get("properties", {}))
        extra = [k for k in err.instance if k not in known]
        key = extra[0] if extra else "?"
        full = f"{where}.{key}" if err.absolute_path else key
        hint = difflib.get_close_matches(key, known, n=1)
        suggestion = f" (did you mean '{hint[0]}'?)" if hint else f" (known keys: {', '.join(known)})"
        return f"{full}: unknown key{suggestion}"
    if err.validator == "oneOf":
        return f"{where}: give exactly one of `path` (a local jsonl/parquet file) or `hf` (a Hugging Face dataset name)"
    if err.validator == "required":
        return f"{where}: {err.message}"
    return f"{where}: {err.message}"


def validate_config(config: dict, schema_path: str, source: str = "config") -> dict:
    """Fill defaults into ``config`` and validate it; raise a one-line UserError."""
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise UserError(f"{source}: the config must be a mapping of keys to values")
    _fill_defaults(config, schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), e.validator != "additionalProperties"))
    if errors:
        raise UserError(f"{source}: {_message(errors[0])}")
    _check_references(config, source)
    return config


def _check_references(config: dict, source: str) -> None:
    datasets = config["datasets"]
    train = [n for n, d in datasets.items() if d["use"] == "train"]
    if not train:
        raise UserError(f"{source}: datasets: no dataset has `use: train`; the drafter needs training data")
    for name, spec in datasets.items():
        if spec.get("messages_column") and spec.get("prompt_column"):
            raise UserError(f"{source}: datasets.{name}: set `messages_column` or `prompt_column`, not both")
    tiny = config["target"]["tiny"]
    if config["target"]["path"] is None:
        for name in tiny["train_datasets"]:
            if name not in datasets:
                raise UserError(f"{source}: target.tiny.train_datasets: no dataset named '{name}' under `datasets`")
        if tiny["heldout_dataset"] not in datasets:
            raise UserError(f"{source}: target.tiny.heldout_dataset: no dataset named '{tiny['heldout_dataset']}' under `datasets`")
        if tiny["num_heads"] % tiny["num_kv_heads"]:
            raise UserError(f"{source}: target.tiny.num_heads must be a multiple of num_kv_heads")
    ex = config["expand"]
    if ex["num_samples"] > 1 and ex["temperature"] == 0:
        raise UserError(f"{source}: expand.num_samples is {ex['num_samples']} with temperature 0 (greedy samples are identical); set temperature > 0")
    if config["drafter"]["block_size"] * 2 > max(config["tokenize"]["buckets"]):
        raise UserError(f"{source}: tokenize.buckets: the largest bucket must hold at least 2 x drafter.block_size tokens")
