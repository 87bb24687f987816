"""One-line user errors.

Bad input (a malformed config, a missing file, an empty dataset, an absent GPU)
must end a job with ONE line that names the file and field and says what to do,
not a traceback wall. Library code raises :class:`UserError`; entry points wrap
their work in :func:`exit_on_user_error`, which prints the line to stderr (and
so into the job's log) and exits with status 1.
"""

from __future__ import annotations

import contextlib
import sys


class UserError(Exception):
    """An error caused by input the user controls; its message is the whole story."""


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as err:
        print(f"ERROR: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
