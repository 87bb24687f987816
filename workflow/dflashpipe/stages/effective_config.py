"""results/effective_config.yaml: the config a run uses, every key, headed by its recipe line."""

from __future__ import annotations

from pathlib import Path

import yaml

from dflashpipe.jobs.atomic import atomic_path


def write_effective_config(path: str, config: dict, recipe: str) -> None:
    """Write ``config`` as YAML (atomically) under a header naming where its values come from and ``recipe``
    (:func:`dflashpipe.config.recipe_line`)."""
    head = ("# The config this run used, every key: the schema's defaults (workflow/schemas/config.schema.yaml),\n"
            "# the embedded tiny target's recipe when it is the target (the line below says), the config files.\n"
            f"# {recipe}\n")
    with atomic_path(path) as tmp:
        Path(tmp).write_text(head + yaml.safe_dump(config, sort_keys=False))
