"""Start the ranks of one training run together, on one node or several; they succeed or fail as one.

One Snakemake job is one training run of ``nodes x shards`` ranks, one GPU each. The job leases
GPU slots 0..shards-1 (waiting until every one is free, so no rank starts before its peers can;
under SLURM the allocation is the lease), then starts every node's ranks with torch's own launcher,
the elastic agent that ``torchrun`` runs (``elastic_launch``, in the launcher's process, with no
restarts): rank = node x shards + local rank, each rank process sees the GPU of its local rank as
``cuda:0`` and starts hot from that slot's warm cache, and the ranks meet through the agent's store
(``env://``). On one node the job itself is the node's launcher. On several (``train.nodes``, a SLURM
allocation) the job starts one launcher per node with ``srun`` (``python -m dflashpipe.training.launch
node SPEC``), whose agents meet in a static rendezvous at the first node's address (SLURM's
``NodeAddr``); NCCL (gloo on CPU) then runs across the nodes.

When a rank fails, its agent stops the node's other ranks at once, srun (``--kill-on-bad-exit``)
stops the other nodes, and the job fails with ONE line: the failing rank's error line, or the node
whose launcher died. Rank processes die with their launcher (``PR_SET_PDEATHSIG``), so a killed job
leaves nothing running; a rerun resumes from the newest checkpoint at any ``nodes x shards``.

Why one job and not one per rank: Snakemake schedules jobs one by one, so with a job per rank a rerun
could start a lone rank whose peers' outputs were already complete (after one rank failed, or when
one output is asked for), and it would wait for peers that never come. With one job the ranks are
always scheduled, run, retried and invalidated together; on a cluster the job is one allocation
(co-scheduled by construction).

A run that finished is marked complete in its checkpoint directory only after every rank exited
cleanly and the outputs exist; a job that finds its run finished writes the outputs again and starts
no rank (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dflashpipe.jobs.checkout import ENV as CODE_ENV
from dflashpipe.jobs.checkout import planned_code
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.runtime import CONSOLE_ENV, console_fd

if TYPE_CHECKING:
    from dflashpipe.training.run import TrainRun

#: the pid of the process that started a rank (its elastic agent): the rank dies with it
LAUNCHER_ENV = "DFLASH_LAUNCHER_PID"
#: this module, run as ``python -m`` by the node launchers and the ranks
MODULE = "dflashpipe.training.launch"


def die_with_launcher() -> None:
    """In a rank process, first thing: die (SIGKILL) when the launcher that started it dies."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and os.getppid() != int(launcher):  # the launcher died before prctl took effect
        os._exit(1)


def _output_to(log_path: str) -> None:
    """This process's stdout and stderr (the descriptors) appended to ``log_path``."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


#: what a collective raises on the ranks that remain when another one left (exited, was killed)
PEER_LEFT = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
STOPPED = "stopped: a peer left the run"  # the last line of such a rank's log


def _error_line(log_path: str, start: int = 0) -> str:
    """The rank's ERROR line, else the last line of its log (the cause of a crash).

    Only the log from byte ``start`` on counts: rank logs are appended to, and an earlier attempt's
    ERROR line is not this attempt's cause."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        text = ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    if not lines:
        return "nothing in its log: it failed while starting (its launcher's log has the output)"
    return (errors[-1] if errors else lines[-1])[:300]


def _culprit(failed: list[int], codes: dict, rank_logs: list[str], starts: dict) -> int:
    """The rank that most likely caused the failure: one with an ERROR line, else one killed by a
    signal, else the first that did not stop because a peer left. (A peer of a dead rank fails too, with
    a mere connection error: :func:`rank_main` says so in its last line.)"""
    for r in failed:
        if _error_line(rank_logs[r], starts[r]).startswith("ERROR:"):
            return r
    causes = [r for r in failed if STOPPED not in _error_line(rank_logs[r], starts[r])] or failed
    return next((r for r in failed if codes.get(r, 0) < 0), causes[0])


def _log_sizes(paths: list[str]) -> dict[int, int]:
    """Where this attempt's part of each (appended) log begins."""
    return {r: (os.path.getsize(p) if os.path.exists(p) else 0) for r, p in enumerate(paths)}


