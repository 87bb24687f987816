"""A real SLURM cluster of N compute nodes on the test machine, for tests/test_slurm.py.

Debian's slurm-wlm and munge (scripts/test.sh installs them as root). One
slurmctld in the machine's network namespace at 198.18.0.1 (a range reserved for benchmarks) on a
bridge; each node in its own network namespace with a veth pair (``eth0``, 198.18.0.1K), its own
hostname (``nK``) and its own slurmd. Every node has two fake GPUs: a ``gpu`` GRES of plain files, so
``--gpus``/``--gres=gpu`` jobs are scheduled on a CPU-only machine. No accounting (the executor plugin
reads job states with squeue).

Everything it starts dies with the test process (``PR_SET_PDEATHSIG``) and is removed when the
``cluster`` context ends; a run killed before that is cleaned up by the next one (the namespaces, the
bridge and ``/etc/slurm/*.conf`` carry this module's names and marker). One cluster at a time on a
machine: a second test run waits for the first (an flock on ``/etc/slurm``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "srun", "ip", "nsenter", "unshare")
MARKER = "# written by tests/slurm_cluster.py (removed when the test ends)\n"
BRIDGE, SUBNET = "dflashbr0", "198.18.0"
SYSTEM_CONF = Path("/etc/slurm")  # where srun inside a job reads its config; also the lock of one cluster at a time
PORTS = {"SlurmctldPort": 6917, "SlurmdPort": 6918}
GPUS_PER_NODE = 2


class Unavailable(Exception):
    """The cluster cannot run here (the reason is the message); the tests skip with it."""


def node_name(k: int) -> str:
    return f"n{k}"


def netns(k: int) -> str:
    return f"dflash-{node_name(k)}"


def node_address(k: int) -> str:
    return f"{SUBNET}.{10 + k}"


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=kw.pop("timeout", 120), **kw)
    if check and res.returncode != 0:
        raise Unavailable(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()[-300:]}")
    return res


def check_installed() -> None:
    """The cluster's programs are there (scripts/test.sh installs them, as root)."""
    missing = [d for d in DAEMONS if not shutil.which(d)]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not installed: run the tests with scripts/test.sh as root, which "
                          "installs them, or apt-get install slurm-wlm munge iproute2")


def _die_with_parent():
    """A pre-exec function: the daemon gets SIGKILL if the test process dies (a CI time-out leaves nothing running)."""
    import ctypes
    import signal

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _remove_network(nodes: int) -> None:
    for k in range(1, nodes + 1):
        _run("ip", "netns", "delete", netns(k), check=False)
    _run("ip", "link", "delete", BRIDGE, check=False)


def _make_network(nodes: int) -> None:
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    for k in range(1, nodes + 1):
        ns, host_end = netns(k), f"dflv{k}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", host_end, "master", BRIDGE)
        _run("ip", "link", "set", host_end, "up")
        for cmd in (["addr", "add", f"{node_address(k)}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                    ["link", "set", "lo", "up"]):
            _run("ip", "-n", ns, *cmd)


def _munge() -> subprocess.Popen | None:
    """A munged for the cluster, unless one already answers (its unix socket serves every namespace)."""
    if subprocess.run(["bash", "-c", "munge -n | unmunge"], capture_output=True).returncode == 0:
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        key.write_bytes(os.urandom(1024))
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    proc = subprocess.Popen(["munged", "--foreground"], user="munge", group="munge", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent())
    wait_for(lambda: subprocess.run(["bash", "-c", "munge -n | unmunge"], capture_output=True).returncode == 0,
             30, "munged did not start")
    return proc


def _node_hardware() -> str:
    """`CPUs=... RealMemory=...` as slurmd sees this machine (every node is all of it: a node that claims
    more than slurmd finds is drained)."""
    out = _run("slurmd", "-C", timeout=60).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("NodeName=")), None)
    if line is None:
        raise Unavailable(f"slurmd -C printed no node line: {out[-300:]}")
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    return " ".join(kv for kv in line.split() if kv.split("=")[0] in keep)


def wait_for(check, timeout_s: float, what: str, logs: list[Path] = ()) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.5)
    tails = " | ".join(f"{p.name}: {p.read_text(errors='replace')[-300:]}" for p in logs if p.exists())
    raise Unavailable(f"{what} within {timeout_s:.0f} s ({tails})")


