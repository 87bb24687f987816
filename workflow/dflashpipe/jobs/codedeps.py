"""Which library source files a stage depends on, and what they mean.

Snakemake reruns a ``script:`` rule when the script changes, but never sees
edits to the modules the script imports. Each rule therefore passes, as a
param, a digest of what its script and the library modules it uses
(transitively) mean (:func:`script_digest`): a change to a module reruns
exactly the stages that import it (directly or through another module), and
nothing else. The digest ignores comments, docstrings and log messages, and
where a file sits: moving or renaming a module (its importers' imports
rewritten to match) keeps every digest.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import sys
import uuid
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


_IMPORTS: dict[tuple, frozenset[str]] = {}  # a file version's imports: read once per process (Snakemake
# digests the closure of every script while it plans, and the scripts share most of their modules)


def _imports(path: Path, package_dir: Path) -> frozenset[str]:
    """Fully qualified dflashpipe modules imported anywhere in ``path`` (relative imports too)."""
    st = path.stat()
    cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size, str(package_dir.resolve()))
    if cache_key not in _IMPORTS:
        _IMPORTS[cache_key] = frozenset(_read_imports(path, package_dir))
    return _IMPORTS[cache_key]


def _read_imports(path: Path, package_dir: Path) -> set[str]:
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


def _strip(tree: ast.AST) -> ast.AST:
    """``tree`` without docstrings and bare strings, and with message strings blanked (see above)."""
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
    return tree


def source_meaning(source: str, filename: str = "<source>") -> str:
    """``source``'s syntax tree without comments, docstrings and message strings, as text (see above)."""
    return ast.dump(_strip(ast.parse(source, filename=filename)))


# -- the same, independent of where the files sit ----------------------------------------------------------
#
# A code digest must not change when a module moves to another folder or is renamed (its importers' imports
# rewritten to match), so before hashing a file:
#   * each import of a dflashpipe module names it by a key of its content instead of its dotted name: the
#     hash of its meaning with its own dflashpipe imports blanked (``from dflashpipe.m import f`` and
#     ``from dflashpipe.floor.renamed import f`` read the same when m.py, moved to floor/renamed.py, means the
#     same; ``from dflashpipe import m`` and ``from dflashpipe.floor import renamed as m`` too);
#   * each run of import statements is split into one name per statement and sorted (the order and grouping
#     of imports follow the module names);
#   * ``Path(__file__)...parent``/``.parents[N]`` names the folder it reaches relative to the package, not to
#     the file (``.parent`` in dflashpipe/x.py and ``.parents[1]`` in dflashpipe/jobs/x.py: the package).
# A digest is then the hash of the sorted list of the files' hashes: a multiset, so two files with the same
# meaning count twice and no file's name or place enters it. Files that mean nothing (a package's
# ``__init__.py`` with a docstring only) do not count.

_LAYOUT_FREE: dict[tuple, tuple[str, str | None]] = {}  # (file, mtime, size, package) -> (key, digest)


def _resolve_from(node: ast.ImportFrom, this: str | None, is_pkg: bool) -> str | None:
    if not node.level:
        return node.module
    if this is None:
        return None
    base = this.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _file_anchor(node: ast.AST) -> int | None:
    """How many folders up from the file ``Path(__file__)[.resolve()](.parent|.parents[N])*`` goes (None when
    ``node`` is not such an expression)."""
    up = 0
    while True:
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            up, node = up + 1, node.value
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "parents" and isinstance(node.slice, ast.Constant)
              and isinstance(node.slice.value, int)):
            up, node = up + node.slice.value + 1, node.value.value
        else:
            break
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "resolve"
            and not node.args):
        node = node.func.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Path"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__file__"):
        return up
    return None


class _Anchors(ast.NodeTransformer):
    def __init__(self, depth: int | None):
        self.depth = depth  # folders between the package folder and the file's (None: outside the package)

    def _anchor(self, node):
        up = _file_anchor(node)
        if up is None or up == 0:
            return self.generic_visit(node)
        if self.depth is not None and up - 1 >= self.depth:
            return ast.Name(id=f"__package_folder_up_{up - 1 - self.depth}__", ctx=ast.Load())
        return ast.Name(id=f"__file_up_{up}__", ctx=ast.Load())

    visit_Attribute = _anchor
    visit_Subscript = _anchor


