"""GPU slot leases: map Snakemake's GPU *count* onto physical GPU *ids*.

``snakemake --resources gpu=N`` only counts; it never says WHICH GPU a job may
use. Each GPU job therefore takes a lease on one of ``n_slots`` physical slots:
a non-blocking ``flock(LOCK_EX | LOCK_NB)`` on ``lock_dir/slot{i}.lock``. The
lock lives on the open file description, so it is held for the life of the
process (and across ``exec``) and the kernel frees it when the process dies,
even on SIGKILL: a crashed job never leaves a stale lease behind.

With the lease the job sets ``CUDA_VISIBLE_DEVICES`` to that slot's single GPU
BEFORE CUDA is initialised, so every worker sees its GPU as ``cuda:0`` (which is
also what makes per-slot compile caches valid: Inductor keys include the device
index). An already-narrowed ``CUDA_VISIBLE_DEVICES`` is respected: slot ``i``
is the ``i``-th entry of that list.

Without GPUs (none found, or ``DFLASH_DEVICE=cpu``) the same slots and locks
exist and the device is ``"cpu"``, so CI exercises the serial/parallel
structure for real.

In Python::

    with lease_device("results/locks", n_slots=3) as lease:
        model.to(lease.device)          # "cuda:0" or "cpu"

From a shell rule::

    python -m dflashpipe.jobs.lease --lock-dir results/locks --slots 3 -- python train.py

The CLI exports ``DFLASH_SLOT``, ``DFLASH_DEVICE`` (``cuda``/``cpu``),
``CUDA_VISIBLE_DEVICES`` (GPU mode) and ``DFLASH_LEASE_FD`` and then ``exec``s
the command, which inherits the lock (same pid). A Python program started that
way that calls :func:`lease_device` again adopts the inherited lease instead of
waiting for its own slot.

Caveats: do not call ``torch.cuda.is_available()`` (it runs ``cuInit``, which
freezes the visible device list) before leasing; :func:`lease_device` refuses
to run once ``torch.cuda.is_initialized()``. Processes forked by the holder
(e.g. DataLoader workers) share the lock until they exit too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from dflashpipe.jobs.errors import UserError

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_POLL_S = 0.2

ENV_SLOT = "DFLASH_SLOT"
ENV_DEVICE = "DFLASH_DEVICE"
ENV_LEASE_FD = "DFLASH_LEASE_FD"
ENV_CVD = "CUDA_VISIBLE_DEVICES"

__all__ = [
    "SlotLease",
    "DeviceLease",
    "acquire_slot",
    "lease_device",
    "visible_devices_for_slot",
    "detect_device_kind",
    "slot_holders",
    "main",
]


def _lock_path(lock_dir: Path, slot: int) -> Path:
    return lock_dir / f"slot{slot}.lock"


def _check_slots(n_slots: int, slot: int | None) -> None:
    if not isinstance(n_slots, int) or n_slots < 1:
        raise UserError(f"GPU slots: n_slots must be a positive integer, got {n_slots!r}")
    if slot is not None and not (0 <= slot < n_slots):
        raise UserError(f"GPU slots: slot {slot} is out of range for {n_slots} slot(s) (valid: 0..{n_slots - 1})")


class SlotLease:
    """An exclusive lease on one slot, held through an open, flock'ed fd.

    Release with :meth:`release` (idempotent) or by leaving the ``with`` block;
    otherwise it is held until the process exits.
    """

    def __init__(self, lock_dir: Path, slot: int, n_slots: int, fd: int, adopted: bool = False):
        self.lock_dir = Path(lock_dir)
        self.slot = slot
        self.n_slots = n_slots
        self.lock_path = _lock_path(self.lock_dir, slot)
        self._fd: int | None = fd
        self.adopted = adopted

    @property
    def fd(self) -> int | None:
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # still locked: nobody else is writing
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "SlotLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"SlotLease(slot={self.slot}, n_slots={self.n_slots}, lock_dir={str(self.lock_dir)!r}, {state})"


def _holder_info(extra: dict | None = None) -> bytes:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if extra:
        info.update(extra)
    return (json.dumps(info, sort_keys=True) + "\n").encode()


def _try_lock(path: Path) -> int | None:
    """Open and flock ``path`` without blocking; return the fd, or None if held."""
    # No O_TRUNC: the current holder's diagnostics must survive our failed attempt.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _write_holder(fd: int, slot: int, extra: dict | None = None) -> None:
    # We hold the lock, so truncating and rewriting cannot race another holder.
    data = _holder_info({"slot": slot, **(extra or {})})
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _proc_locks_pids(path: Path) -> list[int]:
    """PIDs that /proc/locks lists as holding a lock on ``path`` (Linux; best effort)."""
    try:
        st = os.stat(path)
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    pids = []
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        if len(parts) >= 6 and parts[1] == "FLOCK":
            try:
                pid = int(parts[4])
                maj_min, inode = parts[5].rsplit(":", 1)
                if int(inode) == st.st_ino:
                    pids.append(pid)
            except ValueError:
                continue
    return pids


def slot_holders(lock_dir: str | os.PathLike, n_slots: int) -> dict[int, str | None]:
    """For each slot, a short description of its current holder, or None if free.

    Probes each slot with a non-blocking lock (released at once).
    """
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    out: dict[int, str | None] = {}
    for i in range(n_slots):
        path = _lock_path(lock_dir, i)
        fd = _try_lock(path)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            out[i] = None
            continue
        desc = None
        try:
            info = json.loads(path.read_text().strip() or "{}")
            if "pid" in info:
                desc = f"pid {info['pid']}@{info.get('host', '?')} since {info.get('time', '?')}"
        except (OSError, ValueError):
            pass
        if desc is None:
            pids = _proc_locks_pids(path)
            desc = ("pid " + ",".join(map(str, pids))) if pids else "unknown holder"
        out[i] = desc
    return out


def _try_adopt(lock_dir: Path, n_slots: int, slot: int | None) -> SlotLease | None:
    """Adopt a lease this process inherited (``DFLASH_LEASE_FD``), if it matches ``lock_dir``."""
    raw = os.environ.get(ENV_LEASE_FD)
    raw_slot = os.environ.get(ENV_SLOT)
    if not raw or raw_slot is None:
        return None
    try:
        fd, held_slot = int(raw), int(raw_slot)
        fst = os.fstat(fd)
    except (ValueError, OSError):
        return None
    if not (0 <= held_slot < n_slots):
        return None
    try:
        pst = os.stat(_lock_path(lock_dir, held_slot))
    except OSError:
        return None
    if (fst.st_dev, fst.st_ino) != (pst.st_dev, pst.st_ino):
        return None
    if slot is not None and slot != held_slot:
        raise UserError(
            f"GPU slots: this process already holds slot {held_slot} in {lock_dir} "
            f"(inherited via {ENV_LEASE_FD}) but asked for slot {slot}"
        )
    try:  # succeeds if the inherited description holds the lock (or it was free)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None
    return SlotLease(lock_dir, held_slot, n_slots, fd, adopted=True)


def acquire_slot(
    lock_dir: str | os.PathLike,
    n_slots: int,
    slot: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
    info: dict | None = None,
) -> SlotLease:
    """Take an exclusive lease on a slot of ``lock_dir``.

    ``slot=None`` takes the first free slot (trying 0..n_slots-1 in order,
    polling until ``timeout_s``); ``slot=i`` waits for exactly slot ``i``.
    ``timeout_s=None`` waits forever. On timeout raises :class:`UserError`
    naming the lock dir and the holders. ``info`` is extra JSON written into the
    lock file for diagnostics (next to pid, host and time).
    """
    _check_slots(n_slots, slot)
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    adopted = _try_adopt(lock_dir, n_slots, slot)
    if adopted is not None:
        return adopted
    candidates = list(range(n_slots)) if slot is None else [slot]
    start = time.monotonic()
    while True:
        for i in candidates:
            fd = _try_lock(_lock_path(lock_dir, i))
            if fd is not None:
                try:
                    _write_holder(fd, i, info)
                except OSError:
                    pass  # diagnostics only
                return SlotLease(lock_dir, i, n_slots, fd)
        waited = time.monotonic() - start
        if timeout_s is not None and waited >= timeout_s:
            holders = slot_holders(lock_dir, n_slots)
            held = "; ".join(f"slot{i}: {holders.get(i) or 'free now'}" for i in candidates)
            what = f"any of {n_slots} GPU slot(s)" if slot is None else f"GPU slot {slot}"
            raise UserError(
                f"could not lease {what} in {lock_dir} within {timeout_s:g} s ({held}); "
                f"more GPU jobs are running than slots: keep snakemake's --resources gpu=N "
                f"at most the number of slots ({n_slots}), or end the holders listed"
            )
        delay = poll_s
        if timeout_s is not None:
            delay = max(0.0, min(poll_s, timeout_s - waited))
        time.sleep(delay)


# --------------------------------------------------------------------------- devices


def _parse_cvd(value: str) -> list[str]:
    """Entries of a CUDA_VISIBLE_DEVICES value, cut (as CUDA does) at the first invalid one."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def visible_devices_for_slot(slot: int, n_slots: int, cuda_visible_devices: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value (one device) for ``slot``.

    ``cuda_visible_devices`` defaults to the current environment's value. If it
    is set, slot ``i`` maps to its ``i``-th entry (it must list at least
    ``n_slots`` devices, each once); if unset, slot ``i`` is physical GPU ``i``.
    """
    _check_slots(n_slots, slot)
    if cuda_visible_devices is None:
        cuda_visible_devices = os.environ.get(ENV_CVD)
    if cuda_visible_devices is None:
        return str(slot)
    entries = _parse_cvd(cuda_visible_devices)
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    if repeated:  # CUDA (and torch's parser) reads a repeated entry as no device: slots would also share one card
        raise UserError(
            f"{ENV_CVD}={cuda_visible_devices!r} names GPU {repeated[0]!r} more than once, which CUDA reads as no GPU "
            f"at all; list each GPU once (one GPU slot each)"
        )
    if len(entries) < n_slots:
        raise UserError(
            f"{ENV_CVD}={cuda_visible_devices!r} lists {len(entries)} device(s) but {n_slots} GPU slot(s) "
            f"were requested; lower the slot count (--resources gpu) or widen {ENV_CVD}"
        )
    return entries[slot]


def _nvml_device_count() -> int:
    """Physical GPU count from NVML via ctypes (no CUDA init, no torch); -1 if unknown."""
    import ctypes

    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return -1
    try:
        if lib.nvmlInit_v2() != 0:
            return -1
        count = ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        lib.nvmlShutdown()
        return int(count.value) if rc == 0 else -1
    except (AttributeError, OSError):
        return -1


def _physical_gpu_count() -> int:
    n = _nvml_device_count()
    if n >= 0:
        return n
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def detect_device_kind() -> str:
    """``"cuda"`` or ``"cpu"``, decided WITHOUT initialising CUDA.

    ``DFLASH_DEVICE=cpu|cuda`` overrides. Otherwise CPU if an explicitly empty
    ``CUDA_VISIBLE_DEVICES`` hides all GPUs, if an already-imported torch is a
    CPU build, or if no NVIDIA GPU is found.
    """
    override = os.environ.get(ENV_DEVICE, "").strip().lower()
    if override in ("cpu", "cuda"):
        return override
    if override and override != "auto":
        raise UserError(f"{ENV_DEVICE}={override!r} is not one of cpu, cuda, auto")
    torch = sys.modules.get("torch")
    if torch is not None and not torch.backends.cuda.is_built():
        return "cpu"
    cvd = os.environ.get(ENV_CVD)
    if cvd is not None and not _parse_cvd(cvd):
        return "cpu"
    return "cuda" if _physical_gpu_count() > 0 else "cpu"


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


class DeviceLease:
    """A slot lease plus the device it grants: ``.slot``, ``.device``, ``.visible_devices``."""

    def __init__(self, lease: SlotLease, device: str, visible_devices: str | None):
        self.lease = lease
        self.slot = lease.slot
        self.n_slots = lease.n_slots
        self.device = device
        self.visible_devices = visible_devices

    @property
    def held(self) -> bool:
        return self.lease.held

    def release(self) -> None:
        self.lease.release()

    def child_env(self) -> dict[str, str]:
        """Environment for a child process that takes this lease over.

        The child must inherit the lease's fd (``pass_fds``/exec); its own
        :func:`lease_device` for the same slot then adopts it instead of waiting.
        """
        env = {ENV_SLOT: str(self.slot), ENV_DEVICE: "cpu" if self.device == "cpu" else "cuda"}
        if self.lease.fd is not None:  # an allocation (cluster scheduler) has no lock to hand over
            env[ENV_LEASE_FD] = str(self.lease.fd)
        if self.visible_devices is not None:
            env[ENV_CVD] = self.visible_devices
        return env

    def __enter__(self) -> "DeviceLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"DeviceLease(slot={self.slot}, device={self.device!r}, visible_devices={self.visible_devices!r})"


def lease_device(
    lock_dir: str | os.PathLike,
    n_slots: int,
    slot: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
    set_env: bool = True,
    info: dict | None = None,
) -> DeviceLease:
    """Lease a slot and bind this process to its device (``"cuda:0"`` or ``"cpu"``).

    In GPU mode sets ``CUDA_VISIBLE_DEVICES`` to the slot's single device (when
    ``set_env``) and raises if CUDA is already initialised in this process.
    Always sets ``DFLASH_SLOT``. Usable as a context manager.
    """
    _check_slots(n_slots, slot)
    kind = detect_device_kind()
    if kind == "cuda" and _cuda_initialised():
        raise RuntimeError(
            "CUDA is already initialised in this process; lease the GPU slot before any torch.cuda call"
        )
    lease = acquire_slot(lock_dir, n_slots, slot=slot, timeout_s=timeout_s, poll_s=poll_s, info=info)
    try:
        visible: str | None = None
        if kind == "cuda":
            if lease.adopted:  # the parent (our CLI) already narrowed the device list
                visible = os.environ.get(ENV_CVD)
            else:
                visible = visible_devices_for_slot(lease.slot, n_slots)
                if os.environ.get(ENV_CVD) is None:
                    n_phys = _nvml_device_count()
                    if 0 <= n_phys < n_slots:
                        raise UserError(
                            f"{n_slots} GPU slot(s) requested but only {n_phys} GPU(s) found; "
                            f"lower --resources gpu / the slot count"
                        )
                if set_env:
                    os.environ[ENV_CVD] = visible
        if set_env:
            os.environ[ENV_SLOT] = str(lease.slot)
        return DeviceLease(lease, "cuda:0" if kind == "cuda" else "cpu", visible)
    except BaseException:
        lease.release()
        raise


class AllocationLease(SlotLease):
    """Under a cluster scheduler the job's allocation is the lease: nothing to lock or to release."""

    def __init__(self, slot: int, n_slots: int):
        super().__init__(Path("."), slot, n_slots, fd=None)  # type: ignore[arg-type]

    @property
    def held(self) -> bool:
        return True


