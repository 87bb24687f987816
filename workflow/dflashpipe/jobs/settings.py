"""The schema as the jobs read it: settings dataclasses with its defaults, its choice lists and marks.

The schema (workflow/schemas/config.schema.yaml) is the single source of truth for keys, types, defaults
and what each key is: result-changing (no mark), ``x-operational`` (read at run time, reruns nothing) or
``x-compile`` (decides the compiled training step). Checking a whole config at start-up is
:mod:`dflashpipe.config`'s (Snakemake glue); this module is what stage code reads.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml


SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


@functools.cache
def load_schema(path: str = str(SCHEMA_PATH)) -> dict:
    # libyaml's loader where PyYAML has it (the same dict, faster): every Snakemake start and job reads it
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _section_schema(section: str) -> dict:
    node = load_schema()
    for part in section.split("."):
        node = node["properties"][part]
    return node


def schema_enum(key: str) -> tuple[str, ...]:
    """The values the schema allows for ``key`` (dotted: ``"train.loss"``; ``*`` steps into a mapping's
    values, ``"datasets.*.format"``; a list's items are looked through): the Python code's one source
    of each choice list."""
    node = load_schema()
    for part in key.split("."):
        node = node["additionalProperties"] if part == "*" else node["properties"][part]
    node = node.get("items", node)
    return tuple(node["enum"])


def on_server(backend: str) -> bool:
    """Whether the ``expand.backend`` generates on a server the user runs (``expand.server``; the schema's
    ``x-server`` list): the job then loads no target and holds no GPU, and a server url is required."""
    return backend in _section_schema("expand")["properties"]["backend"]["x-server"]


def keys_marked(section: str, mark: str) -> tuple[str, ...]:
    """Keys of a config section (dotted: ``"train"``, ``"target.tiny"``) whose schema entry has ``x-<mark>: true``."""
    props = _section_schema(section).get("properties", {})
    return tuple(k for k, sub in props.items() if sub.get(f"x-{mark}"))


def operational_keys(section: str) -> tuple[str, ...]:
    """Keys the jobs read at run time: changing them reruns nothing."""
    return keys_marked(section, "operational")


def compile_keys() -> tuple[str, ...]:
    """``train`` keys that decide the compiled training step (the warm jobs' params)."""
    return keys_marked("train", "compile")


def canonical(value):
    """``value`` with every mapping's keys sorted: Snakemake compares params in key order, so the
    order in which a user writes their config must not rerun anything."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def result_params(config: dict, section: str) -> dict:
    """A config section without its operational keys, keys sorted: what a rule takes as params."""
    node = config
    for part in section.split("."):
        node = node[part]
    skip = operational_keys(section)
    return canonical({k: v for k, v in node.items() if k not in skip})


def schema_settings(*sections: str):
    """Class decorator: a settings dataclass whose defaults are the schema's (declared once, there).

    The class names its fields and their types; each field is a key of one of ``sections``
    (dotted, e.g. ``"target.tiny"``) or a top-level key (``seed``), and takes that key's schema
    default. A field the schema lacks is an error at import. ``JOB_KEYS`` on the class lists the
    keys of its sections that it does not take because the job reads them itself (``threads``, ...);
    :func:`settings` refuses any other key.
    """

    def wrap(cls):
        schemas = [_section_schema(s)["properties"] for s in sections]
        for name, kind in cls.__dict__.get("__annotations__", {}).items():
            if "ClassVar" in str(kind) or name in cls.__dict__:
                continue
            found = [props[name] for props in schemas if name in props]
            if len(found) > 1:
                raise TypeError(f"{cls.__name__}.{name}: a key of more than one of the schema's {', '.join(sections)}")
            sub = found[0] if found else load_schema()["properties"].get(name)
            if sub is None or "default" not in sub:
                raise TypeError(f"{cls.__name__}.{name}: no key '{name}' with a default in the schema's {', '.join(sections)}")
            default = sub["default"]
            setattr(cls, name, field(default_factory=lambda d=default: copy.deepcopy(d)) if isinstance(default, (list, dict)) else default)
        cls.SECTIONS = sections
        return dataclass(cls)

    return wrap


def settings(cls, *sections: dict, **extra):
    """A settings object built from whole config sections (later ones and ``extra`` winning).

    The one way jobs turn config into library arguments. Every key must be a field of ``cls``
    or one of its ``JOB_KEYS`` (read by the job itself, e.g. ``threads``): any other key is
    refused, so a key nothing takes cannot be dropped silently.
    """
    known = {f.name for f in fields(cls)}
    job_keys = set(getattr(cls, "JOB_KEYS", ()))
    values = {}
    for section in (*sections, extra):
        for key, value in section.items():
            if key in known:
                values[key] = value
            elif key not in job_keys:
                raise TypeError(f"{cls.__name__} takes no key '{key}': give it a field, or name it in {cls.__name__}.JOB_KEYS")
    return cls(**values)



def expansion_seed(config: dict) -> int:
    """The expansion's sampling seed: the config's, or 0 when it decodes greedily (which ignores it), so that a
    new seed reruns no greedy expansion."""
    return config["seed"] if config["expand"]["temperature"] > 0 else 0


def job_config(smk) -> dict:
    """The config a Snakemake job reads its settings from: the workflow's, with the job's run overlay merged
    in (the run its ``{run}`` wildcard names, or ``params.run`` for a job that runs share: the AR draft).

    The one way a job reads settings: ``settings(Cls, cfg["section"], ...)`` over sections of this. A rule's
    params only trigger reruns (a section's result-changing keys) or carry what the wiring derives (paths,
    the target folder, a warm chain's compile settings); a job never
    reads a config key back from its params, so an operational key (read at run time) is never lost."""
    run = smk.wildcards.get("run") or smk.params.get("run")
    return run_config(smk.config, run)


def run_config(config: dict, run: str | None) -> dict:
    """The config of one drafter run: the config with ``runs.<run>`` merged in, key by key (``run`` None or
    no ``runs``: the config itself). The jobs of a run read their sections from it."""
    overlay = (config.get("runs") or {}).get(run) if run else None
    if not overlay:
        return config
    out = dict(config)
    for key, value in overlay.items():
        out[key] = {**config[key], **value} if isinstance(value, dict) else value
    return out
