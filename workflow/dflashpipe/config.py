"""Config validation with one-line errors that name the key.

The schema (workflow/schemas/config.schema.yaml) is the single source of
truth for keys, types, defaults and what each key is: result-changing (no
mark), ``x-operational`` (read at run time, reruns nothing) or ``x-compile``
(decides the compiled training step). ``validate_config`` fills defaults in
place, then reports the first problem as ONE line, e.g.::

    config/config.yaml: expand.batch_szie: unknown key (did you mean 'batch_size'?)

Rule params (:func:`result_params`), the warm jobs' compile settings
(:func:`compile_keys`) and the training checkpoint identity derive from the
marks, so a key's role is declared once, in the schema.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from pathlib import Path

import jsonschema
import yaml

from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import SCHEMA_PATH, load_schema, on_server, run_config

#: what a dataset's name may hold: it names files (results/prompts/<name>.parquet) and is a Snakemake wildcard
DATASET_NAME = r"[A-Za-z0-9_.-]+"
REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: config paths may be relative to it
#: the tiny target this checkout ships, and its recipe: applied under the config files for it alone
EMBEDDED_TARGET = REPO_ROOT / "resources" / "tiny_target"
TINY_RECIPE = REPO_ROOT / "config" / "tiny_target.yaml"
#: the keys that say what a drafter run trains: printed, checked and recorded with their values
RECIPE_KEYS = ("drafter.arch", "train.loss", "drafter.num_layers", "drafter.block_size")


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
        hint = _closest(key, known)
        suggestion = f" (did you mean '{hint}'?)" if hint else f" (known keys: {', '.join(known)})"
        return f"{full}: unknown key{suggestion}"
    if err.validator == "oneOf":
        return f"{where}: give exactly one of `path` (a local jsonl/parquet file) or `hf` (a Hugging Face dataset name)"
    if err.validator == "required":
        return f"{where}: {err.message}"
    if err.validator == "anyOf":
        forms = " or ".join(_form(s) for s in err.validator_value)
        # the reason within the form the value has (its type matched): an item out of range, a repeat
        inner = [e for e in err.context if e.relative_path or e.validator not in ("type", "enum")]
        why = ""
        if inner:
            e = inner[0]
            why = f" ({'item ' + _dotted(e.relative_path) + ': ' if e.relative_path else ''}{e.message})"
        return f"{where}: {err.instance!r} is not {forms}{why}"
    if err.validator == "type" and err.validator_value == "object" and err.schema.get("properties"):
        first = next(iter(err.schema["properties"]))  # `gpu: 2` for `gpu: {slots: 2}`
        return (f"{where}: {err.instance!r} is not a section of keys; write it as `{where}: {{{first}: ...}}` "
                f"(its keys: {', '.join(err.schema['properties'])})")
    if err.validator == "type" and isinstance(err.instance, str) and "number" in err.validator_value:
        written = _yaml_float(err.instance)
        if written:
            return f"{where}: {err.message} (YAML reads {err.instance} as text, not a number: write {written})"
    return f"{where}: {err.message}"


def _closest(key: str, known: list[str]) -> str | None:
    """The known key a typo most likely meant, by its whole name or by one of its words (`stpes`:
    'max_steps', where the whole names alone give 'dtype'); ties go to the closer whole name."""
    def score(name):
        whole = difflib.SequenceMatcher(None, key, name).ratio()
        words = [difflib.SequenceMatcher(None, key, w).ratio() for w in name.split("_")]
        return max([whole, *words]), whole

    best = max(known, key=score, default=None)
    return best if best is not None and score(best)[0] >= 0.6 else None


def _yaml_float(text: str) -> str | None:
    """``1e-4`` as YAML reads it as a number (``1.0e-4``: a dot in the mantissa, a sign in the exponent), or
    None when ``text`` is not such a number. PyYAML takes ``1e-4`` and ``1.0e4`` for strings."""
    m = re.fullmatch(r"([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?)(\d+)", text.strip())
    if not m:
        return None
    mantissa, sign, exponent = m.groups()
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign or '+'}{exponent}"


def _form(schema: dict) -> str:
    """One form a key takes, in words (``'auto'``, ``a list of distinct integers >= 1``)."""
    if "enum" in schema:
        return " or ".join(repr(v) for v in schema["enum"])
    if schema.get("type") == "array":
        items = schema.get("items", {})
        what = {"integer": "integers", "number": "numbers", "string": "strings"}.get(items.get("type"), "values")
        bound = f" >= {items['minimum']}" if "minimum" in items else ""
        return f"a list of {'distinct ' if schema.get('uniqueItems') else ''}{what}{bound}"
    return f"of type {schema.get('type')}"


def validate_config(config: dict, schema_path: str, source: str = "config", gpus: int = 1,
                    budget: int | None = None) -> dict:
    """Fill defaults into ``config`` and validate it; raise a one-line UserError.

    ``gpus``: the GPUs the run is given (:func:`run_gpus`), which the GPU counts left null default to;
    ``budget``: ``--resources gpu=N`` when given (:func:`resolve_gpus`)."""
    schema = load_schema(str(schema_path))
    if not isinstance(config, dict):
        raise UserError(f"{source}: the config must be a mapping of keys to values")
    _fill_defaults(config, schema)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), e.validator != "additionalProperties"))
    if errors:
        raise UserError(f"{source}: {_message(errors[0])}")
    _check_references(config, source)
    resolve_gpus(config, source, gpus, budget)
    _check_runs(config, source, validator)
    return config


#: keys a run may not set: the run's GPUs are the workflow's (every run's training job takes them all)
RUN_FIXED = ("train.shards", "train.nodes")


def _check_runs(config: dict, source: str, validator) -> None:
    """Each run of ``runs``: a name that can name files, no GPU count of its own, and its config (the
    config with its overlay) valid as a whole; an error names ``runs.<name>.<key>``."""
    for name, overlay in config["runs"].items():
        if not re.fullmatch(DATASET_NAME, name):
            raise UserError(f"{source}: runs.{name}: a run name holds only letters, digits, '_', '.' and '-' (it names "
                            f"the folder results/runs/<name>); rename it, e.g. {re.sub(r'[^A-Za-z0-9_.-]+', '_', name)!r}")
        for key in RUN_FIXED:
            section, sub = key.split(".")
            if sub in (overlay.get(section) or {}):
                raise UserError(f"{source}: runs.{name}.{key}: the GPUs are the workflow's, not a run's: set {key} at "
                                "the top level")
        merged = run_config(config, name)
        merged = {k: v for k, v in merged.items() if k != "runs"}
        errors = sorted(validator.iter_errors(merged), key=lambda e: len(e.absolute_path))
        if errors:
            raise UserError(f"{source}: runs.{name}.{_message(errors[0])}")
        _check_references(merged, f"{source}: runs.{name}")


#: The GPU count of the Snakemake process that planned the run (:func:`run_gpus`). Its cluster jobs re-read
#: the Snakefile on other machines without ``--resources``; they find the count here (sbatch passes the
#: environment on), so they plan what the planner did.
RUN_GPUS_ENV = "DFLASHPIPE_RUN_GPUS"


def run_gpus(budget, remote_job: bool) -> int:
    """The GPUs this run is given: ``--resources gpu=N`` (``budget``); in a cluster job (``remote_job``), the
    count its planner used; else the GPUs this machine shows (``CUDA_VISIBLE_DEVICES``, else all of them;
    none: 1, the CPU). Recorded in the environment for the run's cluster jobs."""
    from dflashpipe.jobs.lease import visible_gpus

    recorded = os.environ.get(RUN_GPUS_ENV) if remote_job else None
    n = budget if isinstance(budget, int) else int(recorded) if recorded else max(1, visible_gpus())
    os.environ[RUN_GPUS_ENV] = str(n)
    return n


