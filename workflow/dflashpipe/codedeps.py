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


# -- what a module's source MEANS: the key of compiled code and of a training run's identity ------------
#
# Rewording a log message or a comment must not orphan a killed run's checkpoints, so the code parts of
# the warm stamps and of the run identity digest each file's syntax tree (ast.dump, which has no line
# numbers and no comments) after dropping what cannot change a result:
#   * docstrings, and any other bare string statement;
#   * the string literals (plain, or the text and format specs of f-strings; their {expressions} are kept)
#     in the arguments of message calls: ``log(...)``, ``print(...)``, ``warn(...)``, ``tqdm(...)``,
#     ``UserError(...)``, ``<anything>.warning/.info/.debug/.error/.exception/.critical/.warn(...)``,
#     in the exception of a ``raise`` and in an ``assert``'s message.
# A string built elsewhere and passed to a message call (``msg = f"..."; log(msg)``) still counts, and so
# does everything else: names, constants, operators, calls. The dump format follows the Python version.

MESSAGE_FUNCTIONS = frozenset({"log", "print", "warn", "tqdm", "UserError"})
MESSAGE_METHODS = frozenset({"warn", "warning", "info", "debug", "error", "exception", "critical"})


def _blank_messages(node: ast.AST) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            sub.value = ""
        elif isinstance(sub, ast.JoinedStr):
            sub.values = [v for v in sub.values if isinstance(v, ast.FormattedValue)]
        elif isinstance(sub, ast.FormattedValue):
            sub.format_spec = None


def _is_message_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id in MESSAGE_FUNCTIONS) or (
        isinstance(f, ast.Attribute) and f.attr in MESSAGE_METHODS
    )


def source_meaning(source: str, filename: str = "<source>") -> str:
    """``source``'s syntax tree without comments, docstrings and message strings, as text (see above)."""
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                and isinstance(s.value.value, str))]
                setattr(node, field, kept or [ast.Pass()])
    for node in ast.walk(tree):
        if _is_message_call(node):
            for part in [*node.args, *(k.value for k in node.keywords)]:
                _blank_messages(part)
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            for part in [*node.exc.args, *(k.value for k in node.exc.keywords)]:
                _blank_messages(part)
        elif isinstance(node, ast.Assert) and node.msg is not None:
            _blank_messages(node.msg)
    return ast.dump(tree)


def meaning_digest(files: list[str], root: str | Path) -> str:
    """A short digest of what ``files`` (paths under ``root``, recorded relative to it) mean."""
    import hashlib

    root = Path(root).resolve()
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: str(Path(p).resolve().relative_to(root))):
        h.update(str(Path(f).resolve().relative_to(root)).encode() + b"\0")
        h.update(source_meaning(Path(f).read_text(), str(f)).encode() + b"\0")
    return h.hexdigest()[:16]
