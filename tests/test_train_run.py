"""A training run is one object (:class:`~dflashpipe.training.train.TrainRun`), and the step reads its
plain settings from the run's config: the compile signature the warm stamps hold is what it was."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflashpipe.training.step import compile_signature, resolve_setup
from dflashpipe.training.train import TrainConfig

# compile_signature of these setups as the warm jobs wrote it before the step read its settings from the
# config (a change would invalidate the warm stamps of finished runs)
BASE = {"drafter": {"x": 1}, "rank_batch": 2, "num_anchors": 512, "loss_chunk_size": 1024,
        "objective": ["kl", 0.0, 1.0, None], "position_weights": "decay", "selector_weight": 1.0,
        "buckets": [64, 128]}
CPU = dict(BASE, attention="sdpa", compile="none", activation_memory_budget=None, compiled_flex=False, dtype="fp32")
CUDA = dict(BASE, attention="flex", compile="layers", activation_memory_budget=1.0, compiled_flex=True, dtype="bf16")
SIGNATURES = [
    ("cpu", {}, CPU),
    ("cpu", {"arch": "dflash2"}, CPU),
    ("cpu", {"arch": "dspark", "batch_size": 8}, dict(CPU, rank_batch=4, selector_weight=0.0)),
    ("cuda:0", {}, CUDA),
    ("cuda:0", {"arch": "dflash2"}, CUDA),
    ("cuda:0", {"arch": "dspark", "batch_size": 8}, dict(CUDA, rank_batch=4, selector_weight=0.0)),
]


@pytest.mark.parametrize("device,keys,expected", SIGNATURES)
def test_the_compile_signature_is_unchanged(device, keys, expected):
    setup = resolve_setup(TrainConfig(**keys), device, 7, [1, 3, 5], 2)
    got = compile_signature(setup, {"x": 1}, np.array([64, 128, 64]))
    assert json.loads(json.dumps(got)) == expected


def test_a_run_crosses_the_process_boundary_whole():
    """The launcher writes the run once (to_json); a rank reads back the same run (from_json)."""
    from dflashpipe.training.train import TrainRun

    run = TrainRun(TrainConfig(batch_size=8, target_layer_ids=[1, 3]), "tok", "tgt", "runs/a", "m.csv", "s.json",
                   final_state="f.safetensors", identity={"code": "x"}, nodes=2, shards=4, threads=3,
                   stamps=("w0.json", "w1.json"), rank_logs=tuple(f"r{i}.log" for i in range(8)), hosts=("n1", "n2"),
                   master="n1:29500", run_id="abc")
    back = TrainRun.from_json(run.to_json())
    assert back == run and back.world_size == 8 and isinstance(back.stamps, tuple)
    assert back.ckpt_dir == run.ckpt_dir and back.ckpt_dir.parent.as_posix() == "runs/a/checkpoints"
    with pytest.raises(ValueError, match="no identity"):
        TrainRun(TrainConfig(), "tok", "tgt", "runs/a", "m.csv", "s.json").ckpt_dir


def test_the_step_reads_plain_settings_from_the_config():
    """Setup holds what is derived; a train key is read from the config it holds, not from a copy."""
    from dataclasses import fields

    from dflashpipe.training.step import Setup

    cfg = TrainConfig(grad_clip=0.5, num_anchors=16)
    setup = resolve_setup(cfg, "cpu", 7, [1], 1)
    assert setup.cfg is cfg and setup.cfg.grad_clip == 0.5
    copied = {f.name for f in fields(Setup)} & {f.name for f in fields(TrainConfig)}
    # each resolved, not copied: attention (auto), compile (none off the flex path), the MASK id (the
    # tokenizer's when unset), selector_weight (0 but for dflash2)
    assert copied == {"attention", "compile", "mask_token_id", "selector_weight"}
