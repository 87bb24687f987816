"""A job's outputs kept by what made them: inputs of the same content, the same params (code digests
included) and wildcards give the same outputs back instead of computing them again.

Snakemake plans from dates: a deleted prompts table that is rebuilt with the same bytes is newer than
the expansion, so everything after it reruns (re-expands, re-evaluates). A job that calls
:meth:`Memo.restore` first finds its outputs of that run here and hard-links them back in a second; after
its work, :meth:`Memo.keep` links the fresh outputs here (no second copy on disk: the same files).

``<results>/.memo/<rule>/<wildcards>/<key>/``: one key per rule and wildcards, the last one kept; the
key is the sha256 of the rule, its wildcards, its params and its inputs' content digests
(:func:`dflashpipe.jobs.filedigest.file_digest`, read once per file version). The outputs are written
atomically (a new file, renamed), so a kept link never changes under it. A job that Snakemake was told
to run again (``--forcerun``, ``-F``, ``-f``: :data:`FORCED_ENV`, set by the Snakefile) computes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from dflashpipe.jobs.atomic import remove_leftovers
from dflashpipe.jobs.filedigest import file_digest

#: the rules Snakemake runs again because it was told to (comma-separated; ``*``: all): they never restore
FORCED_ENV = "DFLASHPIPE_FORCED_RULES"
MEMO = ".memo"


def forced_rules(forceall: bool, forcetargets: bool, forcerun) -> str:
    """The value of :data:`FORCED_ENV` for Snakemake's force settings (a file named in ``forcerun``: all)."""
    names = [str(f) for f in forcerun or ()]
    if forceall or forcetargets or any("/" in n or "." in n for n in names):
        return "*"
    return ",".join(sorted(names))


def _files(named) -> list[str]:
    return [str(f) for f in named]


def _forced(rule: str) -> bool:
    value = os.environ.get(FORCED_ENV, "")
    return value == "*" or rule in value.split(",")


class Memo:
    """A job's kept outputs (``smk``: the script's ``snakemake``). Training has its own: a finished run's
    checkpoint folder, found by the run's identity (:mod:`dflashpipe.training.checkpoint`)."""

    def __init__(self, smk):
        self.smk, self.results = smk, smk.config["results"]
        wildcards = dict(smk.wildcards.items())
        self.parent = Path(self.results) / MEMO / smk.rule / ("-".join(f"{k}={v}" for k, v in sorted(wildcards.items()))
                                                             or "all")
        what = {"rule": smk.rule, "wildcards": wildcards, "params": dict(smk.params.items()),
                "inputs": {f: file_digest(f) for f in sorted(_files(smk.input))},
                "outputs": _files(smk.output)}
        self.key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.folder = self.parent / self.key
        self.outputs = _files(smk.output)

    def _kept(self, out: str) -> Path:
        return self.folder / os.path.relpath(out, self.results)

    def restore(self, log=print) -> bool:
        """Link the outputs back from the run that had the same inputs, params and code; whether it did. They
        get this moment as their date, so Snakemake sees them newer than their inputs."""
        if _forced(self.smk.rule) or not all(self._kept(o).is_file() for o in self.outputs):
            return False
        for out in self.outputs:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(out)  # a killed attempt's temporary output (the file's, or its folder's)
            remove_leftovers(Path(out).parent)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out)
            os.link(self._kept(out), out)
        now = time.time()
        for out in self.outputs:
            os.utime(out, (now, now))
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.folder.stat().st_mtime))
        log(f"restored {len(self.outputs)} output(s) made on {made} from the same inputs (by content), params and "
            f"code: nothing to compute ({self.folder}; snakemake --forcerun {self.smk.rule} computes them again)")
        return True

    def keep(self, log=print) -> None:
        """Link the fresh outputs under the key (the key kept before goes); a file system without hard links,
        or no room, keeps nothing and says so."""
        tmp = self.parent / f".tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            for out in self.outputs:
                dest = tmp / os.path.relpath(out, self.results)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(out, dest)
            for old in self.parent.iterdir():
                if old != tmp:
                    shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, self.folder)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"outputs not kept for reuse ({err.strerror or err}); a rerun with the same inputs computes them again")
