"""Every config key has one declaration (the schema) and a consumer; settings objects take exactly their keys.

A key of a section with a settings class is a field of that class (its default: the schema's), or one
of the class's ``JOB_KEYS`` (read by the job itself, e.g. ``threads``). A key of a section without
one (``tokenize``, ``gpu``, ``datasets``, the top level) is read by name somewhere in the workflow.
config/README.md documents each key once, in its section's table.
"""

import dataclasses
import re
from pathlib import Path

import pytest

from conftest import REPO
from dflashpipe.training.train import TrainConfig
from dflashpipe.evaluate.ar_draft import ARDraftConfig
from dflashpipe.evaluate.settings import EvalSettings
from dflashpipe.inputs.tiny_target import TinyTargetConfig
from dflashpipe.jobs.settings import load_schema, schema_settings, settings
from dflashpipe.stages.expand import ExpandSettings
from dflashpipe.stages.expand_openai import ServerSettings

# (settings class, the config sections it takes, the keys of those sections the job reads itself)
SETTINGS = [
    (TrainConfig, ("drafter", "train"), TrainConfig.JOB_KEYS),
    (ExpandSettings, ("expand",), ExpandSettings.JOB_KEYS),
    (ServerSettings, ("expand.server",), ()),
    (TinyTargetConfig, ("target.tiny",), TinyTargetConfig.JOB_KEYS),
    (ARDraftConfig, ("ar_draft",), ARDraftConfig.JOB_KEYS),
    (EvalSettings, ("evaluate",), EvalSettings.JOB_KEYS),
]
TOP_LEVEL_FIELDS = {"seed"}  # top-level keys a settings class takes, passed by name (settings(..., seed=...))
# ARDraftConfig inherits TinyTargetConfig's fields that ar_draft lacks (at target.tiny's defaults): the target's
# vocabulary is used, and it has no held-out checks
IGNORED_FIELDS = {(ARDraftConfig, name) for name in ("vocab_size", "eval_every", "eval_rows", "format_check_prompts")}
# EvalSettings' fields past the evaluate section: expand.chat_template_kwargs (passed by name) and the
# library's own knobs a caller may set (tie_tolerance, warmup, cudnn_sdpa), no config keys
IGNORED_FIELDS |= {(EvalSettings, name) for name in ("chat_template_kwargs", "tie_tolerance", "warmup", "cudnn_sdpa")}


def section_keys(node=None, prefix=""):
    """Dotted names of the schema's leaf keys (a dataset's keys as ``datasets.*.key``; a mapping of names to
    numbers, ``train.repeat``, is one key)."""
    node = load_schema() if node is None else node
    out = []
    for key, sub in node.get("properties", {}).items():
        values = sub.get("additionalProperties")
        nested = sub.get("type") == "object" and ("properties" in sub or isinstance(values, dict) and "properties" in values)
        out += section_keys(sub, f"{prefix}{key}.") if nested else [f"{prefix}{key}"]
    if isinstance(node.get("additionalProperties"), dict):
        out += section_keys(node["additionalProperties"], f"{prefix}*.")
    return out


def workflow_source() -> str:
    files = [REPO / "Snakefile", *(REPO / "workflow" / "rules").glob("*.smk"), *(REPO / "workflow").rglob("*.py")]
    return "\n".join(Path(f).read_text() for f in files)


def read_by_name(key: str, source: str) -> bool:
    return f'["{key}"]' in source or f'.get("{key}"' in source


def test_every_schema_key_has_a_consumer():
    """A key nothing takes fails here: give it a settings field, or read it in the job that uses it."""
    source = workflow_source()
    unconsumed = []
    for key in section_keys():
        section, _, name = key.rpartition(".")
        classes = [(cls, job_keys) for cls, sections, job_keys in SETTINGS if section in sections]
        if any(name in {f.name for f in dataclasses.fields(cls)} for cls, _ in classes):
            continue
        if classes and not any(name in job_keys for _, job_keys in classes):
            unconsumed.append(f"{key}: no field of {', '.join(cls.__name__ for cls, _ in classes)}, nor one of its JOB_KEYS")
        elif not read_by_name(name, source):
            unconsumed.append(f"{key}: read nowhere by name ([\"{name}\"] or .get(\"{name}\"))")
    assert not unconsumed, f"schema keys that nothing takes: {unconsumed}"


