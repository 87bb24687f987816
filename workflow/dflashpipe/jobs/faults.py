"""Fault injection for the pipeline's reliability tests; a no-op unless ``DFLASH_FAULTS`` is set.

``DFLASH_FAULTS`` is a JSON list of faults, each ``{"at": <point>, "do": <action>, ...}``
where the other keys must equal the point's arguments (e.g. ``"step": 3, "rank": 1``):

* ``park``: write ``<DFLASH_FAULT_MARKER>`` (a file path) and sleep, so a test can
  kill the process (or its whole process group) at a known point;
* ``kill``: SIGKILL this process (a crashed rank);
* ``raise``: raise ``OSError(ENOSPC)`` (a full disk).

Points: ``train.step`` (step, rank) at the start of a training step, and
``train.export`` (rank) before rank 0 publishes the run's outputs.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path


def failpoint(at: str, **where) -> None:
    spec = os.environ.get("DFLASH_FAULTS")
    if not spec:
        return
    for fault in json.loads(spec):
        if fault.get("at") != at or any(fault[k] != v for k, v in where.items() if k in fault):
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
