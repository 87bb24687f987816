import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from dflashpipe.jobs.codedeps import module_closure

LIB = REPO / "workflow" / "dflashpipe"


def names(files):
    return {str(Path(f).relative_to(LIB)) for f in files}


def test_closure_follows_imports_transitively():
    got = names(module_closure(LIB, ["stages.expand"]))
    # expand imports atomic, errors and (inside functions) data and target
    assert {"__init__.py", "stages/expand.py", "jobs/atomic.py", "jobs/errors.py", "inputs/data.py", "inputs/target.py"} <= got
    assert "inputs/tiny_target.py" not in got
    assert "inputs/tokenize.py" not in got


def test_closure_on_a_synthetic_package(tmp_path):
    pkg = tmp_path / "dflashpipe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dflashpipe.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import dflashpipe.c\n")
    (pkg / "c.py").write_text("x = 1\n")
    (pkg / "unused.py").write_text("import os\n")
    got = {str(Path(f).relative_to(pkg)) for f in module_closure(pkg, ["a"])}
    assert got == {"__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "c.py"}


def test_script_closure_starts_from_the_scripts_imports():
    from dflashpipe.jobs.codedeps import script_closure

    got = names(script_closure(LIB, REPO / "workflow/scripts/tiny_target.py"))
    assert {"inputs/tiny_target.py", "inputs/data.py", "jobs/runtime.py", "jobs/errors.py"} <= got
    assert "stages/expand.py" not in got


def test_relative_imports_are_followed(tmp_path):
    pkg = tmp_path / "dflashpipe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "a.py").write_text("from .c import x\nfrom ..top import y\n")
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "sub" / "c.py").write_text("x = 1\n")
    (pkg / "top.py").write_text("y = 2\n")
    got = {str(Path(f).relative_to(pkg)) for f in module_closure(pkg, ["sub.a"])}
    assert got == {"__init__.py", "sub/__init__.py", "sub/a.py", "sub/b.py", "sub/c.py", "top.py"}


def test_training_stage_sees_the_drafter_model_code():
    from dflashpipe.jobs.codedeps import script_closure

    got = names(script_closure(LIB, REPO / "workflow/scripts/train.py"))
    assert {"training/train.py", "training/step.py", "drafter/model.py", "drafter/loss.py", "drafter/masks.py",
            "training/launch.py", "jobs/hotstart.py", "jobs/lease.py"} <= got
    assert not any(n.startswith("evaluate/") for n in got)


def test_warm_fingerprint_and_run_identity_cover_the_drafter_model():
    """The step receives the drafter, it does not import it: the model file must be listed anyway,
    or an edit to the drafter would neither rerun the warm chain nor retrain."""
    from dflashpipe.jobs.hotstart import train_step_code_files

    got = names(train_step_code_files())
    assert {"drafter/model.py", "training/step.py", "drafter/loss.py", "drafter/features.py", "drafter/masks.py",
            "training/data.py", "training/train.py", "training/run.py"} <= got
    assert "jobs/tracking.py" not in got and not any(n.startswith("evaluate/") for n in got)



def test_each_decoder_belongs_to_the_stages_that_run_it():
    """decode/ holds the expansion's slot decoder and the evaluation's loops side by side: an edit to the
    loops reruns the evaluation, never the expansion (its package __init__ imports nothing)."""
    from dflashpipe.jobs.codedeps import script_closure

    expand = names(script_closure(LIB, REPO / "workflow/scripts/expand.py"))
    evaluate = names(script_closure(LIB, REPO / "workflow/scripts/evaluate.py"))
    train = names(script_closure(LIB, REPO / "workflow/scripts/train.py"))
    assert {"decode/__init__.py", "decode/slots.py", "decode/cuda_graph.py"} <= expand
    assert not {"decode/speculative.py", "decode/static_target.py", "decode/static_drafter.py"} & expand
    assert {"decode/speculative.py", "decode/static_target.py", "decode/static_drafter.py", "decode/cuda_graph.py",
            "evaluate/lossless.py", "evaluate/hf_assistant.py", "evaluate/metrics.py"} <= evaluate
    assert not any(n.startswith("decode/") for n in train)
    # which user turns of a chat the target answers: one module both read, so an expansion edit reruns no evaluation
    assert "inputs/turns.py" in expand & evaluate and "stages/expand.py" not in evaluate


def test_the_export_depends_on_the_modeling_code_it_copies():
    """The export job copies export/hf_modeling.py beside the weights without importing it (its
    transformers classes cost seconds per job): the file is still one of the job's code inputs."""
    from dflashpipe.jobs.codedeps import script_closure

    assert "export/hf_modeling.py" in names(script_closure(LIB, REPO / "workflow/scripts/export.py"))


