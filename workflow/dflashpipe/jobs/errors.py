"""One-line user errors.

Bad input (a malformed config, a missing file, an empty dataset, an absent GPU)
must end a job with ONE line that names the file and field and says what to do,
not a traceback wall. Library code raises :class:`UserError`; every job runs
inside :func:`dflashpipe.jobs.runtime.job`, which prints the line (to the job's log
and to the terminal) and exits with status 1; the workflow's start-up checks
print it as ``ERROR: ...`` before any job runs.
"""

from __future__ import annotations


class UserError(Exception):
    """An error caused by input the user controls; its message is the whole story."""
