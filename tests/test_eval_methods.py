"""The evaluation methods are declared once, in dflashpipe.evaluate.methods; what else names them agrees.

The config schema is YAML and cannot import the registry, so it mirrors the names and the default
list: these tests fail until the two agree. Everything else (the plots' labels, the AR draft's rule
and input, the order of summaries and tables) reads the registry.
"""

from __future__ import annotations

import ast
import copy

import pytest
import yaml

from conftest import REPO, mini_config
from dflashpipe.config import validate_config
from dflashpipe.evaluate.methods import AR_DRAFT, BY_NAME, DEFAULT_METHODS, DRAFTER, METHODS, NAMES, REFERENCE, select
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.settings import SCHEMA_PATH, load_schema
from dflashpipe.wiring import Pipeline


def _schema_methods() -> dict:
    return load_schema()["properties"]["evaluate"]["properties"]["methods"]


def test_the_schema_mirrors_the_registry():
    schema = _schema_methods()
    assert schema["items"]["enum"] == list(NAMES), (
        "workflow/schemas/config.schema.yaml: evaluate.methods' enum must list the registry's methods "
        "(workflow/dflashpipe/evaluate/methods.py), in its order"
    )
    assert schema["default"] == list(DEFAULT_METHODS), (
        "workflow/schemas/config.schema.yaml: evaluate.methods' default must list the registry's default=True methods"
    )


def test_every_entry_is_complete():
    assert len(BY_NAME) == len(METHODS), "two entries with one name"
    assert REFERENCE in BY_NAME
    for m in METHODS:
        assert m.name.isidentifier() and m.label.strip(), m
        assert m.needs in (None, DRAFTER, AR_DRAFT), m
        assert callable(m.start), m


def test_the_shipped_configs_list_registered_methods():
    listed = [yaml.safe_load(f.read_text()).get("evaluate", {}).get("methods") for f in (REPO / "config").glob("*.yaml")]
    assert any(listed)  # config/tiny_target.yaml lists its methods
    for methods in filter(None, listed):
        assert set(methods) <= set(NAMES)


def test_an_unregistered_method_is_refused_at_start_up_and_in_the_library():
    cfg = mini_config()
    cfg["evaluate"]["methods"] = ["dflash", "medusa"]
    with pytest.raises(UserError, match="evaluate.methods"):
        validate_config(cfg, str(SCHEMA_PATH))
    with pytest.raises(UserError, match=r"unknown \['medusa'\]"):
        select(["dflash", "medusa"], ar_draft_given=True)


def test_selection_runs_the_reference_in_registry_order():
    assert [m.name for m in select(["prompt_lookup", "dflash"], ar_draft_given=False)] == ["dflash", "ar", "prompt_lookup"]
    # no methods given: the defaults whose models are there
    without = [m.name for m in select([], ar_draft_given=False)]
    assert without == [n for n in DEFAULT_METHODS if BY_NAME[n].needs != AR_DRAFT]
    assert [m.name for m in select([], ar_draft_given=True)] == list(DEFAULT_METHODS)
    needing = [m.name for m in METHODS if m.needs == AR_DRAFT]
    for name in needing:
        with pytest.raises(UserError, match="no AR draft"):
            select([name], ar_draft_given=False)


def test_the_workflow_reads_the_registry():
    """The plots get a label for every method; the AR draft is built and given to evaluate exactly
    when a listed method needs it."""
    def pipeline(methods):
        cfg = copy.deepcopy(mini_config())
        cfg["evaluate"]["methods"] = methods
        return Pipeline(validate_config(cfg, str(SCHEMA_PATH)), REPO)

    p = pipeline(["dflash", "ar"])
    assert p.method_labels() == {m.name: m.label for m in METHODS}
    assert list(p.method_labels()) == list(NAMES)
    assert "method_labels=pipeline.method_labels()" in (REPO / "workflow/rules/plots.smk").read_text()
    for m in METHODS:
        p = pipeline([m.name])
        assert p.needs_ar_draft() == (m.needs == AR_DRAFT), m.name
        assert p.ar_draft_files() == (p.paths.ar_draft_files() if m.needs == AR_DRAFT else []), m.name


def test_the_plot_labels_every_method(tmp_path, monkeypatch):
    import pandas as pd

    from dflashpipe.stages import plots

    rows = [{"dataset": "d", "method": m.name, "tau_mean": 1.5, "tau_pooled": 1.6, "speedup_vs_ar": 1.2,
             "simulated_tau": None} for m in METHODS]
    pd.DataFrame(rows).to_csv(tmp_path / "eval.csv", index=False)
    figures = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.append(fig))
    plots.tau_speedup(str(tmp_path / "eval.csv"), str(tmp_path / "tau.png"), Pipeline.method_labels())
    methods, marks = figures[0].legends
    assert [t.get_text() for t in methods.get_texts()] == [m.label for m in METHODS]
    assert [t.get_text() for t in marks.get_texts()] == ["tau_pooled: all prompts' forwards pooled"]
    # DFlash's simulated tau from training: one labelled reference line, no bar label (tests/test_plots_honest.py)
    next(r for r in rows if r["method"] == "dflash")["simulated_tau"] = 3.917
    pd.DataFrame(rows).to_csv(tmp_path / "eval.csv", index=False)
    plots.tau_speedup(str(tmp_path / "eval.csv"), str(tmp_path / "tau.png"), Pipeline.method_labels())
    without, with_sim = ([t.get_text() for t in f.axes[0].texts] for f in figures)
    assert without == with_sim == ["1.50"] * len(METHODS)
    assert [t.get_text() for t in figures[1].legends[0].get_texts()] == [m.label for m in METHODS]
    assert figures[1].legends[1].get_texts()[1].get_text().startswith("simulated_tau 3.92")


def _name_collections(path) -> list[tuple[int, list[str]]]:
    """Literal lists, tuples, sets and dicts (their keys) in a Python file holding two or more method names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        names = [i.value for i in items if isinstance(i, ast.Constant) and i.value in BY_NAME]
        if len(names) >= 2:
            found.append((node.lineno, names))
    return found


def test_no_other_module_declares_methods():
    """No list of methods (nor labels keyed by them) in the library or the scripts outside the registry."""
    registry = REPO / "workflow" / "dflashpipe" / "evaluate" / "methods.py"
    offenders = {}
    for path in sorted((REPO / "workflow").rglob("*.py")):
        if path != registry and _name_collections(path):
            offenders[str(path.relative_to(REPO))] = _name_collections(path)
    assert not offenders, f"method names listed outside {registry.relative_to(REPO)}: {offenders}"