def _set_environ(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _environ(**values: str | None):
    """``os.environ`` with ``values`` set (None: removed) for the duration: what the agent's ranks inherit."""
    old = {k: os.environ.get(k) for k in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(old)


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node's agent meets the other nodes' (torch's static rendezvous)."""

    nodes: int = 1
    node: int = 0  # this node's place among them
    master: str | None = None  # the first node's ``address:port`` (several nodes); None: this machine's loopback
    run_id: str | None = None  # one launch (None: a fresh one)
    timeout_s: float = 600

    @classmethod
    def of(cls, run: TrainRun, node: int = 0) -> Rendezvous:
        return cls(run.nodes, node, run.master, run.run_id, run.cfg.dist_timeout_s)


def launch(command: list[str], rank_logs: list[str], log=print, *, meet: Rendezvous = Rendezvous(),
           visible_devices: str | None = None, console: str | None = None, poll_s: float = 0.2) -> None:
    """Start this node's ranks of a run with torch's elastic agent; return when all exit 0, else raise one line.

    ``rank_logs`` holds every rank's log (``meet.nodes x`` this node's ranks); each rank writes its own
    (:func:`rank_main`). ``command`` runs once per rank (``command[0]`` the program); the ranks find
    their place in ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``.
    ``visible_devices``: the ranks' ``CUDA_VISIBLE_DEVICES`` (local rank k takes its k-th entry).
    ``console``: where rank 0 shows its progress (a path the ranks can open).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    per_node = len(rank_logs) // meet.nodes
    first = meet.node * per_node
    starts = _log_sizes(rank_logs)
    # node k's agent joins torch's static rendezvous as group k: the first node's agent holds the store at
    # ``master``; one node holds it on this machine's loopback (no hostname to resolve: a cluster node's
    # own name may not resolve; quicker to start than torchrun --standalone's c10d rendezvous: docs/multi-gpu.md)
    config = LaunchConfig(
        min_nodes=meet.nodes, max_nodes=meet.nodes, nproc_per_node=per_node, run_id=meet.run_id or uuid.uuid4().hex[:12],
        role="rank", rdzv_backend="static", rdzv_endpoint=meet.master or f"127.0.0.1:{_free_port()}",
        rdzv_configs={"rank": meet.node, "timeout": int(meet.timeout_s)}, max_restarts=0, monitor_interval=poll_s,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
    )
    # the ranks run the library of the checkout that planned the job (pinned by the Snakefile), else this
    # process's own: first on their path, and checked by each rank (dflashpipe.jobs.checkout)
    package_root = str(planned_code() or Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    env = {"PYTHONPATH": os.pathsep.join([package_root, *rest]), CODE_ENV: package_root,
           LAUNCHER_ENV: str(os.getpid()), CONSOLE_ENV: console}
    if visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    log(f"starting {per_node} rank(s) ({first}..{first + per_node - 1} of {len(rank_logs)}) with torch's elastic agent")
    try:
        with _environ(**env):
            elastic_launch(config, command[0])(*command[1:])
    except ChildFailedError as err:
        codes = {int(r): f.exitcode for r, f in err.failures.items()}
        # the agent lists the ranks it stopped (SIGTERM) after the failure too: the cause is among the others
        failed = sorted(r for r, c in codes.items() if c != -signal.SIGTERM) or sorted(codes)
        r = _culprit(failed, codes, rank_logs, starts)
        raise UserError(
            f"train rank {r} of {len(rank_logs)} failed (exit code {codes[r]}), the other ranks were stopped: "
            f"{_error_line(rank_logs[r], starts[r])}  [log: {rank_logs[r]}]"
        ) from None


def _free_port() -> int:
    """A TCP port free on this machine's loopback now (for the store of a run on this machine alone)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise UserError(f"scontrol {' '.join(args)} failed: {(out.stderr or out.stdout).strip()[:200]}")
    return out.stdout


def _scontrol_fields(*args: str) -> dict[str, str]:
    """``scontrol show ... -o``: its ``Key=Value`` fields."""
    return dict(kv.split("=", 1) for kv in _scontrol(*args).split() if "=" in kv)


def allocation(nodes: int) -> tuple[list[str], str]:
    """The nodes of this job's SLURM allocation and the first one's address, for a run on ``nodes`` nodes.

    The address is the node's ``NodeAddr``: where SLURM itself reaches it (its name, unless the
    cluster says otherwise). ``MASTER_PORT`` in the environment sets the port of the agents' store;
    else one from the job id (20000-29999)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise UserError(
            f"train.nodes is {nodes}: the training job must run in a SLURM allocation of {nodes} nodes "
            "(snakemake --profile profiles/slurm, or Snakemake inside salloc/sbatch -N); set train.nodes: 1 otherwise"
        )
    hosts = _scontrol("show", "hostnames", _scontrol_fields("show", "job", "-o", job_id)["NodeList"]).split()
    if len(hosts) < nodes:
        raise UserError(f"train.nodes is {nodes} but SLURM job {job_id} holds {len(hosts)} node(s): {' '.join(hosts)}")
    address = _scontrol_fields("show", "node", "-o", hosts[0]).get("NodeAddr", hosts[0])
    port = os.environ.get("MASTER_PORT") or str(20000 + int(job_id) % 10000)
    return hosts[:nodes], f"{address}:{port}"


_SRUN_ERROR = re.compile(r"srun: error: (\S+): task (\d+): (.+)")


def run_nodes(spec_path: str, run: TrainRun, log=print) -> None:
    """The ranks of every node: one node launcher per node started with srun; one line if any fails.

    srun stops every node when one node's launcher exits non-zero (``--kill-on-bad-exit``). The line
    names, in this order: a node whose launcher died by a signal (the first srun reports: the node was
    lost), else the first rank with an ERROR line (this attempt's part of its log), else the first
    node launcher's ERROR line (which names its failed rank and exit code)."""
    nodes, per_node = run.nodes, run.shards
    rank_logs, node_logs, hosts = run.rank_logs, run.node_logs, run.hosts
    rank_starts, node_starts = _log_sizes(rank_logs), _log_sizes(node_logs)
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
           f"--cpus-per-task={per_node * run.threads}", sys.executable, "-m", MODULE, "node", spec_path]
    log(f"{nodes} nodes x {per_node} rank(s): {' '.join(hosts)}; rendezvous at {run.master}")
    # the job's own SLURM variables would narrow the step to this one task; srun dies with the job (SIGTERM:
    # it then stops every node's launcher)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_")) or k in ("SLURM_JOB_ID", "SLURM_CONF")}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_die_with_parent(signal.SIGTERM))
    for line in proc.stderr.splitlines():
        log(line)
    if proc.returncode == 0:
        return
    reports = [m.groups() for m in map(_SRUN_ERROR.match, proc.stderr.splitlines()) if m]
    if reports and not reports[0][2].startswith("Exited"):
        host, task, how = reports[0]
        raise UserError(
            f"train node {task} of {nodes} ({host}) was lost: its launcher ended ({how}); the ranks of every node "
            f"were stopped, and a rerun resumes from the run's last checkpoint  [log: {node_logs[int(task)]}]"
        )
    failed = _first_error(rank_logs, rank_starts)
    if failed:
        r, line = failed
        raise UserError(
            f"train rank {r} of {len(rank_logs)} (node {r // per_node}, {hosts[r // per_node]}) failed, the ranks "
            f"of every node were stopped: {line}  [log: {rank_logs[r]}]"
        )
    failed = _first_error(node_logs, node_starts)
    if failed:
        k, line = failed
        raise UserError(f"train node {k} of {nodes} ({hosts[k]}) failed: {line.removeprefix('ERROR: ')}")
    first = " ".join(reports[0]) if reports else f"srun exit code {proc.returncode}"
    raise UserError(f"train: srun of the {nodes} node launchers failed ({first}): {proc.stderr.strip()[-200:]}")


def _first_error(logs: list[str], starts: dict[int, int]) -> tuple[int, str] | None:
    """The first of ``logs`` with an ERROR line in this attempt's part, and the line."""
    for i, path in enumerate(logs):
        line = _error_line(path, starts[i])
        if line.startswith("ERROR:"):
            return i, line
    return None


def _die_with_parent(sig: int):
    """A pre-exec function: the child gets ``sig`` when this process dies (resolved before any fork)."""
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, sig)  # PR_SET_PDEATHSIG


def run_training(run: TrainRun, gpu_config: dict, log=print) -> dict:
    """One training run of ``run.nodes x run.shards`` ranks: launch them, then mark the run complete.

    ``run`` is sent to the ranks as ONE JSON file under ``run.run_dir`` (which every node reads);
    ``gpu_config``: the config's ``gpu`` section plus ``results`` (for the leases).
    """
    from dflashpipe.jobs.tracking import check_available

    from dflashpipe.training.checkpoint import mark_complete, republish

    check_available(run.cfg.tensorboard, run.cfg.wandb)  # a tracker asked for but not installed: one line before any lease
    run = run.identified()  # once: every rank keys the same run
    ckpt = run.ckpt_dir
    finished = republish(ckpt, run.identity, run.metrics_csv, run.summary_json, run.final_state, log)
    if finished is not None:  # a finished run of this identity (a comment edit, an x-compile key): trains no step
        return finished
    hosts, master = allocation(run.nodes) if run.nodes > 1 else ([], None)
    # one launch: a killed launch's files are never reused
    run = replace(run, hosts=tuple(hosts), master=master, run_id=uuid.uuid4().hex[:12])
    spec_path = Path(run.run_dir) / "launch" / f"{run.run_id}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(run.to_json())
    log(f"run {ckpt.name}: {run.nodes} node(s) x {run.shards} rank(s) x {run.threads} thread(s); checkpoints in {ckpt}")
    try:
        with _leased_slots(gpu_config, run.shards, log) as visible:
            if run.nodes > 1:
                run_nodes(str(spec_path), run, log)
            else:
                console = console_fd()  # rank 0 shows its progress bar on the job's console
                launch([sys.executable, "-m", MODULE, "rank", str(spec_path)], list(run.rank_logs), log,
                       meet=Rendezvous.of(run), visible_devices=",".join(visible) if all(visible) else None,
                       console=f"/proc/{os.getpid()}/fd/{console}" if console is not None else None)
    finally:
        spec_path.unlink(missing_ok=True)
    summary = json.loads(Path(run.summary_json).read_text())
    mark_complete(ckpt, run.summary_json, run.final_state)
    return summary


@contextlib.contextmanager
def _leased_slots(gpu_config: dict, shards: int, log):
    """Slots 0..shards-1 of this machine, every one leased before any rank starts (another GPU job may
    hold one for a while; under SLURM the allocation is the lease); yields their CUDA_VISIBLE_DEVICES."""
    from dflashpipe.jobs.lease import lease_for_job

    leases = []
    try:
        for r in range(shards):
            leases.append(lease_for_job(gpu_config, slot=r, gpus=shards, set_env=False))
        visible = [lease.visible_devices for lease in leases]
        log(f"leased slots 0..{shards - 1}: {[v or lease.device for v, lease in zip(visible, leases)]}")
        yield visible
    finally:
        for lease in leases:
            lease.release()


def node_main(spec_path: str) -> None:
    """One node's launcher (started by srun on every node of the allocation): this node's ranks."""
    from dflashpipe.jobs.runtime import job

    from dflashpipe.training.run import TrainRun

    run = TrainRun.from_json(Path(spec_path).read_text())
    node = int(os.environ["SLURM_NODEID"])
    with job(run.node_logs[node], threads=1, name=f"train node {node}/{run.nodes}") as log:
        log(f"node {node} ({os.uname().nodename}): launcher pid {os.getpid()}")
        launch([sys.executable, "-m", MODULE, "rank", spec_path], list(run.rank_logs), log,
               meet=Rendezvous.of(run, node))


def peer_left(err: BaseException) -> bool:
    """Whether ``err`` is a collective broken by a peer that left the run (gloo's words)."""
    return any(words in str(err) for words in PEER_LEFT)


def _first_line(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's source file and line
    return first if len(first) <= 160 else first[:160].rsplit(" ", 1)[0] + " ..."


def rank_main(spec_path: str) -> None:
    """One rank process (started by a node's elastic agent): its GPU, its slot's warm cache, train."""
    die_with_launcher()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    with open(spec_path) as f:  # before the imports: the log is this rank's from here on
        rank_logs = json.load(f)["rank_logs"]
    _output_to(rank_logs[rank])  # everything from here on, crashes of the imports below included

    from dflashpipe.jobs.compile_cache import use_slot_cache
    from dflashpipe.jobs.hotstart import hot_start
    from dflashpipe.jobs.lease import allocation_device
    from dflashpipe.jobs.runtime import job

    from dflashpipe.training.run import TrainRun
    from dflashpipe.training.train import train_rank

    run = TrainRun.from_json(Path(spec_path).read_text())
    if int(os.environ["WORLD_SIZE"]) != run.world_size:
        raise UserError(f"train rank {rank}: WORLD_SIZE {os.environ['WORLD_SIZE']} is not the run's {run.world_size}")
    if rank != 0:
        os.environ.pop(CONSOLE_ENV, None)  # only rank 0 shows its progress on the job's console
    try:
        with job(run.rank_logs[rank], threads=run.threads, name=f"train rank {rank}/{run.world_size}",
                 outputs=(run.summary_json,)) as log:
            device = allocation_device(local)  # the local rank's GPU of those the node's launcher was given
            log(f"rank {rank} = node {rank // run.shards} on {os.uname().nodename}, slot {local}: device "
                f"{device.device} (CUDA_VISIBLE_DEVICES={device.visible_devices})")
            use_slot_cache(run.cache_root, local)
            train_rank(run, rank, device.device, log=log, hot_start=hot_start(run.stamps[local], device.device))
    except RuntimeError as err:
        if not peer_left(err):
            raise
        # a consequence, not a cause: the rank that left says why in its log (its ERROR line, or its signal),
        # and the launcher names it; here one line, not a traceback beside it
        print(f"train rank {rank}/{run.world_size}: {STOPPED} ({_first_line(err)})", flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    {"node": node_main, "rank": rank_main}[sys.argv[1]](sys.argv[2])