def test_every_settings_field_is_a_schema_key():
    """A field the schema lacks fails here (and, for a ``schema_settings`` class, at import)."""
    keys = set(section_keys())
    stray = []
    for cls, sections, job_keys in SETTINGS:
        for f in dataclasses.fields(cls):
            if (cls, f.name) in IGNORED_FIELDS or f.name in TOP_LEVEL_FIELDS and f.name in keys:
                continue
            if not any(f"{s}.{f.name}" in keys for s in sections):
                stray.append(f"{cls.__name__}.{f.name}")
        stray += [f"{cls.__name__}.JOB_KEYS: {k}" for k in job_keys if not any(f"{s}.{k}" in keys or any(
            x.startswith(f"{s}.{k}.") for x in keys) for s in sections)]
    assert not stray, f"settings fields that are no schema key: {stray}"


def test_every_settings_class_takes_its_defaults_from_the_schema():
    """No class repeats a schema default: each is a ``schema_settings`` class of exactly its sections."""
    for cls, sections, _ in SETTINGS:
        assert cls.__dict__.get("SECTIONS") == sections, f"{cls.__name__}: not @schema_settings{sections}"


def test_the_drafter_architecture_keys_are_declared_once():
    """TrainConfig takes DrafterConfig's architecture fields (model.ARCH_KEYS) with the schema's defaults: a new
    architecture key is a ``drafter`` entry in the schema and a DrafterConfig field, nothing more."""
    from dflashpipe.drafter.model import ARCH_KEYS, DrafterConfig

    drafter = load_schema()["properties"]["drafter"]["properties"]
    assert set(ARCH_KEYS) == set(drafter) - {"block_size", "num_layers", "target_layer_ids", "mask_token_id"}
    cfg = TrainConfig()
    assert {k: getattr(cfg, k) for k in ARCH_KEYS} == {k: drafter[k]["default"] for k in ARCH_KEYS}
    # and DrafterConfig's own defaults are the schema's: a drafter built without them is the pipeline's
    own = {f.name: f.default for f in dataclasses.fields(DrafterConfig) if f.name in ARCH_KEYS}
    assert own == {k: drafter[k]["default"] for k in ARCH_KEYS}

def test_schema_settings_take_the_schema_defaults_and_refuse_fields_it_lacks():
    @schema_settings("train")
    class Train:
        JOB_KEYS = ("threads",)
        lr: float
        seed: int

    assert Train() == Train(lr=load_schema()["properties"]["train"]["properties"]["lr"]["default"], seed=0)
    with pytest.raises(TypeError, match=r"Nope.learning_rate: no key 'learning_rate'"):

        @schema_settings("train")
        class Nope:
            learning_rate: float

    with pytest.raises(TypeError, match=r"Both.lr: a key of more than one"):

        @schema_settings("target.tiny", "ar_draft")
        class Both:
            lr: float


def test_settings_refuse_a_key_they_do_not_take(tmp_path):
    from conftest import mini_config

    from dflashpipe.config import validate_config
    from dflashpipe.jobs.settings import SCHEMA_PATH

    config = validate_config(mini_config(), str(SCHEMA_PATH))
    cfg = settings(TrainConfig, config["drafter"], config["train"], seed=config["seed"])  # threads, shards: the job's
    assert cfg.lr == config["train"]["lr"] and cfg.num_layers == config["drafter"]["num_layers"]
    with pytest.raises(TypeError, match=r"TrainConfig takes no key 'lr_decay'.*TrainConfig.JOB_KEYS"):
        settings(TrainConfig, config["drafter"], {**config["train"], "lr_decay": 0.5})
    with pytest.raises(TypeError, match=r"ServerSettings takes no key 'threads'"):
        settings(ServerSettings, {**config["expand"]["server"], "threads": 2})