def allocation_nodes() -> int | None:
    """The node count of the SLURM allocation this process runs in (None outside one)."""
    value = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    return int(value) if value and value.isdigit() else None


def resolve_gpus(config: dict, source: str, gpus: int = 1, budget: int | None = None) -> None:
    """Fill the GPU counts left null, then refuse, in one line, a combination that cannot work.

    ``gpu.slots``: ``gpus`` (the run's GPUs, :func:`run_gpus`); ``train.shards`` (ranks per node):
    ``gpu.slots``; ``train.nodes``: the SLURM allocation's node count, else 1. An explicit value wins.
    A run of ``nodes x shards`` ranks splits the global batch over all of them; ``budget``
    (``--resources gpu=N``, when given) must hold a node's shards.
    """
    gpu, train = config["gpu"], config["train"]
    if gpu["slots"] is None:
        gpu["slots"] = gpus
    if train["shards"] is None:
        train["shards"] = gpu["slots"]
    if train["nodes"] is None:
        train["nodes"] = allocation_nodes() or 1
    shards, ranks = train["shards"], train["shards"] * train["nodes"]
    if shards > gpu["slots"]:
        raise UserError(
            f"{source}: train.shards is {shards} but gpu.slots is {gpu['slots']}: every shard of a node needs its "
            "own GPU slot (and warm stamp); raise gpu.slots or lower train.shards"
        )
    if budget is not None and budget < shards:
        raise UserError(
            f"{source}: train.shards is {shards} but --resources gpu={budget}: the training job runs its {shards} "
            f"shards at once, one GPU each; use --resources gpu={shards} or more, or lower train.shards"
        )
    if train["batch_size"] % ranks:
        split = f"train.shards ({shards})" if train["nodes"] == 1 else f"{ranks} ranks (train.nodes x train.shards)"
        raise UserError(
            f"{source}: train.batch_size ({train['batch_size']}) is the global batch of a step, split over {split}; "
            f"make it a multiple of {ranks}"
        )


