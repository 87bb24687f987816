"""Every job runs the library of the checkout whose Snakefile planned it.

Snakemake runs each ``script:`` job (and the training job its rank processes)
as a new Python process, which imports ``dflashpipe`` from whatever comes
first on its path: an editable install of another clone, a non-editable
``pip install .``, a venv shared on a cluster. Snakemake's own preamble only
appends the Snakefile process's path, after site-packages. So the Snakefile
(``workflow/rules/common.smk``) calls :func:`pin_code`: the checkout's
``workflow/`` goes first on ``PYTHONPATH`` (Python puts it before
site-packages) and its path is recorded in ``DFLASHPIPE_CODE_DIR``. On a
cluster the job re-reads the Snakefile on its node, which pins it again.

Each job then checks it got that code (:func:`check_code`, called by
:func:`dflashpipe.jobs.runtime.job`, which every script and rank process runs):
when something still shadows it (a ``.pth`` that inserts a path at the front,
or ``--sdm conda``, which drops ``PYTHONPATH``, with an environment that has
the package installed), the job refuses with one line naming both paths
instead of running other code.
"""

from __future__ import annotations

import os
from pathlib import Path

from dflashpipe.jobs.errors import UserError

ENV = "DFLASHPIPE_CODE_DIR"


def package_parent() -> Path:
    """The directory this ``dflashpipe`` package was imported from (a checkout's ``workflow/``)."""
    return Path(__file__).resolve().parents[2]


def pin_code(code_dir: str | os.PathLike) -> None:
    """Make the jobs started from this process import ``dflashpipe`` from ``code_dir`` (first on their path)."""
    code = str(Path(code_dir).resolve())
    os.environ[ENV] = code
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != code]
    os.environ["PYTHONPATH"] = os.pathsep.join([code, *rest])


def planned_code() -> Path | None:
    """The ``workflow/`` directory the Snakefile pinned (None outside a pipeline job)."""
    value = os.environ.get(ENV)
    return Path(value).resolve() if value else None


def check_code() -> None:
    """Refuse, in one line naming both paths, when this process runs another checkout's library."""
    planned = planned_code()
    if planned is None:
        return
    running = package_parent()
    if running != planned:
        raise UserError(
            f"this job runs the dflashpipe library of {running}, but the Snakefile that planned it is in "
            f"{planned.parent}: something ahead of PYTHONPATH shadows the checkout (a .pth file that inserts "
            f"a path, or a conda environment with dflashpipe installed); uninstall that package or run "
            f"Snakemake from that checkout"
        )
