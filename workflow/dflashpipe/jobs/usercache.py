"""The user's cache folder for what the workflow keeps between runs and checkouts (code digests, the jobs'
bytecode): ``$XDG_CACHE_HOME/dflashpipe/<name>``, default ``~/.cache/dflashpipe/<name>``. What is kept there is
keyed by content: deleting it costs time, never a result."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(name: str, environ=os.environ) -> Path:
    """``$XDG_CACHE_HOME/dflashpipe/<name>`` (default ``~/.cache``)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflashpipe" / name
