"""A training run is one object (:class:`~dflashpipe.drafter.train.TrainRun`), and the step reads its
plain settings from the run's config: the compile signature the warm stamps hold is what it was."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflashpipe.drafter.step import compile_signature, resolve_setup
from dflashpipe.drafter.train import TrainConfig

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
