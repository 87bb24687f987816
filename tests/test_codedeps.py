from pathlib import Path

from conftest import REPO
from dflashpipe.codedeps import module_closure

LIB = REPO / "workflow" / "dflashpipe"


def names(files):
    return {str(Path(f).relative_to(LIB)) for f in files}


def test_closure_follows_imports_transitively():
    got = names(module_closure(LIB, ["expand"]))
    # expand imports atomic, errors and (inside functions) data and target
    assert {"__init__.py", "expand.py", "atomic.py", "errors.py", "data.py", "target.py"} <= got
    assert "tiny_target.py" not in got
    assert "tokenize.py" not in got


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
    from dflashpipe.codedeps import script_closure

    got = names(script_closure(LIB, REPO / "workflow/scripts/tiny_target.py"))
    assert {"tiny_target.py", "data.py", "runtime.py", "errors.py"} <= got
    assert "expand.py" not in got


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
    from dflashpipe.codedeps import script_closure

    got = names(script_closure(LIB, REPO / "workflow/scripts/train.py"))
    assert {"drafter/train.py", "drafter/step.py", "drafter/model.py", "drafter/loss.py", "drafter/masks.py",
            "drafter/launch.py", "hotstart.py", "lease.py"} <= got
    assert not any(n.startswith("evaluate/") for n in got)


def test_warm_fingerprint_and_run_identity_cover_the_drafter_model():
    """The step receives the drafter, it does not import it: the model file must be listed anyway,
    or an edit to the drafter would neither rerun the warm chain nor retrain."""
    from dflashpipe.hotstart import train_step_code_files

    got = names(train_step_code_files())
    assert {"drafter/model.py", "drafter/step.py", "drafter/loss.py", "drafter/features.py", "drafter/masks.py",
            "drafter/data.py", "drafter/train.py"} <= got
    assert "tracking.py" not in got and not any(n.startswith("evaluate/") for n in got)