SOURCE = '''
"""Module docstring."""
import math


def lr_at(step, base, log=print):
    """The learning rate at ``step``."""
    # warm up for 10 steps
    scale = min(1.0, (step + 1) / 10)
    log(f"step {step}: lr {base * scale:.3g}")
    if scale < 0:
        raise ValueError(f"negative scale {scale}")
    assert scale <= 1, "scale above one"
    return base * scale * math.cos(0.5)
'''


def test_source_meaning_ignores_comments_docstrings_and_messages():
    from dflashpipe.jobs.codedeps import source_meaning

    base = source_meaning(SOURCE)
    same = [
        SOURCE.replace("# warm up for 10 steps", "# linear warm-up"),
        SOURCE.replace('"""The learning rate at ``step``."""', '"""LR schedule."""'),
        SOURCE.replace('"""The learning rate at ``step``."""\n', ""),
        SOURCE.replace('log(f"step {step}: lr {base * scale:.3g}")', 'log(f"at step {step} the lr is {base * scale:.5f}")'),
        SOURCE.replace('f"negative scale {scale}"', 'f"scale {scale} is negative"'),
        SOURCE.replace('"scale above one"', '"too big"'),
        SOURCE.replace("scale = min(1.0, (step + 1) / 10)", "scale = min(\n        1.0, (step + 1) / 10\n    )"),
    ]
    for variant in same:
        assert variant != SOURCE and source_meaning(variant) == base, variant
    other = [
        SOURCE.replace("/ 10)", "/ 20)"),  # a constant
        SOURCE.replace("(step + 1)", "(step - 1)"),  # an operator
        SOURCE.replace("math.cos", "math.sin"),  # a call
        SOURCE.replace('log(f"step {step}: lr {base * scale:.3g}")', 'log(f"step {step}: lr {base / scale:.3g}")'),
    ]
    for variant in other:
        assert source_meaning(variant) != base, variant


def test_code_digest_of_the_training_code_ignores_a_reworded_log_line(tmp_path):
    """The real training loop: a reworded log message keeps the digest (a killed run resumes); a changed
    constant does not."""
    import re
    import shutil

    from dflashpipe.jobs.codedeps import meaning_digest

    root = tmp_path / "dflashpipe"
    shutil.copytree(REPO / "workflow" / "dflashpipe", root, ignore=shutil.ignore_patterns("__pycache__"))
    train = root / "training" / "train.py"
    files = [str(train), str(root / "training" / "step.py")]
    before = meaning_digest(files, root)
    src = train.read_text()
    m = re.search(r'log\(\s*f?"([A-Za-z][^"{]{3,})', src)
    assert m, "train.py logs something"
    train.write_text(src.replace(m.group(1), "Reworded: " + m.group(1), 1) + "\n# a comment\n")
    assert meaning_digest(files, root) == before
    train.write_text(src.replace("== 0", "== 1", 1))
    assert "== 0" in src and meaning_digest(files, root) != before
    train.write_text(src)
    loop = root / "training" / "loop.py"  # the loop's own messages: the first step's time, the held-out figures
    files.append(str(loop))
    before, src = meaning_digest(files, root), loop.read_text()
    assert 'log(f"first step done in ' in src
    loop.write_text(src.replace('log(f"first step done in ', 'log(f"the first step took '))
    assert meaning_digest(files, root) == before


def _package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "dflashpipe"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def _digest(pkg: Path, top: str) -> str:
    from dflashpipe.jobs.codedeps import meaning_digest

    return meaning_digest(module_closure(pkg, [top]), pkg)


PROBLEMS = "class UserError(Exception):\n    pass\n"
HELPERS = "import os\n\n\ndef where():\n    return os.getcwd()\n"


def test_a_moved_or_renamed_module_keeps_the_digest(tmp_path):
    """Where a file sits and what it is called do not count: a module moved into a new folder (its
    ``__init__.py`` a docstring only) and renamed, its importers' imports rewritten, in another order."""
    before = _package(tmp_path / "a", {
        "problems.py": PROBLEMS, "helpers.py": HELPERS,
        "stage.py": "from dflashpipe.problems import UserError\nfrom dflashpipe.helpers import where\n"
                    "from dflashpipe import helpers as H\n\n\ndef run():\n    raise UserError(where(), H.where())\n"
                    "HERE = Path(__file__).resolve().parents[1] / 'schemas'\n",
    })
    after = _package(tmp_path / "b", {
        "jobs/__init__.py": '"""Job plumbing."""\n\nfrom __future__ import annotations\n',
        "jobs/user_problems.py": "# moved\n" + PROBLEMS, "jobs/helpers.py": HELPERS,
        "stages/__init__.py": "",
        "stages/stage.py": "from dflashpipe.jobs import helpers as H\nfrom dflashpipe.jobs.helpers import where\n"
                           "from dflashpipe.jobs.user_problems import UserError\n\n\n"
                           "def run():\n    raise UserError(where(), H.where())\n"
                           "HERE = Path(__file__).resolve().parents[2] / 'schemas'\n",
    })
    assert _digest(before, "stage") == _digest(after, "stages.stage")


