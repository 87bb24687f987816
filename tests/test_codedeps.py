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



def test_each_decoder_belongs_to_the_stages_that_run_it():
    """decode/ holds the expansion's slot decoder and the evaluation's loops side by side: an edit to the
    loops reruns the evaluation, never the expansion (its package __init__ imports nothing)."""
    from dflashpipe.codedeps import script_closure

    expand = names(script_closure(LIB, REPO / "workflow/scripts/expand.py"))
    evaluate = names(script_closure(LIB, REPO / "workflow/scripts/evaluate.py"))
    train = names(script_closure(LIB, REPO / "workflow/scripts/train.py"))
    assert {"decode/__init__.py", "decode/slots.py", "decode/cuda_graph.py"} <= expand
    assert not {"decode/speculative.py", "decode/static_target.py", "decode/static_drafter.py"} & expand
    assert {"decode/speculative.py", "decode/static_target.py", "decode/static_drafter.py", "decode/cuda_graph.py",
            "evaluate/lossless.py", "evaluate/hf_assistant.py", "evaluate/metrics.py"} <= evaluate
    assert not any(n.startswith("decode/") for n in train)

def test_the_export_depends_on_the_modeling_code_it_copies():
    """The export job copies drafter/hf_modeling.py beside the weights without importing it (its
    transformers classes cost seconds per job): the file is still one of the job's code inputs."""
    from dflashpipe.codedeps import script_closure

    assert "drafter/hf_modeling.py" in names(script_closure(LIB, REPO / "workflow/scripts/export.py"))


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
    from dflashpipe.codedeps import source_meaning

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

    from dflashpipe.codedeps import meaning_digest

    root = tmp_path / "dflashpipe"
    shutil.copytree(REPO / "workflow" / "dflashpipe", root, ignore=shutil.ignore_patterns("__pycache__"))
    train = root / "drafter" / "train.py"
    files = [str(train), str(root / "drafter" / "step.py")]
    before = meaning_digest(files, root)
    src = train.read_text()
    m = re.search(r'log\(\s*f?"([A-Za-z][^"{]{3,})', src)
    assert m, "train.py logs something"
    train.write_text(src.replace(m.group(1), "Reworded: " + m.group(1), 1) + "\n# a comment\n")
    assert meaning_digest(files, root) == before
    train.write_text(src.replace("== 0", "== 1", 1))
    assert "== 0" in src and meaning_digest(files, root) != before
