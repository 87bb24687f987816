"""The fault matrix: what a user sees when something goes wrong, as data (tests/fault_matrix/*.yaml).

Each YAML file under ``tests/fault_matrix/`` is a list of cases; the files are read in name order
(``10-config.yaml``, ``20-data.yaml``, ...), so another part of the matrix is a new file. A case:

``id``        a slug, unique over the matrix
``group``     one of :data:`GROUPS`
``case``      what happened
``sees``      what the user sees: the one error line, or the exact recovery
``lost``      the data lost
``recovery``  whether a plain rerun recovers, or what to do

and how it is tested, one of:

``expect``    a regex the ONE error line must match: the case is driven by ``tests/test_fault_matrix.py``
              (``test_fault[<id>]``) through ``snakemake`` on a copy of the finished mini run, with the
              injector registered there for its id. Optional: ``targets`` (Snakemake's targets),
              ``line: snakemake`` (the line is Snakemake's own, not an ``ERROR:`` line of the workflow),
              ``traceback: snakemake`` (Snakemake prints a traceback of its own before reading the workflow),
              ``replaced`` (globs under ``results/`` the case may change: the fault itself, or a failed job's
              outputs that Snakemake deletes before the job starts), ``recover: plain`` (after the fault is
              undone, the plain rerun, or ``recover_targets``, succeeds and every file under ``results/`` is
              as it was, byte for byte);
``test``      ``tests/test_x.py::test_name`` (or a list of them): a test elsewhere drives it; ``driver`` says
              how: ``snakemake`` (default: a real run) or ``library`` (the function behind the promise);
``driver: none``  not tested (yet): the row says so.

``note`` (optional) is printed after the test in the table.

``python tests/fault_matrix.py --write`` writes the table into docs/reliability.md between
:data:`BEGIN` and :data:`END`; ``tests/test_fault_matrix.py`` fails when the two disagree.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import yaml

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
MATRIX_DIR = TESTS / "fault_matrix"
DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"

GROUPS = ("config", "data", "corrupt", "target", "kill", "checkpoint", "deleted", "disk", "concurrent", "slurm",
          "moved", "dry-run", "edit", "resources")
DRIVERS = ("matrix", "snakemake", "library", "none")
REQUIRED = ("id", "group", "case", "sees", "lost", "recovery")
OPTIONAL = ("expect", "test", "driver", "note", "targets", "line", "traceback", "replaced", "recover",
            "recover_targets")
SLUG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
TEST_REF = re.compile(r"tests/(test_\w+\.py)::(\w+)(\[[^\]]+\])?")


class MatrixError(ValueError):
    """A case that does not follow the format above."""


def load(directory: Path = MATRIX_DIR) -> list[dict]:
    """Every case of every ``*.yaml`` under ``directory``, files in name order; validated."""
    cases = []
    for f in sorted(directory.glob("*.yaml")):
        data = yaml.safe_load(f.read_text()) or []
        if not isinstance(data, list):
            raise MatrixError(f"{f.name}: a list of cases, not a {type(data).__name__}")
        for case in data:
            cases.append(validate(case, f.name))
    seen = set()
    for c in cases:
        if c["id"] in seen:
            raise MatrixError(f"{c['id']}: two cases have this id")
        seen.add(c["id"])
    return cases


def tests_of(case: dict) -> list[str]:
    test = case.get("test") or []
    return [test] if isinstance(test, str) else list(test)


def validate(case, source: str) -> dict:
    if not isinstance(case, dict):
        raise MatrixError(f"{source}: a case is a mapping, not {case!r}")
    where = f"{source}: {case.get('id', '?')}"
    missing = [k for k in REQUIRED if not case.get(k)]
    if missing:
        raise MatrixError(f"{where}: missing {', '.join(missing)}")
    unknown = [k for k in case if k not in REQUIRED + OPTIONAL]
    if unknown:
        raise MatrixError(f"{where}: unknown field(s) {', '.join(unknown)}")
    if not SLUG.fullmatch(case["id"]):
        raise MatrixError(f"{where}: the id is a slug (lower-case words joined by '-')")
    if case["group"] not in GROUPS:
        raise MatrixError(f"{where}: group {case['group']!r} is not one of {', '.join(GROUPS)}")
    for k in REQUIRED[2:]:
        if not isinstance(case[k], str):
            raise MatrixError(f"{where}: {k} is text")
    driver = case.setdefault("driver", "matrix" if "expect" in case else "snakemake" if "test" in case else "none")
    if driver not in DRIVERS:
        raise MatrixError(f"{where}: driver {driver!r} is not one of {', '.join(DRIVERS)}")
    if ("expect" in case) != (driver == "matrix"):
        raise MatrixError(f"{where}: `expect` goes with the matrix's own driver, and only there")
    if bool(tests_of(case)) != (driver in ("snakemake", "library")):
        raise MatrixError(f"{where}: `test` names the test of a snakemake or library case, and only there")
    if driver == "matrix":
        re.compile(case["expect"])
    else:
        extra = [k for k in ("targets", "line", "traceback", "replaced", "recover", "recover_targets") if k in case]
        if extra:
            raise MatrixError(f"{where}: {', '.join(extra)} are for the matrix's own driver")
    for ref in tests_of(case):
        if not TEST_REF.fullmatch(ref):
            raise MatrixError(f"{where}: test {ref!r} is not tests/test_x.py::test_name")
    if case.get("line", "error") not in ("error", "snakemake"):
        raise MatrixError(f"{where}: line is error or snakemake")
    if case.get("traceback", "none") not in ("none", "snakemake"):
        raise MatrixError(f"{where}: traceback is none or snakemake")
    if case.get("recover", "no") not in ("no", "plain"):
        raise MatrixError(f"{where}: recover is plain (or left out)")
    return case


def missing_tests(cases: list[dict]) -> list[str]:
    """The ``test:`` references whose file or function does not exist (read with ast, not imported)."""
    functions: dict[str, set[str]] = {}
    missing = []
    for case in cases:
        for ref in tests_of(case):
            file, name, _ = TEST_REF.fullmatch(ref).groups()
            if file not in functions:
                path = TESTS / file
                tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
                functions[file] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            if name not in functions[file]:
                missing.append(f"{case['id']}: {ref}")
    return missing


def through_snakemake(case: dict) -> bool:
    """Whether the case is driven through ``snakemake`` (the matrix's driver or a Snakemake test)."""
    return case["driver"] in ("matrix", "snakemake")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _test_cell(case: dict) -> str:
    if case["driver"] == "matrix":
        text = f"Snakemake: `test_fault_matrix.py::test_fault[{case['id']}]`"
    elif case["driver"] == "none":
        text = "not tested"
    else:
        label = "Snakemake" if case["driver"] == "snakemake" else "library"
        text = f"{label}: " + ", ".join(f"`{ref.removeprefix('tests/')}`" for ref in tests_of(case))
    return text + (f" ({case['note']})" if case.get("note") else "")


HEADER = ("| case | what the user sees | data lost | recovery | tested by |\n"
          "| --- | --- | --- | --- | --- |\n")


def render(cases: list[dict]) -> str:
    """The markdown table of the matrix, one row a case, in the matrix's order."""
    rows = [f"| {_cell(c['case'])} | {_cell(c['sees'])} | {_cell(c['lost'])} | {_cell(c['recovery'])} | "
            f"{_cell(_test_cell(c))} |\n" for c in cases]
    return HEADER + "".join(rows)


def doc_table(doc: str) -> str:
    """The text between the markers of docs/reliability.md (the table and its newline)."""
    if doc.count(BEGIN) != 1 or doc.count(END) != 1:
        raise MatrixError(f"docs/reliability.md: one {BEGIN} and one {END}")
    return doc.split(BEGIN)[1].split(END)[0].strip("\n") + "\n"


def write(doc_path: Path = DOC, cases: list[dict] | None = None) -> bool:
    """Write the rendering between the markers; whether the file changed."""
    doc = doc_path.read_text()
    before, rest = doc.split(BEGIN)
    _, after = rest.split(END)
    new = f"{before}{BEGIN}\n{render(load() if cases is None else cases)}{END}{after}"
    if new != doc:
        doc_path.write_text(new)
    return new != doc


def main(argv: list[str]) -> int:
    cases = load()
    if "--write" in argv:
        changed = write(DOC, cases)
        print(f"{DOC.relative_to(REPO)}: {'written' if changed else 'already the matrix'} ({len(cases)} cases, "
              f"{sum(map(through_snakemake, cases))} through snakemake)")
        return 0
    sys.stdout.write(render(cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
