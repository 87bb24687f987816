"""GPU slot leases, with real processes and real flock (nothing about locking is mocked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from dflashpipe.jobs import compile_cache
from dflashpipe.jobs import lease as L
from dflashpipe.jobs.errors import UserError

PY = sys.executable


def _env(**extra):
    env = dict(os.environ)
    env["DFLASH_DEVICE"] = "cpu"
    for k in ("DFLASH_SLOT", "DFLASH_LEASE_FD"):
        env.pop(k, None)
    env.update(extra)
    return env


def _spawn_holder(lock_dir: Path, n_slots: int, slot: int | None = None, hold_s: float = 60.0, via_cli: bool = False):
    """Start a process that leases a slot, prints 'ready <slot>' and sleeps; return (proc, slot)."""
    if via_cli:
        cmd = [PY, "-m", "dflashpipe.jobs.lease", "--lock-dir", str(lock_dir), "--slots", str(n_slots)]
        if slot is not None:
            cmd += ["--slot", str(slot)]
        code = f"import os, time; print('ready', os.environ['DFLASH_SLOT'], flush=True); time.sleep({hold_s})"
        cmd += ["--", PY, "-c", code]
    else:
        code = textwrap.dedent(f"""
            import time
            from dflashpipe.jobs.lease import acquire_slot
            l = acquire_slot({str(lock_dir)!r}, {n_slots}, slot={slot!r}, timeout_s=10)
            print('ready', l.slot, flush=True)
            time.sleep({hold_s})
        """)
        cmd = [PY, "-c", code]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env())
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", f"holder did not start: {line!r}"
    return proc, int(line[1])


def _kill(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_free_slots_taken_in_order_and_held_slot_skipped(tmp_path):
    holder, held = _spawn_holder(tmp_path, 3, slot=0)
    try:
        assert held == 0
        a = L.acquire_slot(tmp_path, 3, timeout_s=2)
        b = L.acquire_slot(tmp_path, 3, timeout_s=2)
        assert (a.slot, b.slot) == (1, 2)  # slot 0 is held by the other process: skipped
        with pytest.raises(UserError):
            L.acquire_slot(tmp_path, 3, timeout_s=0.2, poll_s=0.05)
        a.release()
        a.release()  # idempotent
        c = L.acquire_slot(tmp_path, 3, timeout_s=2)
        assert c.slot == 1
        info = json.loads((tmp_path / "slot1.lock").read_text())
        assert info["pid"] == os.getpid() and info["slot"] == 1
        b.release()
        c.release()
    finally:
        _kill(holder)


def test_processes_never_share_a_slot(tmp_path):
    code = textwrap.dedent("""
        import json, sys, time
        from dflashpipe.jobs.lease import acquire_slot
        with acquire_slot(sys.argv[1], 2, timeout_s=30, poll_s=0.01) as l:
            t0 = time.time(); time.sleep(0.15); t1 = time.time()
        print(json.dumps([l.slot, t0, t1]))
    """)
    procs = [subprocess.Popen([PY, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=_env())
             for _ in range(5)]
    rows = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    _assert_no_overlap(rows)
    assert {r[0] for r in rows} <= {0, 1}


def _assert_no_overlap(rows):
    by_slot: dict[int, list] = {}
    for slot, t0, t1 in rows:
        by_slot.setdefault(slot, []).append((t0, t1))
    for slot, ivs in by_slot.items():
        ivs.sort()
        for (s0, e0), (s1, e1) in zip(ivs, ivs[1:]):
            assert e0 <= s1, f"slot {slot}: intervals overlap: {(s0, e0)} and {(s1, e1)}"
    return by_slot


@pytest.mark.parametrize("via_cli", [False, True])
def test_sigkilled_holder_frees_its_slot(tmp_path, via_cli):
    holder, slot = _spawn_holder(tmp_path, 1, slot=0, via_cli=via_cli)
    with pytest.raises(UserError):
        L.acquire_slot(tmp_path, 1, timeout_s=0.1, poll_s=0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    t0 = time.monotonic()
    lease = L.acquire_slot(tmp_path, 1, slot=0, timeout_s=2, poll_s=0.01)
    assert time.monotonic() - t0 < 0.5
    assert lease.slot == 0
    lease.release()


def test_timeout_is_one_line_user_error_naming_holders(tmp_path):
    h0, _ = _spawn_holder(tmp_path, 2, slot=0)
    h1, _ = _spawn_holder(tmp_path, 2, slot=1)
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError) as exc:
            L.acquire_slot(tmp_path, 2, timeout_s=0.3, poll_s=0.05)
        assert time.monotonic() - t0 < 2
        msg = str(exc.value)
        assert "\n" not in msg
        assert str(tmp_path) in msg
        assert f"pid {h0.pid}" in msg and f"pid {h1.pid}" in msg
        assert "--resources gpu" in msg
        # waiting for one specific slot names that slot's holder
        with pytest.raises(UserError, match=rf"slot1: pid {h1.pid}"):
            L.acquire_slot(tmp_path, 2, slot=1, timeout_s=0.1, poll_s=0.05)
        assert L.slot_holders(tmp_path, 2)[0].startswith(f"pid {h0.pid}@")
    finally:
        _kill(h0)
        _kill(h1)
    assert L.slot_holders(tmp_path, 2) == {0: None, 1: None}


def test_cli_timeout_exits_1_with_one_line(tmp_path):
    h, _ = _spawn_holder(tmp_path, 1, slot=0)
    try:
        r = subprocess.run([PY, "-m", "dflashpipe.jobs.lease", "--lock-dir", str(tmp_path), "--slots", "1",
                            "--timeout", "0.2", "--", "true"], capture_output=True, text=True, env=_env(), timeout=30)
        assert r.returncode == 1
        assert r.stderr.startswith("ERROR: ") and r.stderr.count("\n") == 1
        assert f"pid {h.pid}" in r.stderr
    finally:
        _kill(h)


def test_visible_devices_mapping():
    assert L.visible_devices_for_slot(1, 3, "3,5,7") == "5"
    assert L.visible_devices_for_slot(0, 3, "3,5,7") == "3"
    assert L.visible_devices_for_slot(1, 2, "GPU-aaa,GPU-bbb") == "GPU-bbb"
    with pytest.raises(UserError, match="lists 2 device"):
        L.visible_devices_for_slot(0, 3, "3,5")
    with pytest.raises(UserError):
        L.visible_devices_for_slot(3, 3, "3,5,7")
    # a repeated GPU is no GPU to CUDA; mapped anyway, three slots would share one card
    with pytest.raises(UserError, match="names GPU '0' more than once"):
        L.visible_devices_for_slot(1, 3, "0,0,0")
    with pytest.raises(UserError, match="names GPU '5' more than once"):
        L.visible_devices_for_slot(0, 2, "5,7,5")


def test_lease_device_gpu_mode_narrows_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.delenv("DFLASH_SLOT", raising=False)
    monkeypatch.delenv("DFLASH_LEASE_FD", raising=False)
    with L.lease_device(tmp_path, 3, slot=1, timeout_s=1) as dev:
        assert (dev.slot, dev.device, dev.visible_devices) == (1, "cuda:0", "5")
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
        assert os.environ["DFLASH_SLOT"] == "1"
    assert not dev.held
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(UserError, match="lists 2 device"):
        L.lease_device(tmp_path, 3, slot=0, timeout_s=1)
    L.acquire_slot(tmp_path, 3, slot=0, timeout_s=0.5).release()  # the failed lease was released


def test_under_a_scheduler_the_allocation_is_the_lease(tmp_path, monkeypatch):
    """Inside a SLURM job that got exactly its GPUs no lock is taken: a one-GPU job uses its GPU
    whatever its slot (warm job i), a K-GPU job gives slot k the allocation's k-th GPU (training
    rank k), and a rank started with that GPU keeps it. An allocation holding more GPUs than the
    job asked for is shared (Snakemake run locally inside salloc): the flock leases divide it."""
    monkeypatch.setenv("DFLASH_DEVICE", "cuda")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.delenv("DFLASH_SLOT", raising=False)
    monkeypatch.delenv("DFLASH_LEASE_FD", raising=False)
    cfg = {"results": str(tmp_path), "gpu": {"slots": 3, "lock_dir": None, "lease_timeout_s": 1}}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6")
    dev = L.lease_for_job(cfg, slot=2)
    assert (dev.device, dev.visible_devices, dev.held) == ("cuda:0", "6", True)
    assert not (tmp_path / "locks").exists()  # no lock files: the scheduler keeps jobs apart
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    leases = [L.lease_for_job(cfg, slot=k, gpus=2, set_env=False) for k in range(2)]
    assert [x.visible_devices for x in leases] == ["4", "6"]
    env = leases[1].child_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and "DFLASH_LEASE_FD" not in env
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])  # in the rank process
    assert L.lease_for_job(cfg, slot=1).visible_devices == "6"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with pytest.raises(UserError, match=r"GPU slot 2: the scheduler allocated 2 GPU\(s\) to this job"):
        L.lease_for_job(cfg, slot=2, gpus=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")  # a shared allocation: one-GPU jobs lock slots
    with L.lease_for_job(cfg, slot=1) as dev:
        assert dev.visible_devices == "5" and (tmp_path / "locks/slot1.lock").exists()
    monkeypatch.setenv("DFLASH_SCHEDULER", "slurm")  # the detection overridden
    assert L.lease_for_job(cfg, slot=1).visible_devices == "5" and L.scheduler_owns_gpus()


def test_lease_device_refuses_after_cuda_init(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_DEVICE", "cuda")
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.raises(RuntimeError, match="already initialised"):
        L.lease_device(tmp_path, 1)


def test_lease_device_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")
    monkeypatch.delenv("DFLASH_SLOT", raising=False)
    monkeypatch.delenv("DFLASH_LEASE_FD", raising=False)
    dev = L.lease_device(tmp_path, 2)
    assert (dev.slot, dev.device, dev.visible_devices) == (0, "cpu", None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "9"
    dev.release()


def test_on_a_cpu_machine_any_slot_jobs_share_the_cpu_and_slot_jobs_still_lock(tmp_path, monkeypatch):
    """Two 1-thread evaluations on a 2-core machine must run together (Snakemake's --cores shares the
    CPU): a job asking for any slot takes no lock there; a job of a given slot (warm chain, training
    ranks) still holds its slot's lock."""
    monkeypatch.setenv("DFLASH_DEVICE", "cpu")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("DFLASH_SLOT", raising=False)
    monkeypatch.delenv("DFLASH_LEASE_FD", raising=False)
    cfg = {"results": str(tmp_path), "gpu": {"slots": 1, "lock_dir": None, "lease_timeout_s": 0.5}}
    first, second = L.lease_for_job(cfg), L.lease_for_job(cfg)  # no wait, no lock file
    assert (first.device, second.device) == ("cpu", "cpu") and not (tmp_path / "locks").exists()
    with L.lease_for_job(cfg, slot=0):
        assert (tmp_path / "locks/slot0.lock").exists()
        with pytest.raises(UserError, match="slot"):  # slot 0 is held: a second holder waits, then times out
            L.lease_for_job(cfg, slot=0)


