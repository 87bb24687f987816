"""A job of each kind killed mid-write, through Snakemake (the fault matrix's ``kill`` group,
tests/fault_matrix/50-kill.yaml).

On a private copy of the finished mini run, ``snakemake --forcerun RULE TARGET`` runs one job of the kind
for real (``--forcerun`` computes: the job does not restore its kept outputs); the job parks when its
output is written in full under its temporary name and not yet renamed into place (the failpoint
``atomic.publish``), and the test signals Snakemake's whole process group, as a terminal's Ctrl-C
(SIGINT) or the kernel's OOM killer or a scheduler (SIGKILL) does. Then: no file is at the output's path
(nothing half-written passes for a result), every other file under results/ is as it was, and the plain
rerun (after ``snakemake --unlock`` for SIGKILL: Snakemake's lock outlives it) makes the outputs again,
byte for byte, and leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import planned_rules, sha256, snakemake, snakemake_cmd, snakemake_env

# a job kind -> (its rule, the output asked for, the output it parks on, what the job writes: the prefix of
# its outputs under results/, which Snakemake deletes before the job starts)
KINDS = {
    "prompts": ("prompts", "prompts/math.parquet", "prompts/math.parquet", "prompts/math."),
    "expansion": ("expand_shard", "expanded/math/shard0.parquet", "expanded/math/shard0.parquet", "expanded/math/shard0"),
    "expansion-merge": ("merge_expanded", "expanded/math.parquet", "expanded/math.parquet", "expanded/math.parquet"),
    "tokenize": ("tokenize", "tokenized/stats.json", "tokenized/train", "tokenized/"),
    "warm": ("warm_slot", "warm/slot0.json", "warm/slot0.json", "warm/slot0"),
    "train": ("train", "train/summary.json", "train/summary.json", "train/"),
    "export": ("export", "drafter/model.safetensors", "drafter", "drafter/"),
    "evaluate": ("evaluate", "eval/math_heldout.summary.json", "eval/math_heldout.summary.json", "eval/math_heldout."),
    "tables": ("tables", "tables/eval.csv", "tables/eval.csv", "tables/"),
    "plots": ("plots", "plots/compile_cold_vs_hot.png", "plots/compile_cold_vs_hot.png", "plots/"),
}
# what every attempt writes anew: its logs and timings, the file-digest cache, the GPU slots' lease files
SKIPPED = ("logs", "benchmarks", ".cache", "locks")


def snapshot(results: Path) -> dict[str, str]:
    """Every file under results/ by its content (what "nothing lost" compares), logs aside."""
    return {str(p.relative_to(results)): sha256(p) for p in sorted(results.rglob("*"))
            if p.is_file() and p.relative_to(results).parts[0] not in SKIPPED}


def _temporary(rel: str) -> bool:
    return any(part.startswith(".tmp-") for part in rel.split("/"))


def temporaries(results: Path) -> list[str]:
    return sorted(str(p.relative_to(results)) for p in results.rglob(".tmp-*"))


def park_and_kill(work: Path, cfg: Path, rule: str, target: str, parks_on: str, sig: signal.Signals, marker: Path,
                  while_parked=None) -> str:
    """``snakemake --forcerun RULE TARGET`` until the job parks at its write (``while_parked()`` is called
    then), then ``sig`` to the whole process group (a terminal's Ctrl-C, the OOM killer, a scheduler);
    Snakemake's output."""
    faults = [{"at": "atomic.publish", "do": "park", "path": f"*results/{parks_on}"}]  # relative or not
    cmd = snakemake_cmd(work, f"results/{target}", "--cores", "2", "--configfile", str(cfg), "--forcerun", rule)
    return run_parked(work, cmd, faults, sig, marker, rule, while_parked)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the child: a pytest-xdist worker ignores it, an ignored signal stays
    ignored across exec, and Python then installs no KeyboardInterrupt for it (Snakemake would never stop)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_parked(work: Path, cmd: list[str], faults: list[dict], sig: signal.Signals, marker: Path, what: str,
               while_parked=None) -> str:
    marker.unlink(missing_ok=True)
    env = snakemake_env(DFLASH_FAULTS=json.dumps(faults), DFLASH_FAULT_MARKER=str(marker))
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if not marker.exists():
            proc.kill()
            pytest.fail(f"{what} never reached its fault point:\n{proc.communicate()[0][-3000:]}")
        if while_parked:
            while_parked()
        os.killpg(proc.pid, sig)
        return proc.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # a job Snakemake left behind (it should leave none)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_job_killed_mid_write_loses_nothing_and_the_rerun_makes_it_again(mini_copy, tmp_path, kind):
    work, cfg = mini_copy
    rule, target, parks_on, writes = KINDS[kind]
    results = work / "results"
    before = snapshot(results)
    assert target in before, sorted(before)

    def second_invocation():  # a second snakemake in the same folder while the first one runs: refused
        assert temporaries(results), "parked before the temporary output was written"
        if kind == "tables":
            res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
            assert res.returncode != 0 and "Directory cannot be locked" in res.stdout + res.stderr, res.stderr[-2000:]

    for sig in (signal.SIGINT, signal.SIGKILL):  # the SIGKILL run also shows that SIGINT left no lock behind
        console = park_and_kill(work, cfg, rule, target, parks_on, sig, tmp_path / "parked.json", second_invocation)
        if sig == signal.SIGINT:  # what the user sees on Ctrl-C: Snakemake's line, no traceback
            assert "Terminating processes on user request" in console, console[-3000:]
            assert "Traceback" not in console, console[-3000:]
        # nothing half-written at the output's path; every file the job does not write is as it was
        assert not (results / target).exists(), f"{target} is there after {sig.name}"
        after = snapshot(results)
        changed = {k for k in before if after.get(k) != before[k]}
        assert all(k.startswith(writes) for k in changed), f"{sig.name}: files not the job's changed: {sorted(changed)}"
        # new: at most the attempt's temporary output and an expansion's chunks (what a resumed expansion reads)
        new = {k for k in after if k not in before and not _temporary(k) and ".chunks/" not in k}
        assert not new, f"{sig.name}: new files {sorted(new)}"
        if sig == signal.SIGINT:  # Snakemake stops its job, which removes its temporary output
            assert temporaries(results) == [], "SIGINT left a temporary output"

    if kind == "prompts":  # what the user sees after a SIGKILL: Snakemake's lock outlives it, and says so
        res = snakemake(work, f"results/{target}", "--cores", "2", "--configfile", str(cfg))
        assert res.returncode != 0 and "--unlock" in res.stdout + res.stderr, res.stderr[-2000:]
    res = snakemake(work, "--configfile", str(cfg), "--unlock")
    assert res.returncode == 0, res.stderr[-2000:]
    res = snakemake(work, f"results/{target}", "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    again = snapshot(results)
    if rule == "warm_slot":  # a cache stamp: written again by every warm job (it is not kept for reuse)
        assert again.pop(target, None) and before.pop(target)
    differ = sorted(k for k in again.keys() | before.keys() if again.get(k) != before.get(k))
    assert not differ, f"not as it was after the rerun: {differ}"
    assert temporaries(results) == [], "a temporary output of the killed attempt is left"


def test_a_copied_run_folder_plans_nothing(mini_copy):
    """``cp -a`` of a finished run's folder (results/ and .snakemake/): Snakemake plans nothing there."""
    work, cfg = mini_copy
    assert planned_rules(work, "--configfile", str(cfg)) == {}


def test_a_dry_run_interrupted_while_it_plans_writes_nothing_and_leaves_no_lock(mini_copy, tmp_path):
    work, cfg = mini_copy
    results = work / "results"
    before = snapshot(results)
    stamps = {str(p): p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    cmd = snakemake_cmd(work, "-n", "--configfile", str(cfg), "--forceall")
    console = run_parked(work, cmd, [{"at": "workflow.plan", "do": "park"}], signal.SIGINT, tmp_path / "parked.json",
                         "the dry run")
    # Snakemake's own trace: it does not catch a Ctrl-C while it reads the workflow (the row says so)
    assert console.rstrip().endswith("KeyboardInterrupt"), console[-3000:]
    assert snapshot(results) == before
    assert {str(p): p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()} == stamps
    assert planned_rules(work, "--configfile", str(cfg)) == {}  # and the next plan finds every output


def test_a_run_killed_writing_a_checkpoint_resumes_from_the_last_good_one_through_snakemake(
        mini_run, mini_copy, tmp_path):
    """The mini run trained again (6 steps, a checkpoint every 2, the newest two kept) and SIGKILLed, whole, as
    rank 0 writes step 6's checkpoint: written in full under its temporary name, not yet in place. Then the
    newest checkpoint in place (step 4) is cut short too, as a crash of the machine leaves it. With no intact
    checkpoint (step 2 cut as well), the plain rerun stops in one line naming the files and the folder to
    delete; with step 2 intact, it resumes from step 2 (never from the broken step 4 or the half-written
    step 6, which is removed) and ends with the same weights, bit for bit, and the same losses as the
    uninterrupted run; the evaluation finds the same drafter and restores its outputs, byte for byte."""
    ref, _ = mini_run
    work, cfg = mini_copy
    results = work / "results"
    before = snapshot(results)
    shutil.rmtree(results / "train/checkpoints")  # the finished run forgotten: it trains again
    faults = [{"at": "atomic.publish", "do": "park", "path": "*/step0000006.pt"}]
    cmd = snakemake_cmd(work, "--cores", "2", "--configfile", str(cfg), "--forcerun", "train")
    run_parked(work, cmd, faults, signal.SIGKILL, tmp_path / "parked.json", "step 6's checkpoint")
    (ckpt,) = (results / "train/checkpoints").iterdir()
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step0000002.pt", "step0000004.pt"]
    assert [p.name for p in ckpt.glob(".tmp-*")], "no half-written checkpoint"
    step2, step4 = ckpt / "step0000002.pt", ckpt / "step0000004.pt"
    intact = step2.read_bytes()
    step4.write_bytes(step4.read_bytes()[:300_000])
    assert snakemake(work, "--unlock", "--configfile", str(cfg)).returncode == 0

    step2.write_bytes(intact[:1000])  # no checkpoint loads: one line, nothing trained
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode != 0
    why = (f"{ckpt.relative_to(work)}: no checkpoint loads (step0000004.pt, step0000002.pt are corrupt); delete "
           f"{ckpt.relative_to(work)} to start over")
    # the job's line, and rank 0's in its log that Snakemake shows; rank 1 stopped without a traceback
    errors = {ln.split("  [")[0].strip() for ln in res.stderr.splitlines() if ln.startswith("ERROR")}
    job_line = f"ERROR: train rank 0 of 2 failed (exit code 1), the other ranks were stopped: ERROR: {why}"
    assert errors == {job_line, f"ERROR: {why}"}, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]

    step2.write_bytes(intact)
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    for k in (0, 1):
        log = (results / f"logs/train/rank{k}.log").read_text()
        assert "resumed from step 2" in log, log[-2000:]
    assert f"WARNING: {step4.relative_to(work)}: cannot load (" in (results / "logs/train/rank0.log").read_text()
    assert not list(ckpt.glob(".tmp-*")) and sorted(p.name for p in ckpt.glob("step*")) == [
        "step0000004.pt", "step0000006.pt"]
    # every file as it was (the final weights, the drafter, the evaluation, its tables and plots), but the
    # training's records of its times (and the checkpoints and tables that hold them), its launch files and the
    # jobs' kept outputs (results/.memo: the export's, kept again under its new input); the figures are the same
    after = snapshot(results)
    timed = ("train/metrics.csv", "train/summary.json", "train/checkpoints/*", "train/tensorboard/*",
             "tables/training.csv", "tables/compile.csv", "plots/training_*.png", ".memo/*")
    differ = sorted(k for k in before if after.get(k) != before[k] and not any(fnmatch.fnmatch(k, g) for g in timed))
    assert differ == [], "\n".join(differ)
    new = sorted(after.keys() - before.keys())
    assert all(k.startswith(("train/tensorboard/", "train/launch/", ".memo/")) for k in new), "\n".join(new)
    figures = ["step", "loss", "acc", "lr", "grad_norm", "heldout_loss", "heldout_acc", "heldout_sim_tau"]
    m, r = (pd.read_csv(w / "results/train/metrics.csv")[figures] for w in (work, ref))
    pd.testing.assert_frame_equal(m, r)
