"""Which library source files a stage depends on.

Snakemake reruns a ``script:`` rule when the script changes, but never sees
edits to the modules the script imports. Each rule therefore lists, as inputs,
the source files of the library modules it uses, transitively: an edit to a
module reruns exactly the stages that import it (directly or through another
module), and nothing else. Small inputs are checksummed by Snakemake, so a
touch without a change reruns nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "dflashpipe"


def _module_file(package_dir: Path, module: str) -> Path | None:
    rel = module.split(".")[1:]  # drop the package name
    base = package_dir.joinpath(*rel)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imports(path: Path, package_dir: Path) -> set[str]:
    """Fully qualified dflashpipe modules imported anywhere in ``path``."""
    found = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == PACKAGE:
                found.add(node.module)
                # `from dflashpipe import x` imports the submodule x when there is one
                for a in node.names:
                    if _module_file(package_dir, f"{node.module}.{a.name}") is not None:
                        found.add(f"{node.module}.{a.name}")
    return found


def script_closure(package_dir: str | Path, script: str | Path) -> list[str]:
    """Library source files a workflow script imports, transitively (the script itself excluded:
    Snakemake already tracks it)."""
    modules = sorted(_imports(Path(script), Path(package_dir)))
    return module_closure(package_dir, modules) if modules else []


def module_closure(package_dir: str | Path, modules: list[str]) -> list[str]:
    """Sorted source files of ``modules`` and every dflashpipe module they import, transitively.

    ``modules`` are names like ``"expand"`` or ``"drafter.model"`` (relative to
    the package). Package ``__init__`` files on the way are included, since
    Python runs them on import.
    """
    package_dir = Path(package_dir)
    todo = [f"{PACKAGE}.{m}" if not m.startswith(PACKAGE) else m for m in modules]
    seen: set[Path] = set()
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # parent packages' __init__ too
            f = _module_file(package_dir, ".".join(parts[:i]))
            if f is None:
                if i == len(parts) and ".".join(parts[:i]) in modules:
                    raise FileNotFoundError(f"no module {mod} under {package_dir}")
                continue
            if f not in seen:
                seen.add(f)
                todo.extend(_imports(f, package_dir))
    return sorted(str(p) for p in seen)