def test_cli_exec_keeps_lease_and_child_adopts_it(tmp_path):
    code = textwrap.dedent(f"""
        import json, os
        from dflashpipe.jobs.lease import lease_device, slot_holders
        d = lease_device({str(tmp_path)!r}, 2, timeout_s=0.5)
        print(json.dumps([os.getpid(), d.slot, d.lease.adopted, os.environ['DFLASH_SLOT'],
                          slot_holders({str(tmp_path)!r}, 2)[0]]))
    """)
    r = subprocess.run([PY, "-m", "dflashpipe.jobs.lease", "--lock-dir", str(tmp_path), "--slots", "2", "--", PY, "-c", code],
                       capture_output=True, text=True, env=_env(), timeout=30)
    assert r.returncode == 0, r.stderr
    pid, slot, adopted, env_slot, holder0 = json.loads(r.stdout)
    assert (slot, adopted, env_slot) == (0, True, "0")
    assert holder0.startswith(f"pid {pid}@")  # exec kept the pid, and the lock with it


SNAKEFILE = """
rule all:
    input: expand("out/{i}.json", i=range(20))

rule job:
    output: "out/{i}.json"
    resources: gpu=1
    shell: '"{config[py]}" -m dflashpipe.jobs.lease --lock-dir locks --slots 3 --timeout 60 --poll 0.02 -- "{config[py]}" record.py {output}'
"""

