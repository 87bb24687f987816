"""Atomic outputs: nothing half-written is ever mistaken for a result.

Every file or directory a stage produces is first written under a temporary
name in the same directory, then renamed into place (rename is atomic on POSIX
within one filesystem). A killed job leaves at most a ``.tmp-*`` sibling, which
the next attempt removes (as it writes the output, or restores it: :mod:`.memo`). The result gets the permissions any new file or
directory gets under the process's umask (``mkstemp`` alone would leave 0600), set after
the content is written: a writer that replaces the file it was given (safetensors' ``save_file``)
or writes files of its own into a directory (``save_pretrained``) cannot leave them 0600.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

from dflashpipe.jobs.faults import failpoint


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` would briefly change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the classic way
    os.umask(mask)
    return mask


def remove_leftovers(path: str | os.PathLike) -> None:
    """Remove the temporary siblings of ``path`` that a killed attempt left (``.tmp-<name>.*``). Only one
    job writes an output at a time (Snakemake's lock), so a sibling left is never in use."""
    path = Path(path)
    for stale in path.parent.glob(f".tmp-{glob.escape(path.name)}.*"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _tmp_sibling(path: Path) -> Path:
    """A fresh temporary name beside ``path``; an earlier attempt's are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def _set_modes(path: Path) -> None:
    """The modes a new file (``0o666 & ~umask``) or directory (``0o777 & ~umask``) gets, on ``path`` and,
    for a directory, everything inside it."""
    mask = _umask()
    if not path.is_dir():
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False):
    """Yield a temporary path; on success rename it to ``path``.

    For ``is_dir=True`` the yielded path is a fresh empty directory. On any
    exception the temporary is removed and ``path`` is left untouched.
    """
    path = Path(path)
    tmp = _tmp_sibling(path)
    if is_dir:
        tmp.unlink()
        tmp.mkdir()  # mode 0777 & ~umask
    try:
        yield tmp
        _set_modes(tmp)
        if not is_dir:  # on disk before it is renamed into place: a power loss leaves the old file or the new one
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        failpoint("atomic.publish", path=str(path))  # written, not yet in place: the tests' "mid-write"
        if is_dir and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def write_json(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as pretty JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` atomically (checkpoints). A write that fails on a full disk is an ``OSError`` (ENOSPC,
    naming the file) as any other write's: torch reports it as ``RuntimeError: [enforce fail at
    inline_container.cc] . unexpected pos``."""
    import errno

    import torch

    with atomic_path(path) as tmp:
        try:
            torch.save(obj, tmp)
        except RuntimeError as err:
            free = os.statvfs(tmp.parent)
            if free.f_bavail * free.f_frsize >= 1 << 20:  # room left: another failure, as it was
                raise
            raise OSError(errno.ENOSPC, f"No space left on device ({str(err).splitlines()[0]})", str(path)) from err


def save_safetensors(state: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file`` with the same bytes for the same tensors and metadata, every time.

    safetensors writes the header's ``__metadata__`` in a random order (a hash map), so the same
    weights came out as other bytes on every save; here the header is rewritten in place with the
    metadata sorted (the same keys and values: the same length, so no offset moves). Use it inside
    :func:`atomic_path` (or give it a fresh path).
    """
    import struct

    from safetensors.torch import save_file

    save_file(state, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        header = json.loads(raw)
        meta = header.pop("__metadata__", None)
        ordered = ({"__metadata__": dict(sorted(meta.items()))} if meta else {}) | header
        new = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
        new += b" " * (n - len(new))  # the writer pads the header to 8 bytes with spaces
        if len(new) != n:  # not the writer's compact JSON: leave its order rather than move every offset
            return
        f.seek(8)
        f.write(new)
