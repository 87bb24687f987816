"""Start the K ranks of one training run together; they succeed or fail as one.

One Snakemake job is one training run. It asks for K GPUs (``resources: gpu=K``),
leases GPU slots 0..K-1 (waiting until every one is free, so no rank starts
before its peers can), and starts K rank processes (``python -m
dflashpipe.drafter.launch RANK SPEC``), each taking over its slot's lease,
seeing its GPU as ``cuda:0`` and starting hot from slot k's warm cache. The
launcher watches them: when one fails, the others are stopped at once (no rank
waits for a dead peer until a timeout), and the job fails with the failing
rank's error line. Rank processes die with the launcher (``PR_SET_PDEATHSIG``),
so a killed job leaves nothing running.

Why one job and not one per rank: Snakemake schedules jobs one by one, so with
a job per rank a rerun could start a lone rank whose peers' outputs were
already complete (after one rank failed, or when one output is asked for),
and it would wait for peers that never come. With one job the K ranks are
always scheduled, run, retried and invalidated together; on a cluster the job
is one allocation of K GPUs (co-scheduled by construction).

A run that finished is marked complete in its checkpoint directory only after
every rank exited cleanly and the outputs exist; a job that finds its run
finished writes the outputs again and starts no rank (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from dflashpipe.checkout import ENV as CODE_ENV
from dflashpipe.checkout import planned_code
from dflashpipe.errors import UserError
from dflashpipe.runtime import CONSOLE_ENV, console_fd


def _die_with_parent_fn():
    """A pre-exec function that makes the child die with this process (resolved before any fork)."""
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    parent = os.getpid()

    def die_with_parent() -> None:  # in the child, between fork and exec: no imports, no allocation
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return die_with_parent


def _error_line(log_path: str, start: int = 0) -> str:
    """The rank's ERROR line, else the last line of its log (the cause of a crash).

    Only the log from byte ``start`` on counts: rank logs are appended to, and an earlier attempt's
    ERROR line is not this attempt's cause."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return "no log"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors[-1] if errors else (lines[-1] if lines else "empty log"))[:300]


def _culprit(failed: list[int], codes: list, rank_logs: list[str], starts: list[int]) -> int:
    """The rank that most likely caused the failure: one with an ERROR line, else one killed by a
    signal, else the first. (A peer of a dead rank fails too, with a mere connection error.)"""
    for r in failed:
        if _error_line(rank_logs[r], starts[r]).startswith("ERROR:"):
            return r
    return next((r for r in failed if codes[r] < 0), failed[0])


