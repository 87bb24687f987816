"""What every pipeline job does first: log to its file, set threads, turn user errors into one line."""

from __future__ import annotations

import contextlib
import os
import sys
import time

from dflashpipe.checkout import check_code
from dflashpipe.errors import UserError


def set_threads(n: int) -> None:
    """Torch CPU threads (and the BLAS pools) for this process; configurable per rule."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    try:
        import torch
    except ImportError:  # the stages without a model run in an environment without torch
        return

    torch.set_num_threads(n)


@contextlib.contextmanager
def job(log_path: str | None, threads: int = 1, name: str = "job"):
    """Run a job body with stdout/stderr in ``log_path`` and one-line user errors.

    Output is redirected at the file-descriptor level, so warnings from C
    extensions and tqdm bars land in the log too. A :class:`UserError` is
    written to the log AND to the terminal's stderr as ``ERROR: ...``, then
    the process exits with status 1 (no traceback wall).
    """
    terminal = os.fdopen(os.dup(2), "w")
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"{name}: start (pid {os.getpid()}, {threads} thread(s))")
    try:
        check_code()  # the library of the checkout that planned this job, or one line naming both
        set_threads(threads)
        yield log
    except UserError as err:
        line = f"ERROR: {err}"
        print(line, file=sys.stderr, flush=True)
        if log_path:
            print(f"{line}  [{name}; log: {log_path}]", file=terminal, flush=True)
        raise SystemExit(1) from None
    log(f"{name}: done in {time.time() - t0:.1f}s")
