"""Fault injection for the pipeline's reliability tests; a no-op unless ``DFLASH_FAULTS`` is set.

``DFLASH_FAULTS`` is a JSON list of faults, each ``{"at": <point>, "do": <action>, ...}``
where the other keys must equal the point's arguments (e.g. ``"step": 3, "rank": 1``):

* ``park``: write ``<DFLASH_FAULT_MARKER>`` (a file path) and sleep, so a test can
  kill the process (or its whole process group) at a known point;
* ``kill``: SIGKILL this process (a crashed rank);
* ``raise``: raise ``OSError(ENOSPC)`` (a full disk).

A string value may be a glob (``"path": "*/results/expanded/*"``).

Points: ``train.step`` (step, rank) at the start of a training step,
``train.export`` (rank) before rank 0 publishes the run's outputs, and
``atomic.publish`` (path) when any output is written in full under its temporary name and not yet
renamed into place (:mod:`dflashpipe.jobs.atomic`): where a kill "mid-write" lands; ``workflow.plan`` in
Snakemake's own process, once the config is checked, before the jobs are planned.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import signal
import time
from pathlib import Path


def _matches(want, value) -> bool:
    """A fault's value against a point's argument: equal, or a string matching a glob (``*/expanded/*``)."""
    if isinstance(want, str) and isinstance(value, str):
        return fnmatch.fnmatchcase(value, want)
    return want == value


def failpoint(at: str, **where) -> None:
    spec = os.environ.get("DFLASH_FAULTS")
    if not spec:
        return
    for fault in json.loads(spec):
        if fault.get("at") != at or not all(_matches(fault[k], v) for k, v in where.items() if k in fault):
            continue
        action = fault.get("do")
        if action == "park":
            Path(os.environ["DFLASH_FAULT_MARKER"]).write_text(json.dumps({"at": at, "pid": os.getpid(), **where}))
            while True:
                time.sleep(60)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "raise":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {at})")