def _check_references(config: dict, source: str) -> None:
    datasets = config["datasets"]
    train = [n for n, d in datasets.items() if d["use"] == "train"]
    if not train:
        raise UserError(f"{source}: datasets: no dataset has `use: train`; the drafter needs training data")
    for name in config["train"]["repeat"]:
        if name not in train:
            raise UserError(f"{source}: train.repeat.{name}: no dataset named '{name}' with `use: train` under "
                            f"`datasets`; name one of {', '.join(train)}")
    for name, spec in datasets.items():
        if not re.fullmatch(DATASET_NAME, name):
            raise UserError(f"{source}: datasets.{name}: a dataset name holds only letters, digits, '_', '.' and '-' "
                            f"(it names the files results/prompts/<name>.parquet, ...); rename it, e.g. "
                            f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)!r}")
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
    if on_server(ex["backend"]) and not ex["server"]["url"]:
        raise UserError(f"{source}: expand.server.url: expand.backend is {ex['backend']} but no server url is set "
                        "(e.g. http://127.0.0.1:8000/v1)")
    drafter = config["drafter"]
    types = drafter["layer_types"]
    if types is not None and len(types) != drafter["num_layers"]:
        raise UserError(f"{source}: drafter.layer_types: {len(types)} entries for drafter.num_layers {drafter['num_layers']}")
    if types is not None and "sliding_attention" in types and drafter["sliding_window"] is None:
        raise UserError(f"{source}: drafter.layer_types: sliding_attention layers need drafter.sliding_window")
    if drafter["sliding_window"] is not None and drafter["sliding_window"] < drafter["block_size"]:
        raise UserError(f"{source}: drafter.sliding_window must be at least drafter.block_size ({drafter['block_size']})")
    if config["drafter"]["block_size"] * 2 > max(config["tokenize"]["buckets"]):
        raise UserError(f"{source}: tokenize.buckets: the largest bucket must hold at least 2 x drafter.block_size tokens")


