"""Shared fixtures: a mini config for real Snakemake runs, and a micro target model."""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "resources" / "prompts"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# Small enough to train in seconds on one CPU thread, big enough to be a real Qwen3.
MICRO_TINY = {
    "threads": 1,
    "train_datasets": ["math"],
    "heldout_dataset": "math_heldout",
    "vocab_size": 400,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "seq_len": 128,
    "batch_size": 4,
    "lr": 0.003,
    "warmup_steps": 2,
    "max_steps": 8,
    "max_minutes": 2.0,
    "eval_every": 4,
    "eval_rows": 4,
    "format_check_prompts": 2,
}


def mini_config(results: str = "results") -> dict:
    return {
        "results": results,
        "threads": 1,
        "target": {"path": None, "tiny": copy.deepcopy(MICRO_TINY)},
        "datasets": {
            "math": {"path": str(PROMPTS / "math_train.jsonl.gz"), "messages_column": "messages", "limit": 48},
            "code": {"path": str(PROMPTS / "code_train.jsonl.gz"), "messages_column": "messages", "limit": 16},
            "math_heldout": {"path": str(PROMPTS / "math_heldout.jsonl.gz"), "messages_column": "messages", "use": "eval", "limit": 8},
        },
        "expand": {"max_new_tokens": 40, "batch_size": 16, "chunk_size": 16, "threads": 1, "temperature": 1.0},
        "tokenize": {"buckets": [128, 256]},
        "gpu": {"slots": 2},
        "drafter": {"block_size": 4, "num_layers": 1},
        "train": {"shards": 2, "num_anchors": 8, "batch_size": 4, "max_steps": 6, "checkpoint_every": 2, "heldout_samples": 4, "dist_timeout_s": 120},
        "evaluate": {"num_prompts": 2, "max_new_tokens": 12, "threads": 1,  # every method, the assisted peer's
                     "methods": ["dflash", "ar", "hf_generate", "prompt_lookup", "assisted"],  # AR draft included
                     "concurrency": []},  # the speed-up under load: tests/test_concurrency_rule.py turns it on
        "ar_draft": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                     "intermediate_size": 64, "seq_len": 64, "batch_size": 2, "max_steps": 4, "threads": 1},
    }


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def snakemake_cmd(workdir: Path, *args: str, snakefile: Path | None = None) -> list[str]:
    """``snakefile``: another checkout's (:func:`copy_checkout`); this checkout's by default."""
    return [sys.executable, "-m", "snakemake", "-s", str(snakefile or REPO / "Snakefile"), "-d", str(workdir), *args]


def snakemake_env(**extra: str) -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **extra)


