"""The jobs' bytecode, kept where the Python installation keeps none.

Every job is a new Python process that imports torch and transformers. Python keeps a module's compiled
bytecode (.pyc) beside its source, but not where ``PYTHONDONTWRITEBYTECODE`` is set or the installation is
read-only, and ``pip install --no-compile`` leaves none: container images often do all three, and then every
job compiles torch and transformers from source again (measured on an H100 machine of that kind: importing
torch and transformers' Qwen3 model took 9.3-10.4 s a process, 5.1 s with bytecode; docs/results-h200.md).

Where the installation has no bytecode for torch and Python will not write it, the workflow points its jobs
at a bytecode cache of its own (``PYTHONPYCACHEPREFIX``, ``$XDG_CACHE_HOME/dflashpipe/pycache``, default
``~/.cache``) and lets them write there: never beside the installed sources. The first job compiles, the
others read. A user's own ``PYTHONPYCACHEPREFIX`` is kept; ``DFLASHPIPE_PYCACHE=0`` turns this off. An
installation with bytecode (``scripts/setup.sh`` writes it) is left as it is.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dflashpipe.jobs.usercache import user_cache

OFF_ENV = "DFLASHPIPE_PYCACHE"


def installed_bytecode_missing(environ=os.environ, module: str = "torch") -> bool:
    """Whether each job would compile ``module`` from source: no .pyc beside it, and Python may not (or
    cannot) write one there."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    if Path(importlib.util.cache_from_source(spec.origin)).is_file():
        return False
    return bool(environ.get("PYTHONDONTWRITEBYTECODE")) or not os.access(os.path.dirname(spec.origin), os.W_OK)


def share_bytecode_cache(environ=os.environ, module: str = "torch") -> Path | None:
    """Point the jobs this process starts at the workflow's bytecode cache where the installation keeps no
    bytecode (see above); the folder, or None where nothing was changed."""
    if environ.get(OFF_ENV) == "0" or environ.get("PYTHONPYCACHEPREFIX") or not installed_bytecode_missing(environ, module):
        return None
    folder = user_cache("pycache", environ)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    environ["PYTHONPYCACHEPREFIX"] = str(folder)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