RECORD = """
import json, os, sys, time
t0 = time.time()
holder = json.loads(open(f"locks/slot{os.environ['DFLASH_SLOT']}.lock").read())
time.sleep(0.2)
t1 = time.time()
with open(sys.argv[1], "w") as f:
    json.dump({"slot": int(os.environ["DFLASH_SLOT"]), "start": t0, "end": t1,
               "pid": os.getpid(), "holder_pid": holder["pid"]}, f)
"""


def test_snakemake_stress_no_two_jobs_share_a_slot(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "record.py").write_text(RECORD)
    r = subprocess.run(
        [PY, "-m", "snakemake", "--cores", "6", "--resources", "gpu=3", "--config", f"py={PY}", "--quiet", "all"],
        cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("*.json"))]
    assert len(rows) == 20
    assert all(row["pid"] == row["holder_pid"] for row in rows)
    by_slot = _assert_no_overlap([(row["slot"], row["start"], row["end"]) for row in rows])
    assert set(by_slot) <= {0, 1, 2}
    assert len(by_slot) > 1, f"only slot(s) {sorted(by_slot)} were used"


def test_a_gpu_job_compiles_into_its_leased_slots_cache_and_a_cpu_job_keeps_the_default(tmp_path, monkeypatch):
    """Expansion and evaluation on a GPU slot use that slot's compile cache (the warm chain's folders),
    so a later job with the same shapes loads what an earlier one compiled; on the CPU nothing changes."""
    for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(key, raising=False)
    config = {"results": str(tmp_path / "results")}
    on_cpu = types.SimpleNamespace(slot=None, device="cpu")
    assert compile_cache.use_leased_slot_cache(config, on_cpu, log=None) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    on_gpu = types.SimpleNamespace(slot=2, device="cuda:0")  # the job's one visible GPU is slot 2's
    said = []
    env = compile_cache.use_leased_slot_cache(config, on_gpu, said.append)
    assert said and "slot 2's" in said[0]
    root = (tmp_path / "results" / compile_cache.COMPILE_CACHE / "slot2").resolve()
    assert env == compile_cache.slot_cache_dirs(tmp_path / "results" / compile_cache.COMPILE_CACHE, 2)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor") and (root / "inductor").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(root / "triton") and (root / "triton").is_dir()
