"""The training job on a real SLURM cluster of two nodes, through Snakemake's executor plugin.

``tests/slurm_cluster.py`` starts slurmctld and two slurmd, each node in its own network namespace
with its own hostname and address, two fake GPUs each (scripts/test.sh installs slurm-wlm and munge
as root). Each test starts from a copy of the mini run (conftest) whose earlier stages are done
locally, so ONE job goes through sbatch: the training job. On one node its two gloo ranks run side by
side; on two nodes the job starts one launcher per node with srun, one rank each, meeting at the
first node's address. Where the cluster cannot start (not root, SLURM not installed, a configured
SLURM on the machine) the tests skip with the reason; scripts/test.sh, as root (CI), makes that a
failure (DFLASH_REQUIRE_SLURM=1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import slurm_cluster
from conftest import mini_config, snakemake, snakemake_cmd, snakemake_env, write_config

# rank 1 parks at the start of step 4 (checkpoint_every is 2): step 3's collectives came after rank 0 wrote
# step 2's checkpoint, so the rerun resumes from step 2 (parked at step 3, rank 0 could still be writing it)
FAULT_STEP, RESUME_STEP = 4, 2


def _skip(reason: str):
    """Skip with the reason printed; DFLASH_REQUIRE_SLURM=1 makes it a failure."""
    print(f"SKIP test_slurm: {reason}")
    if os.environ.get("DFLASH_REQUIRE_SLURM") == "1":
        pytest.fail(f"SLURM test required (DFLASH_REQUIRE_SLURM=1) but: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        with slurm_cluster.cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as env:
            yield env
    except slurm_cluster.Unavailable as err:
        _skip(str(err))


def slurm_env(cluster_env: dict, **extra: str) -> dict:
    # the ranks' gloo sockets on the namespaces' addresses (their hostnames resolve nowhere)
    return snakemake_env(SLURM_CONF=cluster_env["SLURM_CONF"], GLOO_SOCKET_IFNAME="eth0", **extra)


# The executor plugin backs off by 10 s a check while a job runs (2, 12, 22, 32 s... between its squeue
# checks): a job of 14 s was seen to end after 36 s. The tests' Snakemake asks squeue every second.
SQUEUE_EVERY_SECOND = (
    "from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor; "
    "RemoteExecutor.next_seconds_between_status_checks = property(lambda self: 1, lambda self, value: None); "
    "from snakemake.cli import main; main()")


def slurm_snakemake_cmd(work: Path, *args: str) -> list[str]:
    """``snakemake_cmd`` with the executor's status checks a second apart."""
    python, m, module, *rest = snakemake_cmd(work, *args)
    assert (m, module) == ("-m", "snakemake")
    return [python, "-c", SQUEUE_EVERY_SECOND, *rest]


