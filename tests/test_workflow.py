"""Real Snakemake runs (subprocess) of the pipeline on a mini config in a temp dir."""

import concurrent.futures
import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest

from conftest import CODE_EDIT, REPO, copy_checkout, mini_config, planned_rules, snakemake, snakemake_env, write_config


def test_stages_produce_outputs(mini_run):
    work, _ = mini_run
    r = work / "results"
    assert (r / "target/model/config.json").exists()
    metrics = json.loads((r / "target/metrics.json").read_text())
    assert metrics["steps"] == 8 and metrics["heldout_loss"] > 0

    prompt_stats = json.loads((r / "prompts/math.stats.json").read_text())  # rows without a prompt: counted there
    assert prompt_stats["prompts"] == 48 and prompt_stats["skipped_total"] == 0
    exp = pd.read_parquet(r / "expanded/math.parquet")
    assert len(exp) == 48
    assert {"id", "messages", "response", "finish_reason", "temperature", "target", "target_path"} <= set(exp.columns)
    assert all(m[-1]["role"] == "assistant" for m in exp["messages"])
    assert not list((r / "expanded/math").glob("*.chunks"))  # work dirs are removed when done

    ds = datasets.load_from_disk(str(r / "tokenized/train"))
    stats = json.loads((r / "tokenized/stats.json").read_text())
    assert len(ds) == stats["samples"] > 0
    assert stats["samples"] + stats["dropped_total"] == 48 + 16
    row = ds[0]
    assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"] <= 256
    assert sum(row["loss_mask"]) == row["num_loss_tokens"] >= 2 * 4

    for log in ["prompts/math.log", "target/tiny_target.log", "expand/math.shard0.log", "tokenize/tokenize.log"]:
        assert (r / "logs" / log).stat().st_size > 0, log


def test_rerun_is_a_no_op(mini_run):
    work, cfg = mini_run
    assert planned_rules(work, "--configfile", str(cfg)) == {}


def planned_in(checkout: Path, workdir: Path, cfg: Path) -> set[str]:
    """Rules a dry run of ``checkout``'s Snakefile in ``workdir`` would execute."""
    return set(planned_rules(workdir, "--configfile", str(cfg), snakefile=checkout / "Snakefile"))


def test_code_edit_reruns_exactly_its_stages(mini_run, tmp_path):
    """A change of what a library module means reruns the stages whose scripts import it (transitively), and
    what follows; so does one of a stage's script. A comment, a docstring or a log message reruns nothing.
    (Each edit in a checkout of its own, ``planned_after_edit``'s edit: two dry runs at a time, a core each.)"""
    work, cfg = mini_run
    # what follows training (its output changes) and what follows tokenize (the AR draft peer)
    training = {"warm_slot", "train", "export", "evaluate", "tables", "plots", "all"}
    data = {"tokenize", "ar_draft"} | training
    expected = [  # (module, edit, the rules planned)
        ("jobs/hotstart.py", CODE_EDIT, training),
        ("drafter/loss.py", CODE_EDIT, training),
        ("inputs/tokenize.py", CODE_EDIT, data),
        ("stages/expand.py", CODE_EDIT, {"expand_shard", "merge_expanded"} | data),
        ("decode/slots.py", CODE_EDIT, {"expand_shard", "merge_expanded"} | data),  # the batched backend
        ("inputs/tiny_target.py", CODE_EDIT, {"tiny_target", "expand_shard", "merge_expanded"} | data),
        ("inputs/data.py", CODE_EDIT, {"prompts", "tiny_target", "expand_shard", "merge_expanded"} | data),
        ("../scripts/tokenize.py", CODE_EDIT, data),  # a stage's script: by meaning too
        ("jobs/errors.py", "\n# a comment\n", set()),
        ("../scripts/train.py", "\n# a comment\n", set()),  # not dated: digested (profiles/default)
    ]
    checkouts = []
    for i, (module, edit, _) in enumerate(expected):
        checkout = copy_checkout(tmp_path / f"checkout{i}")
        path = checkout / "workflow" / "dflashpipe" / module
        path.write_text(path.read_text() + edit)  # dated now, newer than the outputs
        checkouts.append(checkout)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        planned = list(pool.map(lambda checkout: planned_in(checkout, work, cfg), checkouts))
    assert {m: p for (m, _, _), p in zip(expected, planned)} == {m: rules for m, _, rules in expected}


def test_config_typo_is_one_line(mini_run):
    work, _ = mini_run
    cfg = mini_config()
    cfg["expand"]["max_new_tokenz"] = 3
    bad = write_config(work / "bad.yaml", cfg)
    res = snakemake(work, "-n", "--configfile", str(bad))
    assert res.returncode != 0
    assert "expand.max_new_tokenz: unknown key (did you mean 'max_new_tokens'?)" in res.stderr
    assert "Traceback" not in res.stderr


def test_target_path_that_is_not_a_model(mini_run, tmp_path):
    work, _ = mini_run
    cfg = mini_config()
    cfg["target"]["path"] = str(tmp_path)
    bad = write_config(work / "bad_target.yaml", cfg)
    res = snakemake(work, "-n", "--configfile", str(bad))
    assert res.returncode != 0
    assert "target.path:" in res.stderr and "has no config.json" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow  # ~50 s: a second whole run in a moved checkout
