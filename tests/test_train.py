"""The drafter train loop: K-shard equivalence, kill-and-resume, rendezvous timeout,
feature extraction, data order, and that the loss actually goes down.

Everything is real: a micro Qwen3 target, gloo process groups over file
rendezvous, real subprocesses (and a real SIGKILL).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dflashpipe.drafter.features import context_features
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
from dflashpipe.drafter.train import (
    TrainConfig,
    epoch_batches,
    heldout_split,
    load_checkpoint,
    train_shard,
)
from dflashpipe.errors import UserError

torch.set_num_threads(1)

# Tiny but complete: 1 drafter layer, blocks of 4, 8 anchors per sequence.
BASE = dict(num_layers=1, block_size=4, num_anchors=8, heldout_samples=8, lr=3e-3, seed=0)

# A shard in its own process, as Snakemake runs it. BLOCK_AT > 0: the process
# parks (forever) when train_step is called for the BLOCK_AT-th time, after
# writing a marker, so the test can SIGKILL it at a known point.
RUNNER = r"""
import json, pathlib, sys, time
import torch
torch.set_num_threads(1)
import dflashpipe.drafter.train as T
a = json.loads(sys.argv[1])
block_at, marker = a.pop("block_at", 0), a.pop("marker", None)
if block_at:
    real_step, calls = T.train_step, [0]
    def parked_step(*args, **kw):
        calls[0] += 1
        if calls[0] == block_at:
            pathlib.Path(marker).write_text("parked")
            time.sleep(600)
        return real_step(*args, **kw)
    T.train_step = parked_step
