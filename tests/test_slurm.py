"""The pipeline on a real one-node SLURM cluster, through Snakemake's executor plugin.

The fixture installs SLURM and munge with apt-get if they are missing (as root; CI runs as root),
starts munged, slurmctld and slurmd on this machine as a one-node cluster with two fake GPUs
(a `gpu` GRES of two plain files instead of devices, so `--gpus=2` jobs are scheduled on a CPU-only
machine), runs the mini pipeline with `--executor slurm`, and stops every daemon it started. Where
the daemons cannot start, the test is skipped with the reason printed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import mini_config, snakemake, snakemake_env, write_config

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")


MARKER = "# written by tests/test_slurm.py (removed when the test ends)\n"


def _skip(reason: str):
    """Skip with the reason printed; CI sets DFLASH_REQUIRE_SLURM=1, which makes it a failure."""
    print(f"SKIP test_slurm: {reason}")
    if os.environ.get("DFLASH_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM test required (DFLASH_REQUIRE_SLURM=1) but: {reason}")
    pytest.skip(reason)


def _die_with_pytest():
    """A pre-exec function: the daemon gets SIGKILL if pytest dies (a CI time-out leaves nothing running)."""
    import ctypes
    import signal

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _install() -> None:
    """apt-get the cluster software if a daemon is missing (root only; a few minutes, once)."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        _skip("SLURM is not installed and this user cannot apt-get it (run as root, or install slurm-wlm and munge)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            _skip(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")


def _node_line() -> str:
    """`NodeName=... CPUs=... RealMemory=...` as slurmd sees this machine (a node that claims more is drained)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), None)
    if line is None:
        _skip(f"slurmd -C printed no node line: {out[-300:]}")
    return line


def _wait(check, timeout_s: float, what: str, logs: list[Path]) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        time.sleep(1)
    tails = " | ".join(f"{p.name}: {p.read_text(errors='replace')[-300:]}" for p in logs if p.exists())
    _skip(f"{what} within {timeout_s:.0f} s ({tails})")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    _install()
    if os.geteuid() != 0:
        _skip("starting slurmctld/slurmd needs root")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    host = socket.gethostname()
    node = _node_line().split()
    node = [kv for kv in node if kv.split("=")[0] in ("NodeName", "CPUs", "RealMemory", "Boards", "SocketsPerBoard",
                                                       "CoresPerSocket", "ThreadsPerCore")]
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dflashtest", f"SlurmctldHost={host}", "SlurmUser=root", "AuthType=auth/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory", "ReturnToService=2", "MinJobAge=600", "GresTypes=gpu",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'log/slurmctld.log'}", f"SlurmdLogFile={d / 'log/slurmd.log'}",
        "SlurmctldPort=6917", "SlurmdPort=6918",
        " ".join(node) + " Gres=gpu:2 State=UNKNOWN",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    for i in range(2):  # fake GPUs: plain files (slurmd logs that they are no devices and schedules them)
        (d / f"fakegpu{i}").touch()
    (d / "gres.conf").write_text(f"NodeName={host} Name=gpu File={d}/fakegpu[0-1]\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    # srun inside a job finds no SLURM_CONF (the plugin's job step drops SLURM_* variables): it
    # reads the default /etc/slurm/slurm.conf, which this test writes and removes again
    system_conf = Path("/etc/slurm")
    existing = system_conf / "slurm.conf"
    if existing.exists() and not existing.read_text(errors="replace").startswith(MARKER):
        _skip("/etc/slurm/slurm.conf exists (a configured SLURM installation): not touching it")
    placed, started = [], []
    logs = [d / "log/slurmctld.log", d / "log/slurmd.log"]
    try:
        system_conf.mkdir(parents=True, exist_ok=True)
        for name in ("slurm.conf", "gres.conf"):  # (a copy left by a killed run of this test is taken over)
            (system_conf / name).write_text(MARKER + (d / name).read_text())
            placed.append(system_conf / name)
        if subprocess.run(["bash", "-c", "munge -n | unmunge"], capture_output=True).returncode != 0:
            key = Path("/etc/munge/munge.key")
            if not key.exists():
                key.parent.mkdir(parents=True, exist_ok=True)
                key.write_bytes(os.urandom(1024))
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            started.append(subprocess.Popen(["munged", "--foreground"], user="munge", group="munge",
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            preexec_fn=_die_with_pytest()))
            _wait(lambda: subprocess.run(["bash", "-c", "munge -n | unmunge"], capture_output=True).returncode == 0,
                  30, "munged did not start", [])
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_pytest()))
            time.sleep(2)

        def idle() -> bool:
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            return res.returncode == 0 and res.stdout.strip() in ("idle", "mixed")

        _wait(idle, 60, "the node did not become idle", logs)
        yield env
    finally:
        if len(started) >= 2:  # jobs of a failed run: cancelled, and gone, before the daemons stop
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
            deadline = time.time() + 60
            while time.time() < deadline and subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                                             text=True).stdout.strip():
                time.sleep(1)
        for f in placed:
            f.unlink(missing_ok=True)
        for p in reversed(started):
            p.terminate()
        for p in reversed(started):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.slow  # ~7 min on 2 cores: every job through sbatch (bash scripts/test.sh -m slow)
def test_the_mini_pipeline_on_slurm_equals_a_local_run(slurm_cluster, mini_run, tmp_path):
    """Every job goes through sbatch; the training job holds both fake GPUs and runs its two gloo
    ranks together (co-scheduled by construction: one job); the drafter equals the local run's."""
    ref, _ = mini_run
    work = tmp_path / "wf"
    work.mkdir()
    cfg = write_config(work / "config.yaml", mini_config())
    env = snakemake_env(SLURM_CONF=slurm_cluster["SLURM_CONF"])
    res = snakemake(work, "--executor", "slurm", "--jobs", "2", "--latency-wait", "10",
                    "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "3",
                    "--slurm-keep-successful-logs", "--default-resources", "mem_mb=400", "runtime=30",
                    "--configfile", str(cfg), env=env, timeout=2400)
    logs = work / ".snakemake/slurm_logs"
    assert res.returncode == 0, res.stderr[-4000:] + "".join(
        f"\n{p}: {p.read_text(errors='replace')[-800:]}" for p in sorted(logs.rglob("*.log"))[-3:])
    assert len(list((logs / "rule_train").rglob("*.log"))) == 1  # ONE sbatch job for both ranks
    r = work / "results"
    s = json.loads((r / "train/summary.json").read_text())
    assert s["world_size"] == 2 and max(x["started_at"] for x in s["ranks"]) < min(x["finished_at"] for x in s["ranks"])
    a, b = load_file(r / "drafter/model.safetensors"), load_file(ref / "results/drafter/model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert json.loads((r / "eval/math_heldout.summary.json").read_text())["lossless"]["passed"]
    assert (r / "plots/tau_speedup.png").stat().st_size > 5000
    assert subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip() == ""