def test_the_digest_sees_a_real_change_anywhere_and_which_module_is_imported(tmp_path):
    base = {"problems.py": PROBLEMS, "helpers.py": HELPERS, "other.py": HELPERS.replace("getcwd", "getpid"),
            "stage.py": "from dflashpipe.helpers import where\nimport dflashpipe.other\n\n\ndef run():\n"
                        "    return where()\n"}
    ref = _digest(_package(tmp_path / "ref", base), "stage")
    changed = [
        {"helpers.py": HELPERS.replace("getcwd", "getcwdb")},  # an imported module's code
        {"stage.py": base["stage.py"].replace("helpers import", "other import")},  # where a name comes from
        {"stage.py": base["stage.py"].replace("return where()", "return where() + 1")},  # the stage's own code
    ]
    for i, change in enumerate(changed):
        assert _digest(_package(tmp_path / str(i), {**base, **change}), "stage") != ref, change


def test_two_files_of_the_same_meaning_count_twice(tmp_path):
    from dflashpipe.jobs.codedeps import meaning_digest

    pkg = _package(tmp_path, {"a.py": HELPERS, "b.py": "# the same\n" + HELPERS})
    one, two = [str(pkg / "a.py")], [str(pkg / "a.py"), str(pkg / "b.py")]
    assert meaning_digest(one, pkg) != meaning_digest(two, pkg)
    assert meaning_digest(two, pkg) == meaning_digest(two[::-1], pkg)


def test_a_file_anchor_that_reaches_elsewhere_is_a_change(tmp_path):
    src = "from pathlib import Path\n\nHERE = Path(__file__).resolve().parent\n"
    a = _digest(_package(tmp_path / "a", {"m.py": src}), "m")
    b = _digest(_package(tmp_path / "b", {"m.py": src.replace(".parent", ".parents[1]")}), "m")
    moved = _digest(_package(tmp_path / "c", {"sub/__init__.py": "", "sub/m.py": src.replace(".parent", ".parents[1]")}),
                    "sub.m")
    assert a != b and a == moved


def _script_digest_in_a_new_process(pkg: Path, script: Path, cache: str) -> str:
    """script_digest as Snakemake's planning process computes it: a fresh interpreter, the cache in ``cache``."""
    code = ("import sys; from dflashpipe.jobs.codedeps import script_digest; "
            "print(script_digest(sys.argv[1], sys.argv[2]))")
    env = {**os.environ, "DFLASHPIPE_CODE_CACHE": cache, "PYTHONPATH": str(REPO / "workflow")}
    out = subprocess.run([sys.executable, "-c", code, str(pkg), str(script)], env=env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_digests_kept_between_processes_follow_every_edit_of_the_package(tmp_path):
    """The digests Snakemake keeps between plans (``$DFLASHPIPE_CODE_CACHE``) are keyed by the package's bytes:
    a real change of any imported module gives the digest a cold computation gives, a comment keeps it, and a
    damaged or unwritable cache costs time, never a wrong digest."""
    pkg = _package(tmp_path / "p", {"helpers.py": HELPERS, "other.py": PROBLEMS})
    script = tmp_path / "stage.py"
    script.write_text("from dflashpipe.helpers import where\n\nwhere()\n")
    cache = tmp_path / "cache"
    cold = _script_digest_in_a_new_process(pkg, script, "")  # no cache at all
    assert _script_digest_in_a_new_process(pkg, script, str(cache)) == cold
    [kept] = cache.glob("*.json")
    entries = json.loads(kept.read_text())
    assert list(entries.values()) == [cold]
    # a second process takes the kept digest: poisoned, it shows it was read (and what follows must not be)
    kept.write_text(json.dumps({k: "kept" for k in entries}))
    assert _script_digest_in_a_new_process(pkg, script, str(cache)) == "kept"

    (pkg / "helpers.py").write_text(HELPERS.replace("getcwd", "getcwdb"))  # an imported module's code
    changed = _script_digest_in_a_new_process(pkg, script, str(cache))
    assert changed not in ("kept", cold) and changed == _script_digest_in_a_new_process(pkg, script, "")
    (pkg / "helpers.py").write_text("# a comment\n" + HELPERS)  # back, with a comment: the first meaning
    assert _script_digest_in_a_new_process(pkg, script, str(cache)) == cold
    script.write_text("from dflashpipe.other import UserError\n\nUserError()\n")  # the script's own code
    assert _script_digest_in_a_new_process(pkg, script, str(cache)) not in ("kept", cold, changed)

    script.write_text("from dflashpipe.helpers import where\n\nwhere()\n")
    for damaged in cache.glob("*.json"):
        damaged.write_text("{not json")
    assert _script_digest_in_a_new_process(pkg, script, str(cache)) == cold
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert _script_digest_in_a_new_process(pkg, script, str(blocked / "cache")) == cold
