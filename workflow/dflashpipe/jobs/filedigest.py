"""Content digests of big files (a target's weights), computed once per file version.

A target's weights are identified by their content: a fine-tune swapped into the
same directory has the same names and sizes, and must not resume the old run
or reuse its expansions. Reading them takes seconds per GB (docs/reliability.md),
so a digest is kept in a small JSON sidecar keyed by the file's resolved path,
size, mtime_ns, ctime_ns, inode and device: any write, copy or rename over the
file changes at least one of them (ctime cannot be set back by ``touch``), and
then the file is read again. A key that merely changed (``chmod``) costs one
re-read, never a wrong digest.

Why not sampled chunks + size + mtime: a fine-tune of a few layers (or a LoRA
merged into some projections) can leave every sampled chunk unchanged, and
mtime alone can be set back; a full read once per file version is affordable.

The sidecar is ``$DFLASHPIPE_DIGEST_CACHE`` (the Snakefile points it at
``<results>/.cache/file-digests.json``); unset, nothing is cached. Concurrent
jobs may each write it: the last write wins, a lost entry is a re-read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path

ENV = "DFLASHPIPE_DIGEST_CACHE"


#: set (to 1) when the cache is read but never written: a dry run writes nothing into results/
READ_ONLY_ENV = "DFLASHPIPE_DIGEST_CACHE_READ_ONLY"


def share_cache(results_dir: str | os.PathLike, write: bool = True) -> None:
    """Point this process and the jobs it starts at the results' digest cache (the Snakefile calls it)."""
    os.environ[ENV] = os.path.abspath(os.path.join(results_dir, ".cache", "file-digests.json"))
    os.environ[READ_ONLY_ENV] = "" if write else "1"


def _key(path: Path) -> str:
    st = path.stat()
    return json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])


def _read_cache(cache: Path) -> dict:
    try:
        data = json.loads(cache.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_digest(path: str | os.PathLike, cache: str | os.PathLike | None = None) -> str:
    """sha256 of the file's content (hex), from the sidecar when this very file version was read before."""
    path = Path(path)
    cache = cache if cache is not None else os.environ.get(ENV)
    key = _key(path)
    if cache:
        hit = _read_cache(Path(cache)).get(key)
        if isinstance(hit, str):
            return hit
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if cache and _key(path) == key and not os.environ.get(READ_ONLY_ENV):  # not written to while it was read
        cache = Path(cache)
        with contextlib.suppress(OSError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            entries = _read_cache(cache)
            entries[key] = digest
            tmp = cache.with_name(f".{cache.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(entries, indent=0))
            os.replace(tmp, cache)
    return digest