def test_moving_the_checkout_reruns_nothing(tmp_path):
    """A checkout run in place (results inside it), then moved or renamed: nothing is planned again.
    (Snakemake keys a job's input set by path strings: the code inputs are relative to the checkout.)"""
    import shutil
    import subprocess
    import sys

    from conftest import REPO, snakemake_env

    first = tmp_path / "checkout"
    first.mkdir()
    for item in ("Snakefile", "workflow", "profiles", "envs", "config"):
        src = REPO / item
        (shutil.copytree(src, first / item, ignore=shutil.ignore_patterns("__pycache__"))
         if src.is_dir() else shutil.copy(src, first / item))
    write_config(first / "config.yaml", mini_config())
    target = "results/tokenized/stats.json"  # prompts, tiny target, expansion, tokenize: the costly upstream

    def run(where, *args):
        return subprocess.run([sys.executable, "-m", "snakemake", target, "--configfile", "config.yaml", *args],
                              cwd=where, env=snakemake_env(), capture_output=True, text=True, timeout=600)

    res = run(first, "--cores", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    moved = tmp_path / "renamed"
    first.rename(moved)
    res = run(moved, "-n", "--quiet", "rules")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Job stats:" not in res.stdout + res.stderr, (res.stdout + res.stderr)[-2000:]


def test_moving_library_modules_reruns_nothing(mini_copy, tmp_path):
    """A finished run, then its library reorganised: atomic.py and errors.py moved into a new folder and
    renamed, faults.py and runtime.py (which every stage script imports) moved there too, and every import
    rewritten to match, the scripts' too: nothing is planned. The rules' code params digest what the code
    means, not where it sits, and the workflow profile does not date the scripts."""
    import re
    import shutil
    import subprocess
    import sys

    from conftest import REPO, snakemake_env

    work, cfg = mini_copy
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for item in ("Snakefile", "workflow", "profiles", "envs", "config"):
        src = REPO / item
        (shutil.copytree(src, checkout / item, ignore=shutil.ignore_patterns("__pycache__"))
         if src.is_dir() else shutil.copy2(src, checkout / item))
    lib = checkout / "workflow" / "dflashpipe"
    (lib / "plumbing").mkdir()
    (lib / "plumbing" / "__init__.py").write_text('"""What every job stands on."""\n')
    moves = {"atomic": "atomic_files", "faults": "faults", "errors": "user_errors", "runtime": "runtime"}
    rewrites = []
    for old, new in moves.items():
        src = next(lib.rglob(f"{old}.py"))  # wherever it is now
        parent = ".".join(src.parent.relative_to(lib).parts)
        dotted = ".".join(filter(None, ["dflashpipe", parent, old]))
        src.rename(lib / "plumbing" / f"{new}.py")
        rewrites += [(rf"\b{re.escape(dotted)}\b", f"dflashpipe.plumbing.{new}"),
                     (rf"(?m)^(\s*)from {re.escape(dotted.rpartition('.')[0])} import {old}\b",
                      rf"\1from dflashpipe.plumbing import {new} as {old}")]
    rewritten = 0
    for f in [*checkout.joinpath("workflow").rglob("*.py"), *checkout.joinpath("workflow").rglob("*.smk")]:
        text = new_text = f.read_text()
        for pattern, replacement in rewrites:
            new_text = re.sub(pattern, replacement, new_text)
        if new_text != text:
            f.write_text(new_text)
            rewritten += 1
    assert rewritten > 12  # the twelve stage scripts, and library modules

    def planned():
        res = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(checkout / "Snakefile"), "-d", str(work),
                              "-n", "--quiet", "rules", "--configfile", str(cfg)],
                             cwd=work, env=snakemake_env(), capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return "Job stats:" in res.stdout + res.stderr, res.stdout + res.stderr

    anything, out = planned()
    assert not anything, out[-2000:]
    # a real change still reruns its stage, the code in its new place
    tok = next(lib.rglob("inputs/tokenize.py"))
    tok.write_text(tok.read_text() + CODE_EDIT)
    anything, out = planned()
    assert anything and "tokenize" in out, out[-2000:]


def test_the_workflow_runs_from_another_folder_and_as_a_module(tmp_path):
    """``snakemake -d DIR -s CHECKOUT/Snakefile`` finds the checkout's config/config.yaml (was: "Workflow
    defines configfile config/config.yaml but it is not present"), or DIR's own; and a project folder of
    a user's own (its config/config.yaml, its results/, the workflow imported with ``module``: the
    snakedeploy layout) runs end to end and then plans nothing."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO, snakemake_env

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = snakemake(elsewhere, "-n", "--quiet", "rules", "--cores", "2")
    assert res.returncode == 0 and "train" in res.stdout + res.stderr, res.stderr[-2000:]
    assert not (elsewhere / "results").exists()

    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    cfg = mini_config()  # smaller, end to end all the same: one training set, one GPU slot, AR beside DFlash
    del cfg["datasets"]["code"]
    cfg["gpu"]["slots"], cfg["train"]["shards"], cfg["evaluate"]["methods"] = 1, 1, ["dflash", "ar"]
    write_config(project / "config" / "config.yaml", cfg)
    shutil.copytree(REPO / "profiles" / "default", project / "profiles" / "default")
    (project / "Snakefile").write_text(
        'configfile: "config/config.yaml"\n\n\n'
        f'module dflash:\n    snakefile:\n        "{REPO / "Snakefile"}"\n    config:\n        config\n\n\n'
        "use rule * from dflash as dflash_*\n"
    )

    def run(*args: str) -> subprocess.CompletedProcess:  # the project's own Snakefile, from the project folder
        return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=project, env=snakemake_env(),
                              capture_output=True, text=True, timeout=600)

    res = run("--cores", "2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert (project / "results/drafter/model.safetensors").is_file() and (project / "results/plots/tau_speedup.png").is_file()
    res = run("-n", "--cores", "2")
    assert res.returncode == 0 and "Nothing to be done" in res.stdout + res.stderr, res.stdout[-2000:]
