"""What every pipeline job does first: log to its file, set threads, turn user errors into one line,
and show its progress bars on the console."""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import sys
import time

from dflashpipe.jobs.checkout import check_code
from dflashpipe.jobs.errors import UserError, disk_full, disk_full_line


def set_threads(n: int) -> None:
    """Torch CPU threads (and the BLAS pools) for this process; configurable per rule."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    try:
        import torch
    except ImportError:  # the stages without a model run in an environment without torch
        return

    torch.set_num_threads(n)


class Laps:
    """Seconds per named phase of a job's set-up, for its log: ``str(laps)`` is
    ``"target 3.1 s, drafter 0.4 s"``. ``lap(name)`` ends the phase that began at the last lap."""

    def __init__(self):
        self.t, self.seconds = time.time(), {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.t
        self.t = now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())


# A job's progress lines reach the console at most this often (seconds), whatever its bars' rate.
PROGRESS_EVERY_S = 10.0
# A child process of a job (training rank 0) finds the job's console here: a path it opens
# (``/proc/<job pid>/fd/<n>``: the job's terminal or pipe, opened again).
CONSOLE_ENV = "DFLASH_CONSOLE"
_console = None  # this job's console stream (the terminal Snakemake runs in)


class _ConsoleProgress(io.TextIOBase):
    """``sys.stderr`` of a job: everything goes to the log; a progress bar's update (tqdm writes
    each one after a carriage return) is also shown on the console as one plain line, at most
    every ``PROGRESS_EVERY_S`` seconds, prefixed with the job's name; a bar shown before is shown
    again when it ends. Bars done within the interval (loading weights) stay in the log."""

    def __init__(self, log, console, name: str):
        self.log, self.console, self.name = log, console, name
        self.shown, self.shown_bar = time.time(), None

    def write(self, text: str) -> int:
        n = self.log.write(text)
        if self.console is not None and text.startswith("\r"):
            line = re.sub(r"\|[^|]*\|", "", text.strip("\r\n ")).strip()  # the bar's glyphs out
            bar = line.split(":")[0]
            ended = re.search(r"\b100%", line) is not None and bar == self.shown_bar
            if line and (ended or time.time() - self.shown >= PROGRESS_EVERY_S):
                with contextlib.suppress(OSError, ValueError):
                    print(f"  [{self.name}] {re.sub(r'  +', ' ', line)}", file=self.console, flush=True)
                self.shown, self.shown_bar = time.time(), None if ended else bar
        return n

    def flush(self) -> None:
        self.log.flush()

    def fileno(self) -> int:
        return self.log.fileno()


def console_fd() -> int | None:
    """The descriptor of this job's console, for a child process to show its progress on (or None)."""
    return _console.fileno() if _console is not None else None


def _since_process_start() -> str:
    """``", 5.2 s after the process began"``: what starting Python, Snakemake's script preamble and the
    imports cost this job (empty where the process's start time is unknown)."""
    try:
        import psutil

        return f", {time.time() - psutil.Process().create_time():.1f} s after the process began"
    except Exception:  # psutil comes with Snakemake; a job run some other way may lack it
        return ""


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` (Dynamo's frames, Inductor's code and
    loading it from the compile cache); 0 where nothing was compiled (Dynamo never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return float(utils.calculate_time_spent().get("entire_frame_compile", 0.0)) if utils else 0.0
    except Exception:  # a torch without the counter: unknown, not a failed job
        return 0.0


@contextlib.contextmanager
def job(log_path: str | None, threads: int = 1, name: str = "job", outputs=()):
    """Run a job body with stdout/stderr in ``log_path``, progress on the console, one-line user errors.

    Output is redirected at the file-descriptor level, so warnings from C
    extensions and tqdm bars land in the log too; the bars also show on the
    console, one line per job every ``PROGRESS_EVERY_S`` seconds. A :class:`UserError`
    is written to the log AND to the terminal's stderr as ``ERROR: ...``, then
    the process exits with status 1 (no traceback wall); so is a full disk, naming the file (else the
    folder of ``outputs``, the job's). A training rank shows its
    progress on the console of the job that started it (``CONSOLE_ENV``).
    """
    global _console
    terminal = os.fdopen(os.dup(2), "w")
    _console = terminal
    inherited = os.environ.pop(CONSOLE_ENV, None)
    # the job's terminal or pipe, opened again; not a plain file (this process's writes would not follow the
    # job's offset in it), nor one that is gone: then the log only
    with contextlib.suppress(OSError):
        if inherited and not stat.S_ISREG(os.stat(inherited).st_mode):
            _console = open(inherited, "w")
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stderr = _ConsoleProgress(sys.stderr, _console, name)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        log(f"{name}: start (pid {os.getpid()}, {threads} thread(s){_since_process_start()})")
        check_code()  # the library of the checkout that planned this job, or one line naming both
        set_threads(threads)
        yield log
        log(f"{name}: done in {time.time() - t0:.1f}s, compiling {compile_seconds():.1f}s of it")
    except Exception as err:
        full = disk_full(err)
        if not isinstance(err, UserError) and full is None:
            raise
        line = f"ERROR: {err}" if isinstance(err, UserError) else f"ERROR: {disk_full_line(full, name, outputs)}"
        with contextlib.suppress(OSError):  # the log's disk may be the full one
            print(line, file=sys.stderr, flush=True)
        if log_path:
            print(f"{line}  [{name}; log: {log_path}]", file=terminal, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: a line, not a traceback
        with contextlib.suppress(OSError):
            log(f"{name}: interrupted (SIGINT) after {time.time() - t0:.1f}s; nothing half-written is left in place, "
                "and the next run starts this job again")
        raise SystemExit(130) from None
