"""Nothing stale, nothing missing (through Snakemake, on copies of the mini run): every output a user
sees is asked for by the default target, so one deleted is made again by a plain rerun; a target is read
by its content while the workflow plans, a dry run writes nothing, and a target that cannot load is
refused before any job deletes a finished output."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import CODE_EDIT, copy_checkout, planned_rules, sha256, snakemake

# a deleted output -> the rules a dry run must plan first (with what reads it after)
DELETED = {
    "results/prompts/math.stats.json": "prompts",
    "results/target/model/model.safetensors": "tiny_target",
    "results/expanded/math.parquet": "merge_expanded",
    "results/tokenized/train/data-00000-of-00001.arrow": "tokenize",
    "results/ar_draft/config.json": "ar_draft",
    "results/drafter/model.safetensors": "export",
    "results/eval/math_heldout.samples.parquet": "evaluate",
    "results/tables/eval.csv": "tables",
    "results/plots/compile_cold_vs_hot.png": "plots",
}


def tree(results: Path) -> dict[str, tuple[int, str]]:
    """Every file under results/ by its mtime and content: what "nothing was written" compares."""
    return {str(p.relative_to(results)): (p.stat().st_mtime_ns, sha256(p)) for p in sorted(results.rglob("*")) if p.is_file()}


def run(work: Path, cfg: Path, *args: str):
    return snakemake(work, *args, "--cores", "2", "--configfile", str(cfg))


def test_every_deleted_output_is_planned_again(mini_copy):
    """All of DELETED deleted at once: one dry run plans each one's rule for its own missing file (not only
    because an upstream job reruns): the default target asks for each, and none hides in a folder output."""
    work, cfg = mini_copy
    for path in DELETED:
        (work / path).unlink()
    res = snakemake(work, "-n", "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = (res.stdout + res.stderr).split("\nrule ")[1:]
    for path, rule in DELETED.items():
        assert any(j.startswith(f"{rule}:") and "Missing output files:" in j and path in j.split("reason:")[1].split("\n")[0]
                   for j in jobs), (path, rule)


def test_a_plain_rerun_makes_a_deleted_drafter_and_plot_again(mini_copy):
    """The drafter's weights deleted from results/drafter/ (the next evaluation failed "file not found",
    every plain rerun the same way): the plain rerun exports them again, byte for byte."""
    work, cfg = mini_copy
    weights, plot = work / "results/drafter/model.safetensors", work / "results/plots/training_loss_acc.png"
    before = sha256(weights)
    weights.unlink()
    plot.unlink()
    res = run(work, cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sha256(weights) == before and plot.is_file()
    assert planned_rules(work, "--configfile", str(cfg)) == {}


def test_a_lost_tiny_target_is_made_again_by_the_plain_rerun(mini_copy):
    """target.path null and the tiny target's weights deleted: every command stopped while planning;
    now the plain rerun makes them again, the same bytes (restored: its inputs are what they were)."""
    work, cfg = mini_copy
    weights = work / "results/target/model/model.safetensors"
    before = sha256(weights)
    weights.unlink()
    res = run(work, cfg, str(weights.relative_to(work)))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sha256(weights) == before


# the jobs that read math's prompts, directly or through what they make -> their logs (training finds its
# finished run by its own identity: results/train/checkpoints/<identity>)
READ_MATH = {"tiny_target": "target/tiny_target", "expand_shard": "expand/math.shard0", "merge_expanded": "expand/math.merge",
             "tokenize": "tokenize/tokenize", "export": "export/export", "ar_draft": "ar_draft/ar_draft",
             "evaluate": "evaluate/math_heldout"}


def _last_run(log: Path) -> str:
    text = log.read_text()
    return text[text.rindex(": start (pid"):]


def test_a_rebuilt_input_of_the_same_content_recomputes_nothing(mini_copy):
    """A deleted prompts table is made again with the same bytes: every job after it (re-expansion, the
    tiny target, training, evaluation) found its inputs newer and ran again in full. Now each finds its
    inputs' content, params and code as they were and restores its outputs; the results are the same
    bytes and the next plan is empty. Told to (--forcerun), a job computes."""
    work, cfg = mini_copy
    r = work / "results"
    kept = ["expanded/math.parquet", "tokenized/train/data-00000-of-00001.arrow", "target/model/model.safetensors",
            "train/final.safetensors", "drafter/model.safetensors", "ar_draft/model.safetensors",
            "eval/math_heldout.summary.json", "tables/eval.csv"]
    before = {f: sha256(r / f) for f in kept}
    (r / "prompts/math.parquet").unlink()
    res = run(work, cfg)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {f: sha256(r / f) for f in kept} == before
    for rule, log in READ_MATH.items():
        assert "restored" in _last_run(r / f"logs/{log}.log"), rule
    assert "no step is trained" in _last_run(r / "logs/train/train.log")
    assert planned_rules(work, "--configfile", str(cfg)) == {}

    res = run(work, cfg, "results/eval/math_heldout.summary.json", "--forcerun", "evaluate")  # not what follows it
    assert res.returncode == 0, res.stderr[-3000:]
    evaluated = _last_run(r / "logs/evaluate/math_heldout.log")
    assert "restored" not in evaluated and "leased slot" in evaluated


def test_an_edit_of_the_tokenizing_code_that_tokenizes_the_same_bytes_trains_nothing(mini_copy, tmp_path):
    """An edit of how chats are tokenized (inputs/tokenize.py) reruns tokenize; where its output comes out with
    the same bytes, what reads it restores its outputs. Training read the tokenizing code into its own code
    digest (it imported the reader from that module) and trained again from step one, for the same weights."""
    work, cfg = mini_copy
    r = work / "results"
    checkout = copy_checkout(tmp_path / "checkout")
    module = checkout / "workflow/dflashpipe/inputs/tokenize.py"
    module.write_text(module.read_text() + CODE_EDIT)  # a new statement: what the module means changed
    kept = ["tokenized/train/data-00000-of-00001.arrow", "train/final.safetensors", "drafter/model.safetensors",
            "ar_draft/model.safetensors", "eval/math_heldout.summary.json"]
    before = {f: sha256(r / f) for f in kept}
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg), snakefile=checkout / "Snakefile")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restored" not in _last_run(r / "logs/tokenize/tokenize.log")  # its code changed: it tokenized
    assert {f: sha256(r / f) for f in kept} == before
    assert "no step is trained" in _last_run(r / "logs/train/train.log")
    for rule in ("ar_draft", "export", "evaluate"):
        assert "restored" in _last_run(r / f"logs/{READ_MATH[rule]}.log"), rule


@pytest.fixture(scope="module")
def given_target_run(mini_run, tmp_path_factory) -> Path:
    """A copy of the mini run with its tiny target copied out as a user's target.path, and its prompts,
    fingerprint and expansion made (the first jobs that read the target): once for the module."""
    src, _ = mini_run
    work = tmp_path_factory.mktemp("given") / "wf"
    shutil.copytree(src, work, symlinks=True)
    shutil.copytree(work / "results/target/model", work / "my_target")
    cfg = yaml.safe_load((work / "config.yaml").read_text())
    cfg["target"]["path"] = "my_target"
    given = work / "given.yaml"
    given.write_text(yaml.safe_dump(cfg))
    res = run(work, given, "results/expanded/math.parquet")
    assert res.returncode == 0, res.stderr[-3000:]
    return work


@pytest.fixture
def given_target(given_target_run, tmp_path):
    """A private copy of ``given_target_run`` (results, Snakemake metadata and the target) for a test to change."""
    work = tmp_path / "wf"
    shutil.copytree(given_target_run, work, symlinks=True)
    return work, work / "given.yaml", work / "my_target"


def test_a_target_is_read_by_content_and_a_dry_run_writes_nothing(given_target):
    """A touch or the same bytes copied back plan nothing; a fine-tune over the weights (same name and size)
    plans the fingerprint and what reads the target; none of these dry runs writes a byte into results/
    (the fingerprint was rewritten by every plan)."""
    work, given, target = given_target
    results, weights = work / "results", target / "model.safetensors"
    only = "results/expanded/math.parquet"
    original, before = weights.read_bytes(), tree(work / "results")

    weights.touch()
    assert planned_rules(work, only, "--configfile", str(given)) == {}
    tuned = bytearray(original)
    tuned[-64:] = bytes(255 - b for b in tuned[-64:])
    weights.write_bytes(bytes(tuned))
    assert set(planned_rules(work, only, "--configfile", str(given))) == {"target_id", "expand_shard", "merge_expanded"}
    assert tree(results) == before
    weights.write_bytes(original)
    assert planned_rules(work, only, "--configfile", str(given)) == {}
    if os.geteuid() == 0:  # a read-only results/ (the plan's write crashed with a 14-line OSError); root needs a mount
        import subprocess

        subprocess.run(["mount", "--bind", "-o", "ro", str(results), str(results)], check=True)
        try:
            assert planned_rules(work, only, "--configfile", str(given)) == {}
            weights.write_bytes(bytes(tuned))  # jobs to run: Snakemake's own refusal to plan over protected outputs
            res = snakemake(work, only, "-n", "--cores", "2", "--configfile", str(given))
            out = res.stdout + res.stderr
            assert res.returncode != 0 and "Write-protected output files" in out, out[-2000:]
            assert "OSError" not in out and "Traceback" not in out
        finally:
            subprocess.run(["umount", str(results)], check=True)
            weights.write_bytes(original)


def test_a_target_that_cannot_load_is_refused_while_planning(given_target):
    """Truncated weights, then no chat template: each refused in one line before any job runs; the finished
    expansion (which Snakemake deletes before a job that remakes it) is still there, byte for byte."""
    work, given, target = given_target
    before = tree(work / "results")
    weights, template = target / "model.safetensors", target / "chat_template.jinja"
    original = weights.read_bytes()
    for damage, line in [
        (lambda: weights.write_bytes(original[:5000]), "ERROR: target.path: my_target/model.safetensors is truncated ("),
        (lambda: (weights.write_bytes(original), template.unlink()),
         "ERROR: target.path: the tokenizer in my_target has no chat template ("),
    ]:
        damage()
        res = run(work, given, "results/expanded/math.parquet")
        assert res.returncode != 0
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")]
        assert len(errors) == 1 and errors[0].startswith(line), res.stderr[-2000:]
        assert "Traceback" not in res.stderr
        assert tree(work / "results") == before


def test_a_dataset_file_is_read_by_content_and_a_missing_one_is_refused_while_planning(mini_copy):
    """A touch plans nothing and other content replans its prompts; a dataset pointed at a file that is not
    there stopped nothing (the run went on with the old prompts table): now one line while planning, and
    nothing in results/ is touched."""
    work, cfg = mini_copy
    data = work / "my_math.jsonl.gz"
    shutil.copy(yaml.safe_load(cfg.read_text())["datasets"]["math"]["path"], data)
    c = yaml.safe_load(cfg.read_text())
    c["datasets"]["math"]["path"] = "my_math.jsonl.gz"
    mine = work / "mine.yaml"
    mine.write_text(yaml.safe_dump(c))
    only = "results/prompts/math.parquet"
    res = run(work, mine, only)
    assert res.returncode == 0, res.stderr[-3000:]

    data.touch()
    assert planned_rules(work, only, "--configfile", str(mine)) == {}
    original = data.read_bytes()
    data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert set(planned_rules(work, only, "--configfile", str(mine))) == {"prompts"}
    data.write_bytes(original)
    assert planned_rules(work, only, "--configfile", str(mine)) == {}

    before = tree(work / "results")
    c["datasets"]["math"]["path"] = "gone.jsonl.gz"
    mine.write_text(yaml.safe_dump(c))
    for args in (["-n"], []):
        res = run(work, mine, *args)
        assert res.returncode != 0
        assert res.stderr.strip().splitlines()[-1] == (
            f"ERROR: {mine}: datasets.math.path: gone.jsonl.gz is not a file (a relative path is read from the "
            "working directory, then from the checkout); fix the path or remove the dataset")
    assert tree(work / "results") == before


# a job kind -> the target that runs it
FULL_DISK = {
    "prompts": "results/prompts/math.parquet",
    "tiny_target": "results/target/metrics.json",
    "expand_shard": "results/expanded/math/shard0.parquet",
    "merge_expanded": "results/expanded/math.parquet",
    "tokenize": "tokenize",
    "warm_slot": "results/warm/slot0.json",
    "train": "results/train/summary.json",
    "export": "export",
    "ar_draft": "ar_draft",
    "evaluate": "results/eval/math_heldout.summary.json",
    "tables": "tables",
    "plots": "plots",
}


@pytest.fixture
def full_results():
    """results/ moved onto a tmpfs that a thread keeps full to the last byte (it takes back at once what
    Snakemake frees by deleting a job's old outputs); unmounted after, the files beneath it unchanged."""
    import subprocess
    import threading
    import time

    mounted, stop = [], threading.Event()

    def fill(path: Path) -> None:
        with open(path, "ab", buffering=0) as f:
            while not stop.is_set():
                try:
                    f.write(b"\0" * 4096)
                except OSError:
                    time.sleep(0.005)

    def make(results: Path) -> None:
        size = sum(f.stat().st_size for f in results.rglob("*") if f.is_file())
        kept = results.with_name("results.kept")
        results.rename(kept)
        results.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size + (4 << 20)}", "tmpfs", str(results)], check=True)
        mounted.append(results)
        subprocess.run(["cp", "-a", f"{kept}/.", str(results)], check=True)
        threading.Thread(target=fill, args=(results / ".filler",), daemon=True).start()
        while shutil.disk_usage(results).free > 0:
            time.sleep(0.01)

    yield make
    stop.set()
    for results in mounted:
        subprocess.run(["umount", "-l", str(results)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")
@pytest.mark.parametrize("kind", list(FULL_DISK))
def test_a_full_disk_is_one_line_for_every_job_kind(mini_copy, full_results, kind):
    """Every job kind on a full filesystem (its log's too): one ERROR line naming where under results/ and
    "no space left on device" (was a 20-line traceback, or torch's "unexpected pos"), no traceback."""
    work, cfg = mini_copy
    full_results(work / "results")
    res = snakemake(work, FULL_DISK[kind], "--cores", "2", "--forcerun", kind, "--configfile", str(cfg))
    assert res.returncode != 0
    errors = {ln.split("  [")[0] for ln in res.stderr.splitlines() if ln.startswith("ERROR")}
    assert len(errors) == 1, res.stderr[-3000:]
    (line,) = errors
    assert "no space left on device writing " in line and "results/" in line, line
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


# a job kind -> (the target that runs it, its outputs under results/, deleted so that the job must run, and the
# folder made read-only: results/ itself, or the outputs' own); in an order in which each target plans its
# job alone (what reads a kind's outputs comes before it, its outputs already gone)
READ_ONLY = {
    "plots": ("plots", ["plots/*.png"], "plots"),
    "tables": ("tables", ["tables/*.csv"], ""),
    "evaluate": ("results/eval/math_heldout.summary.json", ["eval/math_heldout.*"], ""),
    "ar_draft": ("ar_draft", ["ar_draft/*.safetensors", "ar_draft/*config.json", "ar_draft/tokenizer.json",
                              "ar_draft/chat_template.jinja"], ""),
    "export": ("export", ["drafter/*"], "drafter"),
    "train": ("results/train/summary.json", ["train/summary.json", "train/metrics.csv", "train/final.safetensors"], ""),
    "warm_slot": ("results/warm/slot0.json", ["warm/slot0.json"], ""),
    "tokenize": ("tokenize", ["tokenized/stats.json", "tokenized/train/*"], "tokenized"),
    "merge_expanded": ("results/expanded/math.parquet", ["expanded/math.parquet"], ""),
    "expand_shard": ("results/expanded/math/shard0.parquet", ["expanded/math/shard0.parquet"], ""),
    "tiny_target": ("results/target/metrics.json", ["target/model/*", "target/metrics.json", "target/fingerprint.json"], ""),
    "prompts": ("results/prompts/math.parquet", ["prompts/math.parquet", "prompts/math.stats.json"], ""),
}
# the kinds whose outputs are put back (renamed: the same bytes and dates) after their refusal: made again, they
# would rerun every job after them (by date; each restores its outputs, +25 s), the recovery that
# test_a_rebuilt_input_of_the_same_content_recomputes_nothing checks; the rerun here makes the others again
PUT_BACK = ("warm_slot", "tokenize", "merge_expanded", "expand_shard", "tiny_target", "prompts")


def contents(results: Path) -> dict[str, str]:
    """sha256 of every file under results/ but what every job writes anew: its log and timings, the digest
    cache, the GPU slots' lease files."""
    return {str(p.relative_to(results)): sha256(p) for p in sorted(results.rglob("*"))
            if p.is_file() and p.relative_to(results).parts[0] not in ("logs", "benchmarks", ".cache", "locks")}


@pytest.fixture
def read_only():
    """``with read_only(folder):`` a read-only bind mount of the folder over itself (root writes through a
    chmod); unmounted after."""
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def mount(folder: Path):
        subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], check=True)
        try:
            yield
        finally:
            subprocess.run(["umount", str(folder)], check=True)

    return mount


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount (root)")
def test_a_read_only_results_is_one_line_for_every_job_kind_and_a_rerun_recovers(mini_copy, read_only):
    """A job that must run and cannot write: where its outputs are there, Snakemake's own "Write-protected
    output files" while it plans; where they are not (deleted, also under a read-only folder of their own),
    Snakemake deleted them anyway before the job (unlink fails on a read-only filesystem, the file there or
    not): its 40-line OSError traceback. Now one ERROR line for each kind, naming the file and the folder,
    before any job starts; no file under results/ written (mtime and sha256); once the mount is gone, the
    plain rerun makes the outputs again, the same bytes."""
    import re

    work, cfg = mini_copy
    results, stash = work / "results", work / "stash"
    original = contents(results)
    with read_only(results):  # the outputs there
        res = snakemake(work, "export", "--cores", "2", "--forcerun", "export", "--configfile", str(cfg))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Write-protected output files for rule export" in out, out[-3000:]
    assert "Traceback" not in out and not re.search(r"^ERROR", out, re.M), out[-3000:]

    for kind, (target, outputs, folder) in READ_ONLY.items():
        gone = sorted(str(p.relative_to(work)) for g in outputs for p in results.glob(g))
        assert gone, kind
        for f in gone:
            (stash / f).parent.mkdir(parents=True, exist_ok=True)
            (work / f).rename(stash / f)
        before = tree(results)
        with read_only(results / folder):
            res = snakemake(work, target, "--cores", "2", "--configfile", str(cfg))
        assert res.returncode != 0
        assert "Traceback" not in res.stderr and "OSError" not in res.stderr, res.stderr[-3000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("ERROR")]
        assert len(errors) == 1, res.stderr[-3000:]
        m = re.fullmatch(rf"ERROR: {kind}: cannot write (\S+): (\S+) is on a read-only filesystem; remount it "
                         r"read-write and rerun: no job ran, no file changed", errors[0])
        assert m and m[1] in gone and m[2] == os.path.dirname(m[1]), errors[0]
        assert tree(results) == before, kind
        if kind in PUT_BACK:
            for f in gone:
                (stash / f).rename(work / f)

    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    again = contents(results)
    assert sorted(k for k in again.keys() | original.keys() if again.get(k) != original.get(k)) == []


def test_a_folder_the_user_may_not_write_in_is_named_with_its_chmod(tmp_path, monkeypatch):
    """Not root: a folder without write permission (root writes through it, so os.access is stubbed here)."""
    from dflashpipe.jobs.writable import unwritable

    drafter = tmp_path / "results/drafter"
    drafter.mkdir(parents=True)
    jobs = [("evaluate", [str(tmp_path / "results/eval/math.summary.json")]),  # results/eval/ not there yet
            ("export", [str(drafter / "config.json"), str(drafter / "model.safetensors")])]
    assert unwritable(jobs) is None
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(drafter))
    assert unwritable(jobs) == (f"export: cannot write {drafter}/config.json: {drafter} is not writable by this user; "
                                f"make it writable (chmod u+w {drafter}) and rerun: no job ran, no file changed")