def through_slurm(work: Path, cfg: Path, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    """The training job's outputs through sbatch (everything before it is done)."""
    cmd = slurm_snakemake_cmd(work, "results/train/final.safetensors", "--executor", "slurm", "--jobs", "1",
                              "--latency-wait", "10", "--slurm-status-command", "squeue",
                              "--slurm-init-seconds-before-status-checks", "2", "--slurm-keep-successful-logs",
                              "--default-resources", "mem_mb=400", "runtime=30", "--configfile", str(cfg))
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def job_logs(work: Path) -> list[Path]:
    return sorted((work / ".snakemake/slurm_logs").rglob("*.log"))


def explain(res: subprocess.CompletedProcess, work: Path) -> str:
    return res.stderr[-3000:] + "".join(f"\n{p}: {p.read_text(errors='replace')[-1500:]}" for p in job_logs(work))


def fresh_run(mini_copy, cfg_changes: dict | None = None) -> tuple[Path, Path]:
    """A copy of the mini run without its training run; ``cfg_changes`` (per section) applied, and every
    stage before training done locally."""
    work, _ = mini_copy
    cfg = mini_config()
    for section, values in (cfg_changes or {}).items():
        cfg[section].update(values)
    path = write_config(work / "slurm.yaml", cfg)
    shutil.rmtree(work / "results/train")
    if cfg_changes:  # else the mini run's own config: everything before its training is done already
        stamps = [f"results/warm/slot{i}.json" for i in range(cfg["gpu"]["slots"])]
        res = snakemake(work, *stamps, "--cores", "2", "--configfile", str(path))
        assert res.returncode == 0, res.stderr[-3000:]
    return work, path


def max_diff(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def rank_log(work: Path, k: int) -> str:
    return (work / f"results/logs/train/rank{k}.log").read_text()


def rank_host(work: Path, k: int) -> str:
    """The host rank k ran on (its log's ``rank k = node n on HOST, slot s`` line)."""
    return re.search(rf"rank {k} = node \d+ on (\S+), slot", rank_log(work, k)).group(1)


TWO_NODES = {"gpu": {"slots": 1}, "train": {"shards": 1, "nodes": 2}}


def test_one_node_two_ranks_through_sbatch_equal_a_local_run(slurm, mini_run, mini_copy):
    """ONE sbatch job holds both fake GPUs of a node and runs the two gloo ranks together; its drafter is
    the local run's."""
    ref, _ = mini_run
    work, cfg = fresh_run(mini_copy)
    t0 = time.time()
    res = through_slurm(work, cfg, slurm_env(slurm))
    print(f"one node, 2 ranks through sbatch: {time.time() - t0:.0f} s")
    assert res.returncode == 0, explain(res, work)
    assert [p.parent.name for p in job_logs(work)] == ["rule_train"]  # one job through sbatch
    s = json.loads((work / "results/train/summary.json").read_text())
    assert s["world_size"] == 2 and max(x["started_at"] for x in s["ranks"]) < min(x["finished_at"] for x in s["ranks"])
    hosts = {rank_host(work, k) for k in range(2)}
    assert len(hosts) == 1 and hosts <= {"n1", "n2"}, hosts  # both ranks on one node of the cluster
    assert max_diff(work / "results/train/final.safetensors", ref / "results/train/final.safetensors") <= 1e-6
    assert subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True).stdout.strip() == ""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_two_nodes_one_rank_each_a_killed_node_fails_in_one_line_and_the_rerun_trains_the_one_node_drafter(
        slurm, mini_run, mini_copy, tmp_path):
    """train.nodes: 2, one rank per node: ONE sbatch job of two nodes; srun starts a launcher on each, whose
    torch elastic agents meet at n1's address; rank 0 on n1, rank 1 on n2. Node n2's launcher is SIGKILLed
    while its rank waits at step 4: its rank dies with it, srun stops n1's, the job fails with ONE line naming
    the node; the same command then resumes from step 2 (one more sbatch job of two nodes, placed the same)
    and trains the drafter of the local one-node run of 2 ranks (same global batches; only the all-reduce's
    summation order can differ). One test: the rerun is the two-node run the cluster pays for once."""
    ref, _ = mini_run
    work, cfg = fresh_run(mini_copy, TWO_NODES)
    marker = tmp_path / "parked"
    faults = {"DFLASH_FAULTS": json.dumps([{"at": "train.step", "step": FAULT_STEP, "rank": 1, "do": "park"}]),
              "DFLASH_FAULT_MARKER": str(marker)}
    t0 = time.time()
    cmd = slurm_snakemake_cmd(work, "results/train/final.safetensors", "--executor", "slurm", "--jobs", "1",
                              "--latency-wait", "10", "--slurm-status-command", "squeue",
                              "--slurm-init-seconds-before-status-checks", "2", "--default-resources", "mem_mb=400",
                              "runtime=30", "--configfile", str(cfg))
    proc = subprocess.Popen(cmd, cwd=work, env=slurm_env(slurm, **faults), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, explain(subprocess.CompletedProcess(
            cmd, proc.returncode, *proc.communicate()), work)
        time.sleep(0.5)
    rank1 = json.loads(marker.read_text())["pid"]
    launcher = _parent(rank1)
    assert "dflashpipe.training.launch node" in Path(f"/proc/{launcher}/cmdline").read_text().replace("\0", " ")
    os.kill(launcher, signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    print(f"two nodes, n2's launcher killed at step {FAULT_STEP}: the job failed after {time.time() - t0:.0f} s")
    assert proc.returncode != 0
    errors = [ln for ln in (work / "results/logs/train/train.log").read_text().splitlines() if ln.startswith("ERROR:")]
    print(errors)
    assert len(errors) == 1, errors
    assert errors[0].startswith("ERROR: train node 1 of 2 (n2) was lost: its launcher ended (Killed)"), errors[0]
    assert not any(Path("/proc", str(pid)).exists() for pid in (rank1, launcher))  # nothing left running
    assert not (work / "results/train/summary.json").exists()
    assert [rank_host(work, k) for k in range(2)] == ["n1", "n2"]  # the first job's placement (the rerun's: below)
    assert "2 nodes x 1 rank(s): n1 n2; rendezvous at 198.18.0.11:" in (work / "results/logs/train/train.log").read_text()

    t0 = time.time()
    res = through_slurm(work, cfg, slurm_env(slurm))
    print(f"rerun, two nodes x 1 rank through sbatch: {time.time() - t0:.0f} s")
    assert res.returncode == 0, explain(res, work)
    assert [p.parent.name for p in job_logs(work)] == ["rule_train", "rule_train"]  # the failed job's and the rerun's
    assert [rank_host(work, k) for k in range(2)] == ["n1", "n2"]
    train_log = (work / "results/logs/train/train.log").read_text()
    assert "2 nodes x 1 rank(s): n1 n2; rendezvous at 198.18.0.11:" in train_log
    assert f"resumed from step {RESUME_STEP}" in rank_log(work, 0) and f"resumed from step {RESUME_STEP}" in rank_log(work, 1)
    s = json.loads((work / "results/train/summary.json").read_text())
    assert (s["world_size"], s["rank_batch"], s["steps"]) == (2, 2, 6)
    diff = max_diff(work / "results/train/final.safetensors", ref / "results/train/final.safetensors")
    print(f"two nodes vs one node, K=2: max |weight difference| {diff:.2e}")
    assert diff <= 1e-5


def test_several_nodes_outside_an_allocation_is_one_line(monkeypatch):
    """train.nodes above 1 without SLURM: the training job stops before it leases or starts anything."""
    from dflashpipe.training.launch import allocation
    from dflashpipe.jobs.errors import UserError

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(UserError) as err:
        allocation(2)
    assert str(err.value).startswith("train.nodes is 2: the training job must run in a SLURM allocation of 2 nodes")
