"""The fault matrix (tests/fault_matrix/*.yaml, tests/fault_matrix.py) through real Snakemake runs.

``test_fault[<id>]`` drives every case with an ``expect``: on a private copy of the finished mini run
(conftest.mini_copy) it takes the sha256 of every file under results/, injects the fault with the
injector registered here for the id (``@injects("<id>")``), runs ``snakemake --cores 2 --configfile
...`` and asserts that the run fails with ONE error line matching ``expect``, that no Python traceback
reaches the console, and that every file under results/ is as it was (but what the case declares
``replaced``). A case with ``recover: plain`` is then undone and run again as the user would: the run
succeeds and every file is as it was before the fault, byte for byte.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

import fault_matrix
from conftest import PROMPTS, REPO, sha256, snakemake, write_config

CASES = fault_matrix.load()
DRIVEN = [c for c in CASES if c["driver"] == "matrix"]
#: what issue 67 asks for: this many cases driven through snakemake (the matrix's driver and Snakemake
#: tests elsewhere); the kill cases of another part of the matrix bring it there
FLOOR = 45

# -- the injectors ---------------------------------------------------------------------------------


@dataclass
class Fault:
    """What a case's injector changes: ``config`` (the mini run's, written to fault.yaml and passed as
    ``--configfile`` unless ``configfile`` is set), extra command-line ``args``, and ``undo`` steps run in
    reverse order before a recovery."""

    work: Path
    config: dict
    configfile: Path | None = None
    args: list[str] = field(default_factory=list)
    undo: list = field(default_factory=list)

    def file(self, name: str, data: bytes) -> Path:
        path = self.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def damage(self, rel: str, data: bytes | None = None, keep: int | None = None) -> Path:
        """Write ``data`` over (or cut to ``keep`` bytes) a file of the work folder; its undo deletes it (the
        rerun makes it again)."""
        path = self.work / rel
        path.write_bytes(data if data is not None else path.read_bytes()[:keep])
        self.undo.append(path.unlink)
        return path


INJECTORS: dict = {}


def injects(case_id: str):
    def register(fn):
        assert case_id not in INJECTORS, case_id
        INJECTORS[case_id] = fn
        return fn

    return register


def section(fault: Fault, *keys: str) -> dict:
    d = fault.config
    for k in keys:
        d = d.setdefault(k, {})
    return d


# config: refused while planning, before any job runs


@injects("config-unknown-key")
def _(f):
    section(f, "expand")["batch_szie"] = 8


@injects("config-unknown-section")
def _(f):
    f.config["trian"] = {"lr": 0.001}


@injects("config-wrong-type")
def _(f):
    section(f, "train")["max_steps"] = "ten"


@injects("config-section-not-a-mapping")
def _(f):
    f.config["train"] = 5


@injects("config-out-of-range")
def _(f):
    section(f, "train")["lr"] = -0.001


@injects("config-bad-enum")
def _(f):
    section(f, "drafter")["arch"] = "eagle"


@injects("config-yaml-syntax")
def _(f):
    f.configfile = f.file("fault.yaml", b"train:\n  shards: 2\n   lr: [1, 2\n")


@injects("config-file-missing")
def _(f):
    f.configfile = f.work / "missing.yaml"


@injects("config-not-a-mapping")
def _(f):
    f.configfile = f.file("fault.yaml", b"- train\n- lr: 0.001\n")


@injects("config-layer-ids-past-the-target")
def _(f):
    section(f, "drafter")["target_layer_ids"] = [0, 5]


@injects("config-conv-group-not-a-divisor")
def _(f):
    section(f, "drafter").update(arch="dflash2", conv_group_size=5)


@injects("config-dataset-name-with-slash")
def _(f):
    f.config["datasets"]["my/data"] = f.config["datasets"].pop("code")


@injects("config-batch-not-a-multiple-of-shards")
def _(f):
    section(f, "train")["batch_size"] = 5


@injects("config-gpu-resources-below-shards")
def _(f):
    f.args += ["--resources", "gpu=1"]


@injects("config-shards-above-slots")
def _(f):
    section(f, "train")["shards"] = 4


@injects("config-unknown-eval-method")
def _(f):
    section(f, "evaluate")["methods"] = ["dflash", "medusa"]


@injects("config-eval-concurrency-zero")
def _(f):
    section(f, "evaluate")["concurrency"] = [1, 0]


@injects("config-eval-concurrency-word")
def _(f):
    section(f, "evaluate")["concurrency"] = "all"


@injects("config-no-train-dataset")
def _(f):
    for spec in f.config["datasets"].values():
        spec["use"] = "eval"


@injects("config-repeat-unknown-dataset")
def _(f):
    section(f, "train")["repeat"] = {"maths": 2}


@injects("config-dataset-path-and-hf")
def _(f):
    f.config["datasets"]["code"]["hf"] = "openai/gsm8k"


@injects("config-run-name-with-slash")
def _(f):
    f.config["runs"] = {"kl/v2": {"train": {"loss": "kl"}}}


@injects("config-run-sets-shards")
def _(f):
    f.config["runs"] = {"small": {"train": {"shards": 1}}}


@injects("config-greedy-samples")
def _(f):
    section(f, "expand").update(num_samples=2, temperature=0.0)


# data: a dataset file the user gives (a new dataset `mine`, so that the run's own prompts stay)


def mine(f: Fault, data: bytes | None, name: str = "mine.jsonl.gz", **spec) -> None:
    if data is not None:
        f.file(name, data)
    f.config["datasets"]["mine"] = {"path": name, "messages_column": "messages", "limit": 16, **spec}


def jsonl_gz(rows: list) -> bytes:
    return gzip.compress("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows).encode())


def chats(n: int, **extra) -> list[dict]:
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": f"what is {i} + {i}?"}], **extra} for i in range(n)]


@injects("data-missing-file")
def _(f):
    mine(f, None, "gone.jsonl.gz")


@injects("data-path-is-a-folder")
def _(f):
    (f.work / "my_data").mkdir()
    mine(f, None, "my_data")


@injects("data-empty-file")
def _(f):
    mine(f, b"")


@injects("data-truncated-gzip")
def _(f):
    full = (PROMPTS / "math_train.jsonl.gz").read_bytes()
    mine(f, full[: len(full) // 2])


@injects("data-no-messages-column")
def _(f):
    mine(f, jsonl_gz([{"id": f"r{i}", "text": "a reply"} for i in range(20)]))


@injects("data-every-row-bad")
def _(f):
    mine(f, jsonl_gz(["not json\n"] * 20))


@injects("data-bad-rows-over-the-limit")
def _(f):
    rows = chats(16)
    for line in (2, 7, 11, 16):  # 0-based: file lines 3, 8, 12 and 17
        rows.insert(line, "{not json\n")
    mine(f, jsonl_gz(rows))


@injects("data-parquet-named-jsonl-gz")
def _(f):
    mine(f, (f.work / "results/prompts/code.parquet").read_bytes())


@injects("data-unsupported-format")
def _(f):
    mine(f, b"id,prompt\n1,hello\n", "mine.csv")


@injects("data-swapped-paths")
def _(f):
    """math (OpenAI `messages`, messages_column set) and a ShareGPT dataset (`conversations`, its column
    detected) given each other's file: the ShareGPT reader takes OpenAI rows, math's does not."""
    shutil.copy(REPO / "tests/fixtures/sharegpt_small.jsonl", f.work / "chat.jsonl")
    math = f.config["datasets"]["math"]
    f.config["datasets"]["chat"] = {"path": math["path"], "use": "eval", "limit": 4}
    math["path"] = "chat.jsonl"


# corrupt: a file under results/ truncated or damaged (a crash of the machine, a bad copy): the file ->
# the bytes it is cut to, or what is written over it
DAMAGED = {
    "corrupt-prompts-parquet": ("results/prompts/math.parquet", 1000),
    "corrupt-tokenized-arrow": ("results/tokenized/train/data-00000-of-00001.arrow", 3000),
    "corrupt-eval-summary": ("results/eval/math_heldout.summary.json", 300),
    "corrupt-training-metrics": ("results/train/metrics.csv", b""),
    "corrupt-drafter-weights": ("results/drafter/model.safetensors", 3000),
    "corrupt-expansion-shard": ("results/expanded/math/shard0.parquet", 500),
    "corrupt-final-weights": ("results/train/final.safetensors", 3000),
    "corrupt-train-summary": ("results/train/summary.json", 50),
    "corrupt-eval-table": ("results/tables/eval.csv", b""),
    "corrupt-tiny-target-weights": ("results/target/model/model.safetensors", 5000),
}


def _damages(path: str, cut: int | bytes):
    """The injector that cuts ``path`` to ``cut`` bytes (an int) or writes ``cut`` over it (bytes)."""
    return lambda f: f.damage(path, **({"data": cut} if isinstance(cut, bytes) else {"keep": cut}))


for _case, (_path, _cut) in DAMAGED.items():
    injects(_case)(_damages(_path, _cut))


# target: a configured target.path (the mini run's tiny target copied out, then damaged)


def my_target(f: Fault) -> Path:
    target = f.work / "my_target"
    shutil.copytree(f.work / "results/target/model", target)
    f.config["target"]["path"] = "my_target"
    return target


@injects("target-truncated-weights")
def _(f):
    w = my_target(f) / "model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])


@injects("target-garbage-header")
def _(f):
    (my_target(f) / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{not a header}" + b"\0" * 64)


@injects("target-missing-shard")
def _(f):
    t = my_target(f)
    (t / "model.safetensors").rename(t / "model-00001-of-00002.safetensors")
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


@injects("target-no-tokenizer")
def _(f):
    t = my_target(f)
    (t / "tokenizer.json").unlink()
    (t / "tokenizer_config.json").unlink()


@injects("target-no-chat-template")
def _(f):
    (my_target(f) / "chat_template.jinja").unlink()


@injects("target-not-a-model")
def _(f):
    (my_target(f) / "config.json").unlink()


@injects("target-config-not-json")
def _(f):
    (my_target(f) / "config.json").write_text('{"model_type": "qwen3",')


@injects("target-no-weights")
def _(f):
    (my_target(f) / "model.safetensors").unlink()


@injects("target-path-missing")
def _(f):
    f.config["target"]["path"] = "models/gone"


@injects("target-exported-drafter")
def _(f):
    shutil.copytree(f.work / "results/drafter", f.work / "my_drafter")
    f.config["target"]["path"] = "my_drafter"


@injects("target-inside-results")
def _(f):
    f.config["target"]["path"] = "results/ar_draft"


# -- the driver ------------------------------------------------------------------------------------

#: not compared: logs, timings, the digest cache and the GPU slot locks change with every run
UNCOMPARED = ("logs/*", "benchmarks/*", ".cache/*", "locks/*")


def snapshot(results: Path) -> dict[str, str]:
    """sha256 of every file under results/ (but :data:`UNCOMPARED`), by path relative to it."""
    files = (p for p in sorted(results.rglob("*")) if p.is_file())
    rels = ((p, p.relative_to(results).as_posix()) for p in files)
    return {rel: sha256(p) for p, rel in rels if not any(fnmatch.fnmatch(rel, g) for g in UNCOMPARED)}


def changed(before: dict, after: dict, replaced=()) -> list[str]:
    """Files of ``before`` gone or changed in ``after``, but those matching ``replaced``."""
    return sorted(f for f, digest in before.items()
                  if after.get(f) != digest and not any(fnmatch.fnmatch(f, g) for g in replaced))


TRACEBACK = re.compile(r"^Traceback \(most recent call last\)|^\s*File \".*\", line \d+", re.M)


def the_line(case: dict, out: str) -> str:
    """The one error line of a failed run: the distinct ``ERROR`` lines (the job's suffix naming its log
    taken off; Snakemake shows the log too), or for ``line: snakemake`` the lines ``expect`` matches."""
    if case.get("line") == "snakemake":
        lines = {ln.strip() for ln in out.splitlines() if re.search(case["expect"], ln)}
    else:
        lines = {ln.split("  [")[0] for ln in out.splitlines() if ln.startswith("ERROR")}
    assert len(lines) == 1, f"not one error line: {sorted(lines)}\n{out[-3000:]}"
    return lines.pop()


def run(work: Path, targets, args, configfile: Path):
    return snakemake(work, *targets, "--cores", "2", *args, "--configfile", str(configfile), timeout=300)


@pytest.mark.parametrize("case", DRIVEN, ids=[c["id"] for c in DRIVEN])
def test_fault(mini_copy, case):
    work, cfg = mini_copy
    before = snapshot(work / "results")
    fault = Fault(work, yaml.safe_load(cfg.read_text()))
    INJECTORS[case["id"]](fault)
    configfile = fault.configfile or write_config(work / "fault.yaml", fault.config)

    res = run(work, case.get("targets", []), fault.args, configfile)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    line = the_line(case, out)
    assert re.search(case["expect"], line), f"{line!r} does not match {case['expect']!r}"
    if case.get("traceback") != "snakemake":
        assert not TRACEBACK.search(out), out[-3000:]
    assert changed(before, snapshot(work / "results"), case.get("replaced", ())) == []

    if case.get("recover") == "plain":
        for undo in reversed(fault.undo):
            undo()
        res = run(work, case.get("recover_targets", []), [], cfg)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        assert changed(before, snapshot(work / "results")) == []  # byte for byte


def test_every_driven_case_has_its_injector():
    assert sorted(INJECTORS) == sorted(c["id"] for c in DRIVEN)


def test_the_doc_is_the_matrix():
    """docs/reliability.md's table is the matrix's rendering (``python tests/fault_matrix.py --write``), every
    test a case names exists, and the matrix holds the cases issue 67 asks for."""
    assert fault_matrix.doc_table(fault_matrix.DOC.read_text()) == fault_matrix.render(CASES), (
        "docs/reliability.md disagrees with tests/fault_matrix/: run python tests/fault_matrix.py --write")
    assert fault_matrix.missing_tests(CASES) == []
    driven = [c["id"] for c in CASES if fault_matrix.through_snakemake(c)]
    assert len(driven) >= FLOOR, f"{len(driven)} cases through snakemake, {FLOOR} asked for"


def test_a_row_edited_by_hand_is_caught_and_written_back(tmp_path):
    doc = tmp_path / "reliability.md"
    doc.write_text(fault_matrix.DOC.read_text().replace("| none |", "| every checkpoint |", 1))
    assert fault_matrix.doc_table(doc.read_text()) != fault_matrix.render(CASES)
    assert fault_matrix.write(doc, CASES)
    assert doc.read_text() == fault_matrix.DOC.read_text()


@pytest.mark.parametrize("bad,why", [
    ({"expect": "x", "test": "tests/test_fault_matrix.py::test_fault"}, "`test` names the test"),
    ({"group": "weather", "expect": "x"}, "group 'weather' is not one of"),
    ({"expect": "x", "recover": "maybe"}, "recover is plain"),
    ({"test": "test_x.py::f"}, "is not tests/test_x.py::test_name"),
    ({"expect": "x", "sees": ""}, "missing sees"),
    ({"expect": "x", "expected": "y"}, "unknown field(s) expected"),
])
def test_a_case_out_of_format_is_refused(bad, why):
    case = {"id": "a-case", "group": "config", "case": "c", "sees": "s", "lost": "none", "recovery": "r", **bad}
    with pytest.raises(fault_matrix.MatrixError, match=re.escape(why)):
        fault_matrix.validate(case, "x.yaml")