def _target_shape(config: dict) -> dict:
    """The target's decoder layers and hidden size, each with where it was read (a real target: its
    config.json, read here without loading anything; the tiny default: its configured sizes)."""
    path = config["target"]["path"]
    if path is None:
        tiny = config["target"]["tiny"]
        return {"layers": (tiny["num_layers"], "target.tiny.num_layers"), "hidden": (tiny["hidden_size"], "target.tiny.hidden_size")}
    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    cfg = cfg.get("text_config", cfg)
    return {"layers": (cfg.get("num_hidden_layers"), file), "hidden": (cfg.get("hidden_size"), file)}


def _check_drafter_fits_target(config: dict, source: str) -> None:
    """What the drafter takes from the target, checked before anything runs (not in the warm job, after
    the regeneration): the tapped layers exist, and DFlash 2's convolution groups divide the hidden size."""
    shape, drafter = _target_shape(config), config["drafter"]
    (layers, layers_from), (hidden, hidden_from) = shape["layers"], shape["hidden"]
    ids = drafter["target_layer_ids"]
    bad = [i for i in ids or [] if layers is not None and i >= layers]
    if bad:
        raise UserError(f"{source}: drafter.target_layer_ids: {bad} are not layers of the target, which has {layers} "
                        f"(0..{layers - 1}; {layers_from}); use ids in 0..{layers - 1}, or null to spread the taps over it")
    group = drafter["conv_group_size"]
    if drafter["arch"] == "dflash2" and hidden is not None and hidden % group:
        fits = max(k for k in range(1, group + 1) if hidden % k == 0)
        raise UserError(f"{source}: drafter.conv_group_size: {group} does not divide the target's hidden size {hidden} "
                        f"({hidden_from}); use a divisor of it, e.g. {fits}")


def _check_target_outside_results(config: dict, source: str) -> None:
    """A target inside the results folder (an AR draft or a drafter the workflow wrote) is refused: its jobs
    delete and rewrite what is there, the target among it (the AR draft's job deleted the target it was
    trained from, after the expansion had been regenerated by it)."""
    results, here = Path(config["results"]).resolve(), Path.cwd().resolve()
    target = Path(config["target"]["path"]).resolve()
    if here.is_relative_to(results) or not target.is_relative_to(results):
        return
    path = config["target"]["path"]
    raise UserError(f"{source}: target.path: {path} is inside {config['results']}/, which the workflow writes: its jobs "
                    f"delete and rewrite what is there; copy the model out (cp -r {path} my_target) and set target.path "
                    "to the copy")