@contextlib.contextmanager
def _machine_lock(timeout_s: float = 3600):
    """One cluster at a time on this machine: an flock on the system's SLURM config folder (no file left behind)."""
    SYSTEM_CONF.mkdir(parents=True, exist_ok=True)
    fd = os.open(SYSTEM_CONF, os.O_RDONLY)
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.time() > deadline:
                    raise Unavailable(f"another SLURM test run held {SYSTEM_CONF} for {timeout_s:.0f} s") from None
                time.sleep(1)
        yield
    finally:
        os.close(fd)


def _write_config(d: Path, nodes: int) -> Path:
    hardware = _node_hardware()
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=dflashtest", f"SlurmctldHost={socket.gethostname()}({SUBNET}.1)", "SlurmUser=root",
        "AuthType=auth/munge", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "ReturnToService=2",
        "MinJobAge=600", "KillWait=5", "GresTypes=gpu", "MailProg=/bin/true",
        *(f"{k}={v}" for k, v in PORTS.items()),
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={d / 'log/slurmctld.log'}", f"SlurmdLogFile={d / 'log/slurmd.%n.log'}",
        *(f"NodeName={node_name(k)} NodeAddr={node_address(k)} {hardware} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
          for k in range(1, nodes + 1)),
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    gres = []
    for k in range(1, nodes + 1):  # fake GPUs: plain files (slurmd logs that they are no devices and schedules them)
        files = [d / f"fakegpu_{node_name(k)}_{i}" for i in range(GPUS_PER_NODE)]
        for f in files:
            f.touch()
        gres.append(f"NodeName={node_name(k)} Name=gpu File={d}/fakegpu_{node_name(k)}_[0-{GPUS_PER_NODE - 1}]")
    (d / "gres.conf").write_text("\n".join(gres) + "\n")
    return conf


@contextlib.contextmanager
def cluster(d: Path, nodes: int = 2):
    """Start the cluster (config and logs under ``d``); yields the environment that reaches it."""
    if os.geteuid() != 0:
        raise Unavailable("starting slurmctld/slurmd and network namespaces needs root")
    check_installed()
    with _machine_lock():
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        system = [SYSTEM_CONF / "slurm.conf", SYSTEM_CONF / "gres.conf"]
        for f in system:
            if f.exists() and not f.read_text(errors="replace").startswith(MARKER):
                raise Unavailable(f"{f} exists (a configured SLURM installation): not touching it")
        conf = _write_config(d, nodes)
        env = dict(os.environ, SLURM_CONF=str(conf))
        started: list[subprocess.Popen] = []
        logs = [d / "log/slurmctld.log", *(d / f"log/slurmd.{node_name(k)}.log" for k in range(1, nodes + 1))]
        _remove_network(nodes)  # a killed run's leftovers
        try:
            _make_network(nodes)
            # srun inside a job finds no SLURM_CONF (the executor's job step drops SLURM_* variables): it
            # reads the default /etc/slurm/slurm.conf, written here and removed again
            for f in system:
                f.write_text(MARKER + (d / f.name).read_text())
            munged = _munge()
            started += [munged] if munged else []
            started.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent()))
            for k in range(1, nodes + 1):
                # nsenter, not `ip netns exec` (which remounts /sys: slurmd then finds no cgroup filesystem)
                cmd = f"hostname {node_name(k)} && exec slurmd -D -N {node_name(k)} -f {conf}"
                started.append(subprocess.Popen(
                    ["nsenter", f"--net=/run/netns/{netns(k)}", "unshare", "--uts", "sh", "-c", cmd], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent()))

            def idle() -> bool:
                res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
                states = res.stdout.split()
                return res.returncode == 0 and len(states) == nodes and all(s in ("idle", "mixed") for s in states)

            wait_for(idle, 60, f"the {nodes} node(s) did not become idle", logs)
            yield env
        finally:
            if started:  # jobs of a failed run: cancelled, and gone, before the daemons stop
                subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
                deadline = time.time() + 60
                while time.time() < deadline and subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                                                 text=True).stdout.strip():
                    time.sleep(1)
            for p in reversed(started):
                p.terminate()
            for p in reversed(started):
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in system:
                if f.exists() and f.read_text(errors="replace").startswith(MARKER):
                    f.unlink()
            _remove_network(nodes)
