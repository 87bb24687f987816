"""One-line user errors.

Bad input (a malformed config, a missing file, an empty dataset, an absent GPU)
must end a job with ONE line that names the file and field and says what to do,
not a traceback wall. Library code raises :class:`UserError`; every job runs
inside :func:`dflashpipe.jobs.runtime.job`, which prints the line (to the job's log
and to the terminal) and exits with status 1; the workflow's start-up checks
print it as ``ERROR: ...`` before any job runs.
"""

from __future__ import annotations

import errno
import os


class UserError(Exception):
    """An error caused by input the user controls; its message is the whole story."""


#: a full filesystem, or the user's quota on it
_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(err: BaseException) -> OSError | None:
    """The OSError of a full disk behind ``err`` (itself, or its cause or context), or None. pyarrow's
    write errors carry the text but not always the errno."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and (err.errno in _FULL or "No space left on device" in str(err)):
            return err
        err = err.__cause__ or err.__context__
    return None


def disk_full_line(err: OSError, job: str, outputs=()) -> str:
    """One line for a job that ran out of disk: where (the file it wrote, else its outputs' folder), why, and
    that a rerun after freeing space is all it takes (every output is written atomically; nothing finished
    is lost)."""
    where = err.filename or next((os.path.dirname(str(o)) or "." for o in outputs), None) or "its outputs"
    try:
        free = os.statvfs(where if os.path.isdir(where) else os.path.dirname(where) or ".")
        room = f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free there"
    except OSError:
        room = "free space unknown"
    return (f"{job}: no space left on device writing {where} ({room}); free space on that filesystem and rerun: "
            "nothing finished is lost, the job starts again from what it kept")


def damaged_output(path, err: BaseException) -> UserError:
    """The one line for an output of the workflow that does not read (a machine that stopped while it was
    copied, a disk error): the file, the reader's first line, and that deleting it makes the rerun write it
    again."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0].replace(f" '{path}'", "")
    if len(first) > 160:
        first = first[:160].rsplit(" ", 1)[0] + " ..."
    return UserError(f"{path}: cannot read ({first}); the file is truncated or corrupt: delete it and rerun, "
                     "snakemake makes it again")