def load_yaml(path: str) -> dict:
    """A YAML config file, or one line naming the file, line and column of a syntax error."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}: YAML syntax error ({problem}); fix that line (indentation, a missing ':' or bracket)") from None
    return data if data is not None else {}


def user_datasets(configfiles, cli_config: dict | None = None) -> dict | None:
    """The datasets a user names: those of the last ``--configfile`` with a ``datasets`` section, or of ``--config``.

    Snakemake merges config files key by key; for ``datasets`` (a map of names) that
    would add the shipped datasets, and those of earlier files, to a user's own.
    """
    found = None
    for f in configfiles:
        data = load_yaml(str(f))
        if isinstance(data, dict) and "datasets" in data:
            found = data["datasets"]
    if cli_config and "datasets" in cli_config:
        found = cli_config["datasets"]
    return found


def repo_path(p: str) -> str:
    """A config path: absolute, or relative to the working directory, else to the repository."""
    if os.path.isabs(p) or os.path.exists(p) or not (REPO_ROOT / p).exists():
        return p
    return str(REPO_ROOT / p)


def embedded_target(path) -> bool:
    """Whether ``target.path`` is the embedded tiny target: null (trained here) or the shipped copy."""
    return path is None or Path(repo_path(str(path))).resolve() == EMBEDDED_TARGET.resolve()


def _fill_under(config: dict, layer: dict) -> None:
    """Set each key of ``layer`` that ``config`` leaves out (nested keys one by one)."""
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _fill_under(config[key], value)
        elif key not in config:
            config[key] = copy.deepcopy(value)


def apply_tiny_recipe(config: dict) -> None:
    """With the embedded tiny target, fill the keys the config files leave out from
    config/tiny_target.yaml (before the schema's defaults); any other target: nothing."""
    target = config.get("target")
    if embedded_target(target.get("path") if isinstance(target, dict) else None):
        _fill_under(config, load_yaml(str(TINY_RECIPE)))


#: the shipped prompt files of the tiny target's own domain (what it was trained on, and their held-out
#: sets), by name: a checkout moved or copied keeps them
TINY_DOMAIN = tuple(f"{kind}_{part}.jsonl.gz" for kind in ("math", "code") for part in ("train", "heldout"))


def tiny_target_caveat(config: dict) -> str | None:
    """With the embedded tiny target and data outside its domain (:data:`TINY_DOMAIN`), the line that says
    what its replies and figures are; else None. The run's log, eval.csv and the model card carry it."""
    if not embedded_target(config["target"]["path"]):
        return None
    foreign = sorted(n for n, d in config["datasets"].items() if not d.get("path") or Path(d["path"]).name not in TINY_DOMAIN)
    if not foreign:
        return None
    return (f"the embedded tiny target (a 1.3M-parameter model of short math and code replies) regenerates and "
            f"answers datasets {', '.join(foreign)}: off its domain, its replies are not what a real model would "
            "write, so tau and speed-ups measured here do not transfer to a real target (docs/real-target.md, "
            "\"The tiny target's limits\"); set target.path to your model")


def recipe_line(config: dict) -> str:
    """What the run trains, in one line: the recipe keys with their values, and whose recipe it is."""
    def value(key):
        section, name = key.split(".")
        return config[section][name]

    keys = " ".join(f"{k}={value(k)}" for k in RECIPE_KEYS)
    whose = (f"the embedded tiny target's 2-core demo recipe, {TINY_RECIPE.relative_to(REPO_ROOT)}, under your config"
             if embedded_target(config["target"]["path"]) else "the schema's recipe for a real target, under your config")
    return f"recipe: {keys} ({whose})"


def prepare_config(config: dict, source: str, user_files=(), cli_config: dict | None = None, gpus: int = 1,
                   budget: int | None = None) -> list[str]:
    """What the workflow checks before any job runs, in one place; raises a one-line UserError.

    The user's datasets replace the shipped ones (:func:`user_datasets`), the embedded tiny target's
    recipe fills what the files leave out (:func:`apply_tiny_recipe`), the config is validated (the
    schema's defaults filled in), every dataset file is there, and a configured target is checked, including the
    drafter's MASK token (decided now from its files, not hours later in training) and the
    drafter keys that must fit its shape (:func:`_check_drafter_fits_target`).
    Returns lines worth showing the user.
    """
    from dflashpipe.inputs.data import LOCAL_SUFFIXES
    from dflashpipe.inputs.target import check_target_files, resolve_mask_token

    datasets = user_datasets(user_files, cli_config)
    if datasets is not None:
        config["datasets"] = copy.deepcopy(datasets)
    if isinstance(config, dict):
        apply_tiny_recipe(config)
    validate_config(config, str(SCHEMA_PATH), source, gpus, budget)
    notes = [recipe_line(config)]
    for name, spec in config["datasets"].items():
        if spec.get("path"):
            spec["path"] = repo_path(spec["path"])
            if not os.path.isfile(spec["path"]):
                raise UserError(f"{source}: datasets.{name}.path: {spec['path']} is not a file (a relative path is "
                                "read from the working directory, then from the checkout); fix the path or remove "
                                "the dataset")
            if not spec["path"].lower().endswith(LOCAL_SUFFIXES):  # refused before planning, not by the job
                raise UserError(f"{source}: datasets.{name}.path: {spec['path']} is not a file the prompts stage "
                                f"reads; give it as one of {', '.join(LOCAL_SUFFIXES)} (README: A real target and real datasets)")
    if config["target"]["path"] is not None:
        config["target"]["path"] = repo_path(config["target"]["path"])  # the shipped tiny target from any -d
        _check_target_outside_results(config, source)
        check_target_files(config["target"]["path"])
        mask_id, how = resolve_mask_token(config["target"]["path"], config["drafter"]["mask_token_id"])
        if config["drafter"]["mask_token_id"] is None:
            notes.append(f"drafter.mask_token_id: {mask_id}, {how}")
    else:  # the tiny target: trained by a job of this workflow, read by its weights' checksum
        from dflashpipe.inputs.target import check_made_weights
        from dflashpipe.wiring import Paths

        check_made_weights(Paths(config["results"]).target_model, "the tiny target this workflow trained")
    _check_drafter_fits_target(config, source)
    for name in config["runs"]:
        _check_drafter_fits_target(run_config(config, name), f"{source}: runs.{name}")
    caveat = tiny_target_caveat(config)
    return notes + ([f"NOTE: {caveat}"] if caveat else [])


def _merge(base: dict, over: dict) -> dict:
    """Snakemake's merge of --configfile files onto the workflow's config: nested keys update."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m dflashpipe.config my.yaml [more.yaml]``: check config files as the workflow will read them.

    Snakemake parses ``--configfile`` files before the workflow starts and
    reports a YAML syntax error without the file or line; this names both, then
    checks the merged config (onto config/config.yaml) as the workflow does
    (:func:`prepare_config`), prints the recipe, and reads the data as the prompts jobs will
    (:func:`check_datasets`).
    """
    import sys

    files = list(sys.argv[1:] if argv is None else argv)
    if not files:
        print("usage: python -m dflashpipe.config CONFIG.yaml [MORE.yaml ...]", file=sys.stderr)
        return 2
    try:
        merged = load_yaml(str(SCHEMA_PATH.parents[2] / "config" / "config.yaml"))
        for f in files:
            data = load_yaml(f)
            if not isinstance(data, dict):
                kind = "a list" if isinstance(data, list) else f"the single value {data!r}"
                raise UserError(f"{f}: a config maps keys to values at the top level (e.g. `train: {{max_steps: 100}}`), "
                                f"but this file holds {kind}; write its settings as `key: value` lines"
                                + (" without a leading '- '" if isinstance(data, list) else ""))
            merged = _merge(merged, data)
        notes = prepare_config(merged, ", ".join(files), files)
        for line in notes:
            print(line)
        for line in check_datasets(merged):
            print(line)
    except UserError as err:
        print(f"ERROR: {err}", file=sys.stderr)
        return 1
    print(f"ok: {', '.join(files)}")
    return 0


def check_datasets(config: dict):
    """Read every local dataset as its prompts job will (columns, roles, bad rows under
    ``data.max_bad_rows``) and yield a line of counts per dataset; a Hub dataset is left to its job."""
    from dflashpipe.inputs.data import load_rows, normalize, summary_line

    for name, spec in config["datasets"].items():
        if not spec.get("path"):
            yield f"datasets.{name}: {spec['hf']} (a Hugging Face dataset: read by its prompts job, not here)"
            continue
        _, stats = normalize(load_rows(spec, name), spec, name, config["data"]["max_bad_rows"])
        yield f"datasets.{name}: {summary_line(stats)}"


if __name__ == "__main__":
    raise SystemExit(main())