cfg = T.TrainConfig(**a.pop("cfg"))
T.train_shard(cfg, log=lambda m: None, **a)
"""


def shard_args(tmp: Path, cfg: TrainConfig, tokenized, target, rank: int, world_size: int, rdzv: str, tag: str, export: bool):
    return dict(
        cfg=cfg,
        tokenized_dir=str(tokenized),
        target_dir=str(target),
        ckpt_dir=str(tmp / f"ckpt_{tag}"),
        rank=rank,
        world_size=world_size,
        init_method=f"file://{tmp / rdzv}",
        device="cpu",
        metrics_csv=str(tmp / f"metrics_{tag}_r{rank}.csv"),
        summary_json=str(tmp / f"summary_{tag}_r{rank}.json"),
        export_dir=str(tmp / f"export_{tag}") if export else None,
    )


def spawn(args: dict, tmp: Path, name: str, **extra) -> subprocess.Popen:
    payload = dict(args, cfg=asdict(args["cfg"]), **extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    err = open(tmp / f"{name}.stderr", "w")
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(payload)], env=env, stdout=err, stderr=err)


def read_metrics(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def losses(path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(path)}


def quiet(*_a, **_k):
    pass


# -- 1. K=2 shards == K=1 on the union batch ------------------------------------


def test_two_gloo_shards_take_the_same_step_as_one(micro_target, micro_tokenized, tmp_path):
    """Global batch 4: K=1 x batch 4 vs K=2 x batch 2 (two real processes). Same
    parameters after 2 steps within atol 1e-5 (fp32; only summation order differs)."""
    k1 = TrainConfig(**BASE, batch_size=4, max_steps=2)
    k2 = TrainConfig(**BASE, batch_size=2, max_steps=2)
    procs = [
        spawn(shard_args(tmp_path, k2, micro_tokenized, micro_target, r, 2, "rdzv2", "k2", export=r == 0), tmp_path, f"k2_r{r}")
        for r in range(2)
    ]
    train_shard(k1, **{k: v for k, v in shard_args(tmp_path, k1, micro_tokenized, micro_target, 0, 1, "rdzv1", "k1", True).items() if k != "cfg"}, log=quiet)
    for r, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, (tmp_path / f"k2_r{r}.stderr").read_text()[-3000:]

    one, two = load_file(tmp_path / "export_k1" / "model.safetensors"), load_file(tmp_path / "export_k2" / "model.safetensors")
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, f"K=2 differs from K=1 by {worst}"

    # ...and the step was a real one: parameters moved far more than the tolerance.
    from transformers import AutoConfig

    torch.manual_seed(BASE["seed"])
    dcfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(micro_target), 1, 4, 3)
    init = DFlashDrafter(dcfg).state_dict()
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    assert moved > 1e-3

    # Global loss: every rank logs the same number as K=1 (weighted over the union batch).
    l1 = losses(tmp_path / "metrics_k1_r0.csv")
    for r in range(2):
        lr_ = losses(tmp_path / f"metrics_k2_r{r}.csv")
        assert lr_.keys() == l1.keys() == {1, 2}
        assert all(abs(lr_[s] - l1[s]) < 1e-5 for s in l1)
    s = [json.loads((tmp_path / f"summary_k2_r{r}.json").read_text()) for r in range(2)]
    assert [x["rank"] for x in s] == [0, 1] and all(x["world_size"] == 2 and x["steps"] == 2 for x in s)
    assert abs(s[0]["heldout_loss"] - s[1]["heldout_loss"]) < 1e-6  # all-reduced


# -- 2. SIGKILL and resume --------------------------------------------------------


def test_killed_run_resumes_exactly(micro_target, micro_tokenized, tmp_path):
    """checkpoint_every=2, 6 steps. A shard SIGKILLed after step 5 (checkpoint at 4)
    and restarted redoes step 5 and 6 with the uninterrupted run's losses (atol 1e-6)
    and ends with identical weights."""
    cfg = TrainConfig(**BASE, batch_size=4, max_steps=6, checkpoint_every=2)

    def args(tag, rdzv):
        a = shard_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, rdzv, tag, True)
        return a

    # The killed run, in its own process: parks when step 6 starts, then SIGKILL.
    marker = tmp_path / "parked"
    proc = spawn(args("resumed", "rdzv_a"), tmp_path, "killed", block_at=6, marker=str(marker))
    ref = args("ref", "rdzv_ref")
    train_shard(cfg, **{k: v for k, v in ref.items() if k != "cfg"}, log=quiet)  # uninterrupted, meanwhile
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, (tmp_path / "killed.stderr").read_text()[-3000:]
        assert time.time() < deadline, "the shard never reached step 6"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    ck = tmp_path / "ckpt_resumed"
    assert json.loads((ck / "latest.json").read_text())["step"] == 4
    assert sorted(p.name for p in ck.glob("step*.pt")) == ["step0000002.pt", "step0000004.pt"]
    assert sorted(losses(tmp_path / "metrics_resumed_r0.csv")) == [1, 2, 3, 4, 5]  # step 5 is lost work

    # Restart (a fresh rendezvous file: the killed one's is stale).
    res = args("resumed", "rdzv_b")
    summary = train_shard(cfg, **{k: v for k, v in res.items() if k != "cfg"}, log=quiet)
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
    L, R = losses(tmp_path / "metrics_ref_r0.csv"), losses(tmp_path / "metrics_resumed_r0.csv")
    assert sorted(R) == [1, 2, 3, 4, 5, 6]  # row 5 of the killed run was replaced, not duplicated
    assert all(abs(L[s] - R[s]) <= 1e-6 for s in range(1, 7)), (L, R)
    a, b = load_file(tmp_path / "export_ref" / "model.safetensors"), load_file(tmp_path / "export_resumed" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert sorted(p.name for p in ck.glob("step*.pt")) == ["step0000004.pt", "step0000006.pt"]

    # A checkpoint of another run is refused with one line naming the file.
    other = TrainConfig(**{**BASE, "lr": 1e-3}, batch_size=4, max_steps=6, checkpoint_every=2)
    res2 = dict(res, cfg=other, init_method=f"file://{tmp_path / 'rdzv_c'}")
    with pytest.raises(UserError, match=r"step0000006\.pt: written with a different train config.*lr 0\.003 -> 0\.001") as e:
        train_shard(other, **{k: v for k, v in res2.items() if k != "cfg"}, log=quiet)
    assert "\n" not in str(e.value) and "delete" in str(e.value)
    with pytest.raises(UserError, match=r"step0000006\.pt: written by a run with 1 shards, this run has 2"):
        load_checkpoint(ck, cfg, 2, {})
    assert not dist.is_initialized()


# -- 3. a peer that never comes -------------------------------------------------------


def test_missing_peer_is_a_one_line_error(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**BASE, batch_size=2, max_steps=2, dist_timeout_s=3.0)
    a = shard_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 2, "rdzv", "lonely", False)
    t0 = time.time()
    with pytest.raises(UserError) as e:
        train_shard(cfg, **{k: v for k, v in a.items() if k != "cfg"}, log=quiet)
    msg = str(e.value)
    assert time.time() - t0 < 30
    assert "\n" not in msg
    assert "only some of the 2 shards joined" in msg and "timed out after 3 s" in msg
    assert "--resources gpu" in msg and "stale rendezvous file" in msg
    assert not dist.is_initialized()


# -- 4. features: fast path == output_hidden_states ----------------------------------


def test_context_features_fast_path_matches_hidden_states(micro_target):
    from dflashpipe.target import load_target

    target, _ = load_target(str(micro_target))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, target.config.vocab_size, (2, 24), generator=g)
    am = torch.ones_like(ids)
    am[1, 17:] = 0  # right padding
    L = target.config.num_hidden_layers
    assert L == 2
    for layer_ids in ([0, 1], [1, 0], [0], [1]):  # incl. the last layer (post-norm in HF)
        for mask in (am, None):
            fast = context_features(target, ids, mask, layer_ids, path="fast")
            hf = context_features(target, ids, mask, layer_ids, path="hf")
            assert fast.shape == (2, 24, len(layer_ids) * target.config.hidden_size)
            torch.testing.assert_close(fast, hf, atol=1e-6, rtol=0)
    # The fast path runs only the layers it needs and never the LM head.
    called = []
    hooks = [target.model.layers[1].register_forward_hook(lambda *a: called.append("layer1")),
             target.get_output_embeddings().register_forward_hook(lambda *a: called.append("lm_head"))]
    context_features(target, ids, None, [0])
    for h in hooks:
        h.remove()
    assert called == []
    # Right padding: real positions do not depend on the mask.
    torch.testing.assert_close(
        context_features(target, ids, am, [0, 1])[1, :17], context_features(target, ids, None, [0, 1])[1, :17]
    )


# -- 5. data order ------------------------------------------------------------------


def test_data_order_is_deterministic_bucketed_and_disjoint():
    buckets = np.array([128] * 30 + [256] * 21)
    datasets_col = ["d"] * 51
    ids_col = [str(i // 3) for i in range(51)]  # 3 samples per prompt
    train, held = heldout_split(datasets_col, ids_col, 5)
    assert len(held) == 6  # whole prompts: 2 x 3 samples
    assert {ids_col[i] for i in held}.isdisjoint({ids_col[i] for i in train})
    assert (heldout_split(datasets_col, ids_col, 5)[1] == held).all()
    b0 = epoch_batches(buckets, train, seed=0, epoch=0, global_batch=4)
    assert [x.tolist() for x in b0] == [x.tolist() for x in epoch_batches(buckets, train, 0, 0, 4)]
    assert [x.tolist() for x in b0] != [x.tolist() for x in epoch_batches(buckets, train, 0, 1, 4)]
    assert all(len(set(buckets[x].tolist())) == 1 and len(x) == 4 for x in b0)
    flat = np.concatenate(b0)
    assert len(set(flat.tolist())) == len(flat) and not set(flat.tolist()) & set(held.tolist())
    # rank slices of a global batch: disjoint, and their union is the batch
    x = b0[0]
    assert sorted(np.concatenate([x[r * 2 : (r + 1) * 2] for r in range(2)]).tolist()) == sorted(x.tolist())


# -- 6. it learns ------------------------------------------------------------------------


def test_loss_decreases(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**BASE, batch_size=4, max_steps=20, warmup_ratio=0.1, checkpoint_every=100, eval_every=10)
    a = shard_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "learn", True)
    s = train_shard(cfg, **{k: v for k, v in a.items() if k != "cfg"}, log=quiet)
    rows = read_metrics(a["metrics_csv"])
    loss = [float(r["loss"]) for r in rows]
    assert len(loss) == 20
    assert np.mean(loss[-5:]) < np.mean(loss[:3]) - 0.3, loss
    assert s["heldout_loss"] < loss[0] - 0.3  # step 1's loss is the untrained drafter's
    assert [r["step"] for r in rows if r["heldout_loss"]] == ["10", "20"]
    assert s["first_step_seconds"] > 0 and s["tokens_per_s"] > 0 and s["resumed_from_step"] is None
    assert set(rows[0]) >= {"step", "epoch", "loss", "acc", "lr", "grad_norm", "tokens_per_s", "step_seconds", "peak_mem_mb"}
    from dflashpipe.drafter.export import load_drafter

    model, dcfg = load_drafter(a["export_dir"])
    assert dcfg.block_size == 4 and dcfg.num_hidden_layers == 1 and dcfg.mask_token_id == 3
