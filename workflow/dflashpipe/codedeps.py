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


def _module_name(path: Path, package_dir: Path) -> str | None:
    """``dflashpipe.x.y`` for a file inside the package (None for a file outside, e.g. a script)."""
    try:
        rel = path.resolve().relative_to(package_dir.resolve()).with_suffix("")
    except ValueError:
        return None
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([PACKAGE, *parts])


def _imports(path: Path, package_dir: Path) -> set[str]:
    """Fully qualified dflashpipe modules imported anywhere in ``path`` (relative imports too)."""
    found = set()
    this = _module_name(path, package_dir)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                if this is None:
                    continue
                base = this.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != PACKAGE:
                continue
            found.add(module)
            # `from dflashpipe import x` imports the submodule x when there is one
            for a in node.names:
                if _module_file(package_dir, f"{module}.{a.name}") is not None:
                    found.add(f"{module}.{a.name}")
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