def launch(commands: list[list[str]], rank_logs: list[str], log=print, envs: list[dict] | None = None,
           pass_fds: list[tuple] | None = None, poll_s: float = 0.2, grace_s: float = 10.0) -> None:
    """Run one process per rank; return when all exit 0, else stop the rest and raise one line.

    Rank r's output goes to ``rank_logs[r]`` from its first line (import errors included);
    ``envs[r]`` is added to its environment and ``pass_fds[r]`` stay open in it.
    """
    procs, logs, starts = [], [], []  # starts: where this attempt's part of each (appended) log begins
    # the ranks run the library of the checkout that planned the job (pinned by the Snakefile), else this
    # process's own: first on their path, and checked by each rank (dflashpipe.checkout)
    package_root = str(planned_code() or Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, *rest]), **{CODE_ENV: package_root})
    die_with_parent = _die_with_parent_fn()
    old_term = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run the cleanup below
    try:
        for r, cmd in enumerate(commands):
            Path(rank_logs[r]).parent.mkdir(parents=True, exist_ok=True)
            logs.append(open(rank_logs[r], "ab"))
            starts.append(logs[-1].tell())
            procs.append(subprocess.Popen(cmd, env={**env, **(envs[r] if envs else {})}, stdout=logs[-1],
                                          stderr=subprocess.STDOUT, pass_fds=pass_fds[r] if pass_fds else (),
                                          preexec_fn=die_with_parent))
        log(f"started {len(procs)} rank(s): pids {[p.pid for p in procs]}")
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                time.sleep(poll_s)  # let peers of a dead rank fail too, then name the cause
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                r = _culprit(failed, codes, rank_logs, starts)
                raise UserError(
                    f"train rank {r} of {len(procs)} failed (exit code {codes[r]}), the other ranks were stopped: "
                    f"{_error_line(rank_logs[r], starts[r])}  [log: {rank_logs[r]}]"
                )
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_s)
    finally:
        _stop(procs, grace_s)
        for f in logs:
            f.close()
        signal.signal(signal.SIGTERM, old_term)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.time() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_training(*, world_size: int, threads_per_rank: int, cfg, tokenized: str, target: str, run_dir: str,
                 cache_root: str, stamps: list[str], gpu_config: dict, rank_logs: list[str], metrics_csv: str,
                 summary_json: str, final_state: str, log=print) -> dict:
    """One training run of ``world_size`` ranks: launch them, then mark the run complete.

    ``cfg`` is the run's :class:`~dflashpipe.drafter.train.TrainConfig`, sent to the ranks as JSON;
    ``gpu_config`` the config's ``gpu`` section plus ``results`` (for the leases).
    """
    from dflashpipe.lease import lease_for_job
    from dflashpipe.tracking import check_available

    from .checkpoint import checkpoint_dir, mark_complete, republish, run_identity
    from .distributed import rendezvous_url

    check_available(cfg.tensorboard, cfg.wandb)  # a tracker asked for but not installed: one line before any lease
    identity = run_identity(cfg, tokenized, target)  # once: every rank keys the same run
    ckpt = checkpoint_dir(run_dir, identity)
    finished = republish(ckpt, identity, metrics_csv, summary_json, final_state, log)
    if finished is not None:  # a finished run of this identity (a comment edit, an x-compile key): trains no step
        return finished
    spec = {
        "world_size": world_size, "threads": threads_per_rank, "cfg": asdict(cfg), "tokenized": tokenized,
        "target": target, "identity": identity, "ckpt_dir": str(ckpt), "cache_root": cache_root, "stamps": stamps,
        "gpu_config": gpu_config, "rank_logs": rank_logs, "metrics_csv": metrics_csv, "summary_json": summary_json,
        "final_state": final_state,
        # a fresh rendezvous file per launch: a killed launch's file is never reused
        "init_method": rendezvous_url(os.path.join(run_dir, "rendezvous"), uuid.uuid4().hex[:12]),
    }
    log(f"run {ckpt.name}: {world_size} rank(s) x {threads_per_rank} thread(s); checkpoints in {ckpt}")
    arg = json.dumps(spec)
    # every slot is leased before any rank starts (another GPU job may hold one for a while); each
    # rank takes its slot's lease over, so the slots stay held however the ranks end
    leases = []
    try:
        for r in range(world_size):
            leases.append(lease_for_job(gpu_config, slot=r, gpus=world_size, set_env=False))
        log(f"leased slots 0..{world_size - 1}: {[lease.visible_devices or lease.device for lease in leases]}")
        console = console_fd()  # rank 0 shows its progress bar on the job's console
        show = {CONSOLE_ENV: str(console)} if console is not None else {}
        launch([[sys.executable, "-m", "dflashpipe.drafter.launch", str(r), arg] for r in range(world_size)], rank_logs,
               log, envs=[{**lease.child_env(), **(show if r == 0 else {})} for r, lease in enumerate(leases)],
               pass_fds=[(() if lease.lease.fd is None else (lease.lease.fd,)) + ((console,) if r == 0 and show else ())
                         for r, lease in enumerate(leases)])
    finally:
        for lease in leases:
            lease.release()
    summary = json.loads(Path(summary_json).read_text())
    mark_complete(ckpt, summary_json, final_state)
    return summary


def rank_main(rank: int, spec: dict) -> None:
    """One rank process: lease its GPU slot, point at the slot's warm cache, train."""
    from dflashpipe.hotstart import hot_start
    from dflashpipe.lease import lease_for_job, use_slot_cache
    from dflashpipe.runtime import job

    from .train import TrainConfig, train_rank

    K = spec["world_size"]
    with job(spec["rank_logs"][rank], threads=spec["threads"], name=f"train rank {rank}/{K}") as log:
        lease = lease_for_job(spec["gpu_config"], slot=rank)  # adopts the launcher's lease of slot ``rank``
        log(f"slot {rank}: device {lease.device} (CUDA_VISIBLE_DEVICES={lease.visible_devices})")
        use_slot_cache(spec["cache_root"], rank)
        train_rank(
            TrainConfig(**spec["cfg"]), spec["tokenized"], spec["target"], spec["ckpt_dir"], rank, K,
            spec["init_method"], lease.device, spec["metrics_csv"], spec["summary_json"],
            final_state=spec["final_state"], log=log, hot_start=hot_start(spec["stamps"][rank], lease.device),
            identity=spec["identity"],
        )


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), json.loads(sys.argv[2]))