def visible_gpus() -> int:
    """GPUs this process may use, found without initialising CUDA: its ``CUDA_VISIBLE_DEVICES`` entries,
    else the machine's; 0 where the device is the CPU (``DFLASH_DEVICE=cpu`` too)."""
    if detect_device_kind() == "cpu":
        return 0
    cvd = os.environ.get(ENV_CVD)
    return len(_parse_cvd(cvd)) if cvd is not None else max(0, _physical_gpu_count())


def scheduler_owns_gpus(gpus: int = 1) -> bool:
    """True when a cluster scheduler gave THIS job its GPUs: inside a SLURM job whose allocation
    holds no more GPUs than the job asked for (``gpus``).

    An allocation with more GPUs than the job's request is one that several jobs share (Snakemake
    run locally inside an ``salloc``/``sbatch``): there the flock leases divide it, as on a
    workstation. ``DFLASH_SCHEDULER=slurm|none`` overrides the detection.
    """
    mode = os.environ.get("DFLASH_SCHEDULER", "auto").strip().lower()
    if mode in ("slurm", "none"):
        return mode == "slurm"
    return "SLURM_JOB_ID" in os.environ and visible_gpus() <= gpus


def allocation_device(slot: int | None = None, set_env: bool = True) -> DeviceLease:
    """The device of a job whose GPUs a scheduler allocated (no flock: the scheduler keeps jobs apart).

    A job allocated one GPU uses it, whatever its slot (warm job i, an evaluation); a job
    allocated K GPUs (the training job) gives slot k the allocation's k-th GPU. Without GPUs,
    the CPU, as on a workstation.
    """
    kind = detect_device_kind()
    if kind == "cuda" and _cuda_initialised():
        raise RuntimeError("CUDA is already initialised in this process; choose the GPU before any torch.cuda call")
    visible = None
    entries = [str(i) for i in range(max(1, _physical_gpu_count()))]
    if kind == "cuda":
        entries = _parse_cvd(os.environ.get(ENV_CVD, "")) or entries
        index = 0 if slot is None or len(entries) == 1 else slot
        if index >= len(entries):
            raise UserError(
                f"GPU slot {slot}: the scheduler allocated {len(entries)} GPU(s) to this job "
                f"({ENV_CVD}={os.environ.get(ENV_CVD)!r}); the job's `gpu` resource must cover its slots"
            )
        visible = entries[index]
        if set_env:
            os.environ[ENV_CVD] = visible
    if set_env:
        os.environ[ENV_SLOT] = str(slot or 0)
    return DeviceLease(AllocationLease(slot or 0, len(entries)), "cuda:0" if kind == "cuda" else "cpu", visible)