def _layout_free_tree(path: Path, package_dir: Path, key_of) -> ast.Module:
    """``path``'s stripped tree with the package's imports keyed by ``key_of(module)`` (see above)."""
    tree = _strip(ast.parse(path.read_text(), filename=str(path)))
    this = _module_name(path, package_dir)
    depth = None if this is None else len(path.resolve().relative_to(package_dir.resolve()).parts) - 1
    tree = _Anchors(depth).visit(tree)
    is_pkg = path.name == "__init__.py"

    def split(stmt: ast.stmt) -> list[ast.stmt]:
        if isinstance(stmt, ast.Import):
            out = []
            for a in stmt.names:
                if a.name.split(".")[0] == PACKAGE and _module_file(package_dir, a.name) is not None:
                    # `import dflashpipe.x as y` binds y; without `as` it binds the package itself
                    out.append(ast.Import(names=[ast.alias(name=key_of(a.name), asname=a.asname or PACKAGE)]))
                else:
                    out.append(ast.Import(names=[a]))
            return out
        module = _resolve_from(stmt, this, is_pkg)
        if module is None or module.split(".")[0] != PACKAGE:
            return [ast.ImportFrom(module=stmt.module, names=[a], level=stmt.level) for a in stmt.names]
        out = []
        for a in stmt.names:
            bound = a.asname or a.name
            if _module_file(package_dir, f"{module}.{a.name}") is not None:  # a submodule
                out.append(ast.Import(names=[ast.alias(name=key_of(f"{module}.{a.name}"), asname=bound)]))
            else:
                out.append(ast.ImportFrom(module=key_of(module), names=[ast.alias(name=a.name, asname=bound)],
                                          level=0))
        return out

    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not (isinstance(body, list) and body and isinstance(body[0], ast.stmt)):
                continue
            out, run = [], []
            for stmt in [*body, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.extend(split(stmt))
                    continue
                out.extend(sorted(run, key=ast.dump))
                run = []
                if stmt is not None:
                    out.append(stmt)
            setattr(node, field, out)
    return tree


def _means_nothing(tree: ast.Module) -> bool:
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.ImportFrom) and s.module == "__future__")
               for s in tree.body)


def _layout_free(path: Path, package_dir: Path) -> tuple[str, str | None]:
    """(content key, digest) of one file: the key blanks its package imports, the digest keys them; the
    digest is None for a file that means nothing."""
    st = path.stat()
    cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size, str(package_dir.resolve()))
    if cache_key in _LAYOUT_FREE:
        return _LAYOUT_FREE[cache_key]

    def blank(module: str) -> str:
        return "<package module>"

    def keyed(module: str) -> str:
        f = _module_file(package_dir, module)
        if f is None:
            return f"<missing {module}>"  # an import that fails: as it reads
        return "<package module " + _layout_free(f, package_dir)[0] + ">"

    def sha(tree):
        return hashlib.sha256(ast.dump(tree).encode()).hexdigest()

    key = sha(_layout_free_tree(path, package_dir, blank))
    _LAYOUT_FREE[cache_key] = (key, None)  # an import circle reads the key only
    tree = _layout_free_tree(path, package_dir, keyed)
    out = _LAYOUT_FREE[cache_key] = (key, None if _means_nothing(tree) else sha(tree))
    return out


def meaning_digest(files: list[str], package_dir: str | Path) -> str:
    """A short digest of what ``files`` (dflashpipe modules under ``package_dir``, or scripts importing them)
    mean, independent of where they sit (see above); from the code-digest cache (below) when every file is
    one of the package's."""
    package_dir = Path(package_dir)
    try:
        inside = sorted(Path(f).resolve().relative_to(package_dir.resolve()).as_posix() for f in files)
    except ValueError:  # a file outside the package: its bytes are not part of the cache's key
        inside = None
    if inside is None or not all(f.endswith(".py") for f in inside):  # nor are a non-module's
        return _meaning_digest(files, package_dir)
    request = "files " + hashlib.sha256("\n".join(inside).encode()).hexdigest()
    return _cached(package_dir, request, lambda: _meaning_digest(files, package_dir))


