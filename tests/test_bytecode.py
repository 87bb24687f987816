"""The jobs' bytecode where the installation keeps none (dflashpipe.jobs.bytecode): a real package without
.pyc and a real Python process that imports it."""

import os
import subprocess
import sys

from dflashpipe.jobs.bytecode import installed_bytecode_missing, share_bytecode_cache


def _package(tmp_path):
    site = tmp_path / "site"
    (site / "bigpkg").mkdir(parents=True)
    (site / "bigpkg" / "__init__.py").write_text("VALUE = 42\n")
    sys.path.insert(0, str(site))
    return site


def test_jobs_keep_their_bytecode_in_the_workflows_cache_where_the_installation_keeps_none(tmp_path):
    site = _package(tmp_path)
    try:
        # a user's own cache, and the switch, are kept
        for own in ({"PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}, {"DFLASHPIPE_PYCACHE": "0"}):
            env = {"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "x"), **own}
            assert installed_bytecode_missing(env, "bigpkg")
            assert share_bytecode_cache(env, "bigpkg") is None and env.get("PYTHONDONTWRITEBYTECODE") == "1"
        assert not (tmp_path / "x").exists()

        # no .pyc beside the source and PYTHONDONTWRITEBYTECODE set (a container image): every process would
        # compile it again, so the jobs get the workflow's cache and may write there
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
        env.pop("PYTHONPYCACHEPREFIX", None)
        assert installed_bytecode_missing(env, "bigpkg")
        folder = share_bytecode_cache(env, "bigpkg")
        assert folder == tmp_path / "cache" / "dflashpipe" / "pycache"
        assert env["PYTHONPYCACHEPREFIX"] == str(folder) and "PYTHONDONTWRITEBYTECODE" not in env
        job = subprocess.run([sys.executable, "-c", "import bigpkg; print(bigpkg.VALUE)"], capture_output=True,
                             text=True, env={**env, "PYTHONPATH": str(site)}, check=True)
        assert job.stdout.strip() == "42"
        assert list(folder.rglob("__init__*.pyc")) and not (site / "bigpkg" / "__pycache__").exists()

        # bytecode beside the source (scripts/setup.sh writes it): left as it is
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "other")}
        env.pop("PYTHONPYCACHEPREFIX", None)
        subprocess.run([sys.executable, "-c", "import bigpkg"], check=True,
                       env={k: v for k, v in {**env, "PYTHONPATH": str(site)}.items() if k != "PYTHONDONTWRITEBYTECODE"})
        assert (site / "bigpkg" / "__pycache__").is_dir()
        assert not installed_bytecode_missing(env, "bigpkg") and share_bytecode_cache(env, "bigpkg") is None
        assert "PYTHONPYCACHEPREFIX" not in env and env["PYTHONDONTWRITEBYTECODE"] == "1"

    finally:
        sys.path.remove(str(site))
