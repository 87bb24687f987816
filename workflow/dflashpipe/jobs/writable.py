"""Whether the jobs about to run can write what they write: checked once Snakemake has planned them and
before it starts any (the workflow's ``onstart``, workflow/rules/common.smk).

A read-only ``results/`` (a read-only mount, a folder the user may not write in) with jobs to run: where an
output is there, Snakemake refuses in its own words (``Write-protected output files``); where it is not,
Snakemake deletes it anyway before the job starts, and on a read-only filesystem unlinking even a missing file
fails (``EROFS``), so the run ended in Snakemake's 40-line ``OSError`` traceback; a folder the user may not
write in got as far as the job, which failed in its own traceback. Now: one line naming the file and the
folder, and what to do; nothing has run. Plan-side only: no job imports this module, so it is in no job's
code digest.
"""

from __future__ import annotations

import os


def _existing_folder(path: str) -> str:
    """The folder a job would create ``path`` in: its parent, or the nearest ancestor that exists."""
    folder = os.path.dirname(path)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder or "."


def _read_only_fs(folder: str) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def unwritable(jobs) -> str | None:
    """``jobs``: (rule, the paths it writes: outputs, log, benchmark) of every job about to run. None when
    each can write them; else the one line for the job whose first path that cannot be written (its outputs
    before its log) comes first by name."""
    blocked: dict[str, tuple[str, str]] = {}  # a job's first blocked path -> (its folder, its rule)
    for rule, paths in jobs:
        for path in map(str, paths):
            folder = _existing_folder(path)
            if not os.access(folder, os.W_OK | os.X_OK):
                blocked[path] = (folder, rule)
                break
    if not blocked:
        return None
    path = min(blocked)
    folder, rule = blocked[path]
    if _read_only_fs(folder):
        why, fix = "is on a read-only filesystem", "remount it read-write"
    else:
        why, fix = "is not writable by this user", f"make it writable (chmod u+w {folder})"
    more = f" (and {len(blocked) - 1} other job(s) to run)" if len(blocked) > 1 else ""
    return (f"{rule}: cannot write {path}: {folder} {why}{more}; {fix} and rerun: no job ran, no file "
            "changed")