def lease_for_job(config: dict, slot: int | None = None, gpus: int = 1, **kwargs) -> DeviceLease:
    """:func:`lease_device` with the workflow config's ``gpu`` section, or the scheduler's allocation.

    Jobs read these settings at run time instead of taking them as rule
    params: where the slots' locks live, how many there are and how long to
    wait for one decide where a job runs, not what it computes, so changing
    them must not rerun finished jobs. ``gpus``: how many GPUs the job asked
    for (its ``gpu`` resource). Inside a cluster scheduler's job that got
    exactly its GPUs the leases step aside (:func:`allocation_device`), and so do they for a job that
    takes any slot on a machine without GPUs; the warm chain's and training's own slots are still leased.
    """
    if scheduler_owns_gpus(gpus):
        return allocation_device(slot, set_env=kwargs.get("set_env", True))
    if slot is None and detect_device_kind() == "cpu":
        # any slot, on a machine without GPUs: nothing to keep apart (Snakemake's --cores shares the CPU);
        # a lock would only serialise jobs such as two 1-thread evaluations on a 2-core machine
        return allocation_device(None, set_env=kwargs.get("set_env", True))
    gpu = config["gpu"]
    lock_dir = gpu.get("lock_dir") or os.path.join(config["results"], "locks")
    return lease_device(lock_dir, gpu["slots"], slot=slot, timeout_s=gpu["lease_timeout_s"], **kwargs)