def _meaning_digest(files: list[str], package_dir: Path) -> str:
    digests = sorted(d for f in files if (d := _layout_free(Path(f), package_dir)[1]) is not None)
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]


def script_digest(package_dir: str | Path, script: str | Path) -> str:
    """What a workflow script and the library modules it imports (transitively) mean: a rule's code param
    (from the code-digest cache when this package and script were digested before: see below)."""
    package_dir, script = Path(package_dir), Path(script)
    request = "script " + hashlib.sha256(script.read_bytes()).hexdigest()
    return _cached(package_dir, request,
                   lambda: _meaning_digest([str(script), *script_closure(package_dir, script)], package_dir))


# -- the digests kept between processes ---------------------------------------------------------------------
#
# Snakemake digests every script's closure each time it plans (about a second on 2 cores), and a session of
# reruns, dry runs and tests plans hundreds of times over the same code. A digest is a pure function of the
# package's files (their paths inside the package and their bytes), the script's bytes, this module's
# algorithm (it is one of the package's files) and the Python version (ast.dump's format): so it is kept in
# ``<cache>/<fingerprint of all of that>.json``, and any edit of any library file starts a new file.
# ``<cache>`` is ``$DFLASHPIPE_CODE_CACHE``, else ``$XDG_CACHE_HOME/dflashpipe/code-digests`` (default
# ``~/.cache``); an empty ``DFLASHPIPE_CODE_CACHE`` turns it off. Nothing in it is ever needed: an
# unwritable, deleted or damaged cache costs the time, never a wrong digest (a lost write is recomputed).

CODE_CACHE_ENV = "DFLASHPIPE_CODE_CACHE"
_KEEP_FILES = 64  # cache files kept (oldest removed first): a few dozen code versions


def _cache_folder() -> Path | None:
    from dflashpipe.jobs.usercache import user_cache

    folder = os.environ.get(CODE_CACHE_ENV)
    if folder is not None:
        return Path(folder) if folder else None
    return user_cache("code-digests")


def _cached(package_dir: Path, request: str, compute) -> str:
    cache = _DigestCache.of(package_dir)
    digest = cache.get(request)
    if digest is None:
        digest = compute()
        cache.put(request, digest)
    return digest


class _DigestCache:
    _open: dict[tuple, "_DigestCache"] = {}  # (package, its files' stat signature) -> cache, per process

    def __init__(self, file: Path | None):
        self.file = file
        self.entries: dict[str, str] | None = None

    @classmethod
    def of(cls, package_dir: Path) -> "_DigestCache":
        files = sorted(package_dir.resolve().rglob("*.py"))
        signature = (str(package_dir.resolve()),
                     *((str(f), (st := f.stat()).st_mtime_ns, st.st_size, st.st_ino) for f in files))
        if signature not in cls._open:
            folder = _cache_folder()
            fingerprint = hashlib.sha256(sys.version.encode())
            for f in files:
                data = f.read_bytes()
                fingerprint.update(f"\0{f.relative_to(package_dir.resolve()).as_posix()}\0{len(data)}\0".encode())
                fingerprint.update(data)
            name = fingerprint.hexdigest()[:32] + ".json"
            cls._open[signature] = cls(folder / name if folder else None)
        return cls._open[signature]

    def _load(self) -> dict[str, str]:
        if self.entries is None:
            self.entries = {}
            if self.file is not None:
                with contextlib.suppress(OSError, ValueError):
                    data = json.loads(self.file.read_text())
                    if isinstance(data, dict):
                        self.entries = {k: v for k, v in data.items() if isinstance(v, str)}
        return self.entries

    def get(self, request: str) -> str | None:
        return self._load().get(request)

    def put(self, request: str, digest: str) -> None:
        self._load()[request] = digest
        if self.file is None:
            return
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError, ValueError):  # entries another process wrote meanwhile
                on_disk = json.loads(self.file.read_text())
                if isinstance(on_disk, dict):
                    self.entries = {**{k: v for k, v in on_disk.items() if isinstance(v, str)}, **self.entries}
            tmp = self.file.with_name(f".{self.file.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
            os.replace(tmp, self.file)
            kept = sorted((p for p in self.file.parent.glob("*.json")), key=lambda p: p.stat().st_mtime)
            for old in kept[:-_KEEP_FILES]:
                old.unlink(missing_ok=True)