def readme_tables() -> dict[str, str]:
    """config/README.md's table rows: dotted key -> the row (a dataset's keys as ``datasets.*.key``, a run's
    as ``runs.*.key``)."""
    section, rows = "", {}
    for line in (REPO / "config" / "README.md").read_text().splitlines():
        if line.startswith("## "):
            m = re.match(r"## `([\w.]+)`", line)
            section = m.group(1) if m else ""
        elif line.startswith("| `"):
            names = re.findall(r"`([\w.]+)`", line.split("|")[1])
            prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""  # `server.url`, `a`, `b`
            for name in names:
                full = name if "." in name else prefix + name
                if section in ("datasets", "runs"):  # mappings of names: a name's keys
                    full = f"{section}.*.{full}"
                elif section and not full.startswith(section + "."):
                    full = f"{section}.{full}"
                rows[full] = line
    return rows


def test_config_readme_documents_every_key_once_in_its_section():
    keys, documented = set(section_keys()), set(readme_tables())
    assert not keys - documented, f"config/README.md: no table row for {sorted(keys - documented)}"
    assert not documented - keys, f"config/README.md documents keys the schema lacks: {sorted(documented - keys)}"


def test_config_readme_says_what_a_train_key_reruns_as_the_schema_marks_it():
    """The `train` section's three lists (warm chain, training only, nothing) follow the x-compile and
    x-operational marks."""
    from dflashpipe.jobs.settings import compile_keys, operational_keys

    text = (REPO / "config" / "README.md").read_text()
    part = text[text.index("What a change reruns"):text.index("Either way evaluation")]
    # each bullet: the keys, then "(marked ...)" or ":"
    listed = [set(re.findall(r"`(\w+)`", re.split(r"\(marked|:", b)[0])) for b in part.split("\n* ")[1:]]
    train = {k.removeprefix("train.") for k in section_keys() if k.startswith("train.")}
    compiled, operational = set(compile_keys()), set(operational_keys("train"))
    assert listed[0] == compiled
    assert listed[2] == operational - compiled
    assert listed[1] == train - compiled - operational


def test_jobs_read_their_settings_one_way():
    """Every job script reads config keys from ``job_config(snakemake)`` (its run's overlay merged in), never
    from ``snakemake.config`` (which misses the overlay) nor back from its params (which hold a section's
    result-changing keys only: an operational key read there would silently take the schema's default)."""
    import ast

    # what the wiring derives (no config key holds it): a warm chain's compile settings (of its signature)
    derived = {("warm.py", "p.compile")}
    readers = 0
    for script in sorted((REPO / "workflow" / "scripts").glob("*.py")):
        tree = ast.parse(script.read_text())
        params_names = {"p"} | {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                               for t in n.targets if isinstance(t, ast.Name)
                               and ast.unparse(n.value) == "snakemake.params"}
        for node in ast.walk(tree):
            assert ast.unparse(node) != "snakemake.config", f"{script.name}: reads snakemake.config, not job_config(snakemake)"
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "settings":
                readers += 1
                for arg in [*node.args[1:], *(k.value for k in node.keywords)]:
                    used = {ast.unparse(n) for n in ast.walk(arg) if isinstance(n, ast.Attribute)}
                    from_params = {u for u in used if u.startswith("snakemake.params") or u.split(".")[0] in params_names}
                    assert from_params <= {u for name, u in derived if name == script.name}, (
                        f"{script.name}: settings(...) reads {sorted(from_params)} from params")
    assert readers >= 5  # the jobs that build settings objects: train, warm, expand, evaluate, ar_draft, tiny target