def snakemake(workdir: Path, *args: str, timeout: int = 600, env: dict | None = None,
              snakefile: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real workflow in a subprocess (isolates cwd and global state)."""
    return subprocess.run(snakemake_cmd(workdir, *args, snakefile=snakefile), cwd=workdir, env=env or snakemake_env(),
                          capture_output=True, text=True, timeout=timeout)


def sha256(path: Path) -> str:
    """A file's content digest: what "the same bytes" and "nothing lost" compare."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_jsonl_gz(path: Path, n: int) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory) -> Path:
    """A real (micro) Qwen3 target directory trained by the library, shared by the session."""
    from dflashpipe.inputs.tiny_target import TinyTargetConfig, train_tiny_target

    out = tmp_path_factory.mktemp("target")
    chats = [r["messages"] for r in read_jsonl_gz(PROMPTS / "math_train.jsonl.gz", 48)]
    held = [r["messages"] for r in read_jsonl_gz(PROMPTS / "math_heldout.jsonl.gz", 4)]
    params = {k: v for k, v in MICRO_TINY.items() if k not in ("threads", "train_datasets", "heldout_dataset")}
    train_tiny_target(chats, held, TinyTargetConfig(**params), str(out / "model"), str(out / "metrics.json"), log=lambda m: None)
    return out / "model"


@pytest.fixture(scope="session")
def random_target(micro_target, tmp_path_factory) -> Path:
    """The micro target's config and tokenizer with seeded random weights (std 0.5): its greedy replies
    vary from token to token (the trained micro target mostly repeats one token)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("random_target") / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(micro_target))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(micro_target).save_pretrained(out)
    shutil.copy(micro_target / "generation_config.json", out / "generation_config.json")
    return out


def planned_rules(workdir: Path, *args: str, snakefile: Path | None = None) -> dict[str, int]:
    """Rules (and job counts) a dry run would execute: {} when nothing is to be done."""
    res = snakemake(workdir, *args, "-n", "--quiet", "rules", snakefile=snakefile)
    assert res.returncode == 0, res.stderr[-3000:]
    out = (res.stdout + res.stderr).splitlines()
    if "Job stats:" not in out:
        return {}
    rows = out[out.index("Job stats:") + 3 :]
    jobs = {}
    for line in rows:
        name, count = line.split()
        if name == "total":
            break
        jobs[name] = int(count)
    return jobs


MICRO_BUCKETS = [200, 256]


def build_tokenized(target_dir: Path, out_dir: Path, n_rows: int = 64, buckets=tuple(MICRO_BUCKETS), min_loss: int = 8) -> Path:
    """A tokenized dataset in the format of ``dflashpipe.inputs.tokenize`` from the shipped math chats."""
    import datasets

    from dflashpipe.inputs.tokenize import bucket_for, encode_chat
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    buckets = sorted(buckets)
    records = []
    for r in read_jsonl_gz(PROMPTS / "math_train.jsonl.gz", n_rows):
        ids, mask, _ = encode_chat(tok, r["messages"], buckets[-1])
        if sum(mask) < min_loss:
            continue
        records.append({"dataset": "math", "id": str(r["id"]), "sample": 0, "input_ids": ids, "loss_mask": mask,
                        "length": len(ids), "num_loss_tokens": sum(mask), "bucket": bucket_for(len(ids), buckets)})
    features = datasets.Features({
        "dataset": datasets.Value("string"), "id": datasets.Value("string"), "sample": datasets.Value("int32"),
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "length": datasets.Value("int32"), "num_loss_tokens": datasets.Value("int32"), "bucket": datasets.Value("int32"),
    })
    datasets.Dataset.from_list(records, features=features).save_to_disk(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def micro_tokenized(micro_target, tmp_path_factory) -> Path:
    """~60 math chats tokenized with the micro target's tokenizer (buckets 200/256, both used)."""
    return build_tokenized(micro_target, tmp_path_factory.mktemp("tokenized") / "train")


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory):
    """ONE real run of the whole workflow on the mini config (2 CPU slots, K=2 shards); tests share it."""
    work = tmp_path_factory.mktemp("wf")
    cfg = write_config(work / "config.yaml", mini_config())
    res = snakemake(work, "--cores", "2", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work, cfg


@pytest.fixture
def mini_copy(mini_run, tmp_path):
    """A private copy of the mini run (results and Snakemake metadata) for tests that change it."""
    import shutil

    work, _ = mini_run
    dst = tmp_path / "wf"
    shutil.copytree(work, dst, symlinks=True)
    cfg = dst / "config.yaml"
    return dst, cfg


# appended to a module: a change of what it means (a new module-level name), which the code digests see
EDIT_MARK = "_EDITED_BY_A_TEST"  # in every edit planned_after_edit makes
CODE_EDIT = f"\n{EDIT_MARK} = 1\n"

CHECKOUT = ("Snakefile", "workflow", "profiles", "envs", "config")


def copy_checkout(dst: Path) -> Path:
    """The workflow's files of this checkout (dates kept) in ``dst``, and a link to its ``resources``: a checkout
    of its own to edit. Tests edit copies, never this checkout: a test running beside them (``pytest -n``) plans
    with the code as it is."""
    import shutil

    dst.mkdir(parents=True)
    for item in CHECKOUT:
        src = REPO / item
        (shutil.copytree(src, dst / item, ignore=shutil.ignore_patterns("__pycache__"))
         if src.is_dir() else shutil.copy2(src, dst / item))
    (dst / "resources").symlink_to(REPO / "resources")
    return dst


def edits_left_behind(root: Path) -> list[Path]:
    """The files under ``root`` that hold an edit of :data:`EDIT_MARK` (one a test left in a checkout)."""
    return sorted(p for p in root.rglob("*.py") if EDIT_MARK in p.read_text(errors="replace"))


def pytest_sessionstart(session):
    left = edits_left_behind(REPO / "workflow")
    if left:
        raise pytest.UsageError(f"{left[0]}: holds a test's edit ({EDIT_MARK}); tests edit copies of the checkout "
                                f"only: restore it (git checkout -- {left[0].relative_to(REPO)}) and run again")


def planned_after_edit(workdir: Path, cfg: Path, module: str, edit: str = CODE_EDIT) -> set[str]:
    """Rules a dry run would execute after appending ``edit`` (a new statement unless told; it must hold
    :data:`EDIT_MARK`) to a library module, or to a workflow script for ``module="../scripts/x.py"``, in a
    copy of the checkout (:func:`copy_checkout`, beside ``workdir``) whose Snakefile plans the run."""
    assert EDIT_MARK in edit, edit
    checkout = copy_checkout(workdir.parent / f"checkout-{uuid.uuid4().hex[:8]}")
    path = checkout / "workflow" / "dflashpipe" / module
    path.write_text(path.read_text() + edit)
    return set(planned_rules(workdir, "--configfile", str(cfg), snakefile=checkout / "Snakefile"))


@pytest.fixture
def one_rank_group(tmp_path):
    """A torch.distributed group of one rank (gloo): what the training code's collectives need."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / uuid.uuid4().hex}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
