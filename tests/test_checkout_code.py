"""Jobs run the library of the checkout whose Snakefile planned them, not an installed one.

"Installed" here is a throwaway venv whose site-packages hold a ``.pth`` pointing at a
sabotaged copy of ``dflashpipe`` (like an editable install of another clone, or a
``pip install .``), then the test environment's own site-packages.
"""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mini_config, snakemake_env, write_config

MARKER = "code of the installed copy ran"


def _installed_copy(tmp: Path, front: bool) -> tuple[Path, Path]:
    """(python, copy's workflow dir): a venv where ``import dflashpipe`` finds a copy that fails loudly.

    ``front``: the ``.pth`` inserts the copy at the front of sys.path (ahead of PYTHONPATH) instead
    of appending it like an install does."""
    other = tmp / "other" / "workflow"
    shutil.copytree(REPO / "workflow" / "dflashpipe", other / "dflashpipe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "dflashpipe" / "inputs/data.py", "a") as f:
        f.write(f"\n\ndef prepare_prompts(*args, **kwargs):\n    raise SystemExit({MARKER!r})\n")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    line = f"import sys; sys.path.insert(0, {str(other)!r})" if front else str(other)
    Path(purelib, "00-other-checkout.pth").write_text(line + "\n")
    # then this environment's packages (snakemake, torch, ...; their .pth files too)
    Path(purelib, "01-base.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()) + "\n")
    found = subprocess.run([str(py), "-c", "import dflashpipe; print(dflashpipe.__file__)"], check=True,
                           capture_output=True, text=True, env=snakemake_env()).stdout
    assert str(other) in found  # the venv really has the other copy installed
    return py, other


def test_script_job_runs_the_planning_checkouts_code(tmp_path):
    py, other = _installed_copy(tmp_path, front=False)
    work = tmp_path / "wf"
    work.mkdir()
    cfg = write_config(work / "config.yaml", mini_config())
    res = subprocess.run([str(py), "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work),
                          "results/prompts/math.parquet", "--cores", "1", "--configfile", str(cfg)],
                         cwd=work, env=snakemake_env(), capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert MARKER not in out
    assert res.returncode == 0, out[-3000:]
    assert (work / "results" / "prompts" / "math.parquet").is_file()


def _launch_one_rank(py_launcher: Path, rank_py: Path, log: Path, code_env: str | None, path: str | None = None) -> str:
    """Run launch() with one rank that enters a job (logging to ``log``) and prints the library it runs;
    launch's outcome."""
    rank_code = ("import dflashpipe\nfrom dflashpipe.jobs.runtime import job\n"
                 f"with job({str(log)!r}, name='rank 0'):\n    print('RANK RAN', dflashpipe.__file__)\n")
    driver = (
        "from dflashpipe.training.launch import launch\nfrom dflashpipe.jobs.errors import UserError\n"
        "try:\n"
        f"    launch([{str(rank_py)!r}, '-c', {rank_code!r}], [{str(log)!r}], log=lambda m: None)\n"
        "    print('LAUNCH OK')\n"
        "except UserError as err:\n    print('LAUNCH FAILED:', err)\n"
    )
    env = snakemake_env()
    env.pop("DFLASHPIPE_CODE_DIR", None)
    env.pop("PYTHONPATH", None)
    if code_env:
        env["DFLASHPIPE_CODE_DIR"] = code_env
    if path:
        env["PYTHONPATH"] = path
    res = subprocess.run([str(py_launcher), "-c", driver], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_rank_processes_run_the_pinned_checkout(tmp_path):
    """The launcher itself imported the installed copy, but the Snakefile pinned this checkout: ranks run ours."""
    py, other = _installed_copy(tmp_path, front=False)
    out = _launch_one_rank(py, py, tmp_path / "rank0.log", code_env=str(REPO / "workflow"))
    assert "LAUNCH OK" in out, out
    log = (tmp_path / "rank0.log").read_text()
    assert f"RANK RAN {REPO / 'workflow' / 'dflashpipe' / '__init__.py'}" in log, log


def test_a_shadowed_checkout_is_refused_in_one_line(tmp_path):
    """A .pth that puts another copy AHEAD of PYTHONPATH: the rank refuses, naming both paths."""
    rank_py, other = _installed_copy(tmp_path, front=True)
    out = _launch_one_rank(Path(sys.executable), rank_py, tmp_path / "rank0.log", code_env=str(REPO / "workflow"),
                           path=str(REPO / "workflow"))
    assert "LAUNCH FAILED" in out and "RANK RAN" not in (tmp_path / "rank0.log").read_text(), out
    line = [ln for ln in out.splitlines() if ln.startswith("LAUNCH FAILED")][0]
    assert str(other) in line and str(REPO) in line, line


def test_failed_rank_is_reported_with_this_attempts_error_line(tmp_path):
    """Rank logs are appended to: an earlier attempt's ERROR line must not be named as this failure's cause."""
    from dflashpipe.training.launch import launch
    from dflashpipe.jobs.errors import UserError

    log = tmp_path / "rank0.log"
    log.write_text("[00:00:01] rank 0: start\nERROR: an earlier attempt's failure\n")
    crash = (f"import sys; log = open({str(log)!r}, 'a'); print('step 3', file=log); "
             "print('Segmentation fault in the kernel', file=log); log.close(); sys.exit(3)")
    with pytest.raises(UserError) as err:
        launch([sys.executable, "-c", crash], [str(log)], log=lambda m: None)
    msg = str(err.value)
    assert "earlier attempt" not in msg, msg
    assert "Segmentation fault in the kernel" in msg and "exit code 3" in msg, msg
    assert "ERROR: an earlier attempt's failure" in log.read_text()  # the log keeps its history


def test_a_rank_stopped_because_a_peer_left_is_not_named_as_the_cause(tmp_path):
    """A rank whose collective broke because another rank left says so in one line (no traceback): when no
    rank has an ERROR line and none was killed, the launcher names another one."""
    from dflashpipe.training.launch import STOPPED, _culprit, peer_left

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:21682. This is typically caused by a remote worker crashing.")
    assert peer_left(gloo) and not peer_left(RuntimeError("CUDA error: an illegal memory access"))
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    logs[0].write_text(f"step 3\ntrain rank 0/2: {STOPPED} (Connection closed by peer [127.0.0.1]:21682. ...)\n")
    logs[1].write_text("step 3\nRuntimeError: a kernel's own failure\n")
    assert _culprit([0, 1], {0: 1, 1: 1}, [str(p) for p in logs], {0: 0, 1: 0}) == 1


def test_tests_edit_a_copy_of_the_checkout_and_one_left_in_it_stops_the_next_session(tmp_path, monkeypatch):
    """planned_after_edit edits a library file in a checkout of its own: this checkout's file keeps its bytes and
    date while the copy's edit is planned (tests running beside it, ``pytest -n``, see the code as it is). An
    edit found in this checkout all the same (an older test run's) stops the next session, naming the file."""
    import conftest

    plots = conftest.REPO / "workflow" / "dflashpipe" / "stages" / "plots.py"
    before = (plots.read_bytes(), plots.stat().st_mtime_ns)
    work = tmp_path / "work"
    work.mkdir()
    cfg = conftest.write_config(work / "config.yaml", conftest.mini_config())
    assert {"plots", "train", "tokenize"} <= conftest.planned_after_edit(work, cfg, "stages/plots.py")
    assert (plots.read_bytes(), plots.stat().st_mtime_ns) == before
    assert [p.parent.name for p in conftest.edits_left_behind(tmp_path)] == ["stages"]  # the copy's, beside work

    lib = tmp_path / "repo" / "workflow" / "dflashpipe"
    lib.mkdir(parents=True)
    (lib / "clean.py").write_text("x = 1\n")
    monkeypatch.setattr(conftest, "REPO", tmp_path / "repo")
    conftest.pytest_sessionstart(None)  # clean: starts
    (lib / "edited.py").write_text("x = 1\n" + conftest.CODE_EDIT)
    assert conftest.edits_left_behind(tmp_path / "repo" / "workflow") == [lib / "edited.py"]
    with pytest.raises(pytest.UsageError, match=r"edited\.py: holds a test's edit .*git checkout -- "
                                                 r"workflow/dflashpipe/edited\.py"):
        conftest.pytest_sessionstart(None)