@contextlib.contextmanager
def one_compile_at_a_time(config: dict, log=print):
    """Hold ``<lock dir>/compile.lock``, waiting for it: the warm jobs of several compile signatures (named
    runs: one chain each) take it around their compile, so no two compiles ever overlap, as the one chain
    of a single run keeps them; waiting past ``gpu.lease_timeout_s`` is one line."""
    gpu = config["gpu"]
    lock_dir = Path(gpu.get("lock_dir") or os.path.join(config["results"], "locks"))
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / "compile.lock"
    start, said = time.time(), False
    while (fd := _try_lock(path)) is None:
        if not said:
            log(f"waiting for another warm job's compile to finish ({path})")
            said = True
        if time.time() - start > gpu["lease_timeout_s"]:
            raise UserError(f"{path}: another warm job held it for gpu.lease_timeout_s ({gpu['lease_timeout_s']:g} s); "
                            "raise gpu.lease_timeout_s, or look for a warm job that hangs")
        time.sleep(1.0)
    try:
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflashpipe.jobs.lease",
        description="Lease a GPU slot, set CUDA_VISIBLE_DEVICES/DFLASH_SLOT, then exec CMD (which keeps the lease).",
    )
    parser.add_argument("--lock-dir", required=True, help="directory of the slot lock files")
    parser.add_argument("--slots", type=int, required=True, help="number of slots (= snakemake --resources gpu)")
    parser.add_argument("--slot", type=int, default=None, help="wait for exactly this slot (default: any free one)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for a slot")
    parser.add_argument("--poll", type=float, default=DEFAULT_POLL_S, help="seconds between attempts")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (use: ... -- CMD [ARGS...])")
    try:
        lease = lease_device(
            args.lock_dir, args.slots, slot=args.slot, timeout_s=args.timeout, poll_s=args.poll,
            info={"cmd": " ".join(cmd)[:200]},
        )
    except UserError as err:
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        return 1
    os.set_inheritable(lease.lease.fd, True)  # the exec'd command (same pid) keeps the lock
    os.environ.update(lease.child_env())
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)
    except OSError as err:
        print(f"ERROR: cannot run {cmd[0]!r}: {err}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
