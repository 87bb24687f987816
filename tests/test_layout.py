"""The library's packages stand in floors: each imports only from the floors below it (docs/contributing.md),
so a concern can be read, tested and moved without what stands above it."""

from pathlib import Path

from conftest import REPO
from dflashpipe.jobs.codedeps import _imports

PACKAGE = REPO / "workflow" / "dflashpipe"
# lowest first; a package may import its own modules and any package of a lower floor
FLOORS = [
    {"jobs"},
    {"inputs", "drafter"},
    {"training", "export"},
    {"decode"},
    {"evaluate", "stages"},
    {"config", "wiring"},
]


def _floor(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_every_package_has_a_floor():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    assert tops == set().union(*FLOORS)


def test_no_package_imports_from_a_floor_above_it():
    upward = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).with_suffix("")
        if rel.parts[0] == "__init__":
            continue
        here = _floor("dflashpipe." + ".".join(rel.parts))
        for module in _imports(f, PACKAGE):
            if module.count(".") and _floor(module) > here:
                upward.append(f"{'/'.join(rel.parts)}.py imports {module}")
    assert not upward, upward


def test_the_floors_check_finds_an_upward_import(tmp_path):
    """The check above can fail: a decoder that imports the evaluation is found."""
    pkg = tmp_path / "dflashpipe"
    (pkg / "decode").mkdir(parents=True)
    (pkg / "evaluate").mkdir()
    for d in (pkg, pkg / "decode", pkg / "evaluate"):
        (d / "__init__.py").write_text("")
    (pkg / "evaluate" / "metrics.py").write_text("def cut_step(): ...\n")
    f = pkg / "decode" / "loop.py"
    f.write_text("from dflashpipe.evaluate.metrics import cut_step\n")
    found = _imports(f, pkg)
    assert "dflashpipe.evaluate.metrics" in found and _floor("dflashpipe.evaluate.metrics") > _floor("dflashpipe.decode.loop")
