"""The per-rule conda environments (envs/) and the workflow wiring module, checked statically."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import yaml

from conftest import REPO
from dflashpipe.jobs.codedeps import script_closure

LIB = REPO / "workflow" / "dflashpipe"
RULES = REPO / "workflow" / "rules"
ENVS = REPO / "envs"

# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml"}


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _env_pins(env: Path) -> dict[str, str]:
    deps = yaml.safe_load(env.read_text())["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    return _pins(pip)


def _rule_envs() -> dict[str, tuple[str, str]]:
    """rule name -> (conda env file name, script file name), read from the rule files."""
    found = {}
    for smk in RULES.glob("*.smk"):
        for block in re.split(r"(?m)^\s*rule ", smk.read_text())[1:]:
            name = block.split(":", 1)[0].strip()
            env = re.search(r'conda:\s*\n\s*"\.\./\.\./envs/([^"]+)"', block)
            script = re.search(r'script:\s*\n\s*"\.\./scripts/([^"]+)"', block)
            found[name] = (env and env.group(1), script and script.group(1))
    return found


def _top_level_imports(path: Path) -> set[str]:
    """Third-party packages a module imports when it is imported (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("dflashpipe", "__future__")}


def test_env_pins_agree_with_requirements():
    required = _pins((REPO / "requirements.txt").read_text().splitlines())
    for env in ("torch.yaml", "light.yaml"):
        pins = _env_pins(ENVS / env)
        assert pins, env
        for dist, version in pins.items():
            if dist == "torch":
                continue  # pinned in scripts/setup.sh, not in requirements.txt
            assert required.get(dist) == version, f"envs/{env}: {dist}=={version}, requirements.txt: {required.get(dist)}"


def test_every_rule_with_a_script_names_an_existing_env():
    rules = _rule_envs()
    assert {"prompts", "train", "evaluate", "plots"} <= set(rules)
    for name, (env, script) in rules.items():
        if script is None:
            continue
        assert env is not None and (ENVS / env).is_file(), f"rule {name}: conda env {env}"


def test_stages_in_the_light_env_import_only_what_it_holds():
    light = set(_env_pins(ENVS / "light.yaml"))
    assert "torch" not in light
    checked = 0
    for name, (env, script) in _rule_envs().items():
        if env != "light.yaml":
            continue
        checked += 1
        files = [REPO / "workflow" / "scripts" / script, *map(Path, script_closure(LIB, REPO / "workflow" / "scripts" / script))]
        for f in files:
            for pkg in _top_level_imports(f):
                assert DIST.get(pkg, pkg).lower() in light, f"rule {name}: {f.name} imports {pkg}, not in envs/light.yaml"
    assert checked >= 3


def test_the_wiring_module_is_no_stage_dependency():
    """Only common.smk imports dflashpipe.wiring: an edit to it must rerun no stage."""
    for script in (REPO / "workflow" / "scripts").glob("*.py"):
        assert not any(f.endswith("wiring.py") for f in script_closure(LIB, script)), script.name
