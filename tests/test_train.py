"""The drafter train loop: K-rank equivalence (global batch), kill-and-resume at the
same and at another K, corrupt checkpoints, rendezvous timeout, feature extraction,
data order, and that the loss actually goes down.

Everything is real: a micro Qwen3 target, gloo process groups over file
rendezvous, DDP + ZeRO, real subprocesses (and a real SIGKILL).
"""

from __future__ import annotations

import csv
import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dflashpipe.training.checkpoint import checkpoint_dir, load_checkpoint, run_identity
from dflashpipe.training.data import epoch_batches, heldout_split, rank_slice
from dflashpipe.drafter.features import context_features
from dflashpipe.drafter.model import DFlashDrafter, DrafterConfig
from dflashpipe.training.train import TrainConfig, TrainRun, train_rank
from dflashpipe.jobs.errors import UserError

torch.set_num_threads(1)

# Tiny but complete: 1 drafter layer, blocks of 4, 8 anchors per sequence; 4 sequences per step.
BASE = dict(num_layers=1, block_size=4, num_anchors=8, heldout_samples=8, lr=3e-3, seed=0, batch_size=4)

# A rank in its own process, as the launcher runs it. Faults (see dflashpipe.jobs.faults) park or kill it.
RUNNER = r"""
import json, sys
import torch
torch.set_num_threads(1)
import dflashpipe.training.train as T
a = json.loads(sys.argv[1])
T.train_rank(T.TrainRun.from_json(a["run"]), a["rank"], a["device"], log=lambda m: None)
"""


def rank_args(tmp: Path, cfg: TrainConfig, tokenized, target, rank: int, world_size: int, rdzv: str, tag: str):
    """train_rank's arguments: the run (its checkpoint dir keyed by the run identity, as in the pipeline),
    the rank and the device."""
    run_dir = tmp / f"run_{tag}"
    run = TrainRun(cfg, str(tokenized), str(target), str(run_dir), metrics_csv=str(run_dir / "metrics.csv"),
                   summary_json=str(run_dir / "summary.json"), final_state=str(run_dir / "final.safetensors"),
                   shards=world_size, init_method=f"file://{tmp / rdzv}")
    return dict(run=run.identified(), rank=rank, device="cpu")


def again(a: dict) -> dict:
    """The same rank arguments, meeting at a fresh rendezvous (a rerun)."""
    return dict(a, run=replace(a["run"], init_method=a["run"].init_method + "_again"))


def spawn(args: dict, tmp: Path, name: str, faults=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if faults:
        env.update(DFLASH_FAULTS=json.dumps(faults), DFLASH_FAULT_MARKER=str(tmp / f"{name}.parked"))
    err = open(tmp / f"{name}.stderr", "w")
    payload = json.dumps(dict(args, run=args["run"].to_json()))
    return subprocess.Popen([sys.executable, "-c", RUNNER, payload], env=env, stdout=err, stderr=err)


def run_ranks(cfg: TrainConfig, tmp: Path, tokenized, target, world_size: int, tag: str, rdzv: str, faults=None):
    """``world_size`` rank processes of one run; returns them (not waited for)."""
    return [spawn(rank_args(tmp, cfg, tokenized, target, r, world_size, rdzv, tag), tmp, f"{tag}_{rdzv}_r{r}", faults)
            for r in range(world_size)]


def wait_ok(procs, tmp: Path, names):
    for p, name in zip(procs, names):
        assert p.wait(timeout=180) == 0, (tmp / f"{name}.stderr").read_text()[-3000:]


def read_metrics(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def losses(path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_metrics(path)}


def weights(run: Path) -> dict:
    return load_file(run / "final.safetensors")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def quiet(*_a, **_k):
    pass


def train_here(cfg, tmp, tokenized, target, tag, rdzv="rdzv"):
    a = rank_args(tmp, cfg, tokenized, target, 0, 1, f"{tag}_{rdzv}", tag)
    return train_rank(**a, log=quiet)


# -- 1. K=2 ranks == K=1 on the same global batch -------------------------------


def test_two_ranks_train_the_same_drafter_as_one(micro_target, micro_tokenized, tmp_path):
    """train.batch_size is global: K=1 and K=2 (two real processes, DDP + ZeRO) see the same
    4 samples per step. Same parameters after 3 steps within atol 1e-5: fp32, only the
    summation order of the gradient (two partial sums vs one) differs, ~1e-7 relative per
    step; a step moves each weight by up to lr = 3e-3, so 1e-5 is far below one step."""
    cfg = TrainConfig(**BASE, max_steps=3)
    procs = run_ranks(cfg, tmp_path, micro_tokenized, micro_target, 2, "k2", "rdzv2")
    train_here(cfg, tmp_path, micro_tokenized, micro_target, "k1")
    wait_ok(procs, tmp_path, ["k2_rdzv2_r0", "k2_rdzv2_r1"])

    one, two = weights(tmp_path / "run_k1"), weights(tmp_path / "run_k2")
    assert max_diff(one, two) < 1e-5

    # ...and the steps were real ones: parameters moved far more than the tolerance.
    from transformers import AutoConfig

    torch.manual_seed(BASE["seed"])
    from dflashpipe.drafter.model import ARCH_KEYS

    dcfg = DrafterConfig.from_target_config(AutoConfig.from_pretrained(micro_target), 1, 4, 3,
                                            **{k: getattr(cfg, k) for k in ARCH_KEYS})
    assert max_diff(one, DFlashDrafter(dcfg).state_dict()) > 1e-3

    # Global loss: the run logs the same numbers at K=1 and K=2 (weighted over the whole batch).
    l1, l2 = losses(tmp_path / "run_k1/metrics.csv"), losses(tmp_path / "run_k2/metrics.csv")
    assert l1.keys() == l2.keys() == {1, 2, 3}
    assert all(abs(l1[s] - l2[s]) < 1e-5 for s in l1)
    s1 = json.loads((tmp_path / "run_k1/summary.json").read_text())
    s2 = json.loads((tmp_path / "run_k2/summary.json").read_text())
    assert (s1["steps"], s1["global_batch"], s1["rank_batch"]) == (3, 4, 4)
    assert (s2["steps"], s2["global_batch"], s2["rank_batch"], s2["world_size"]) == (3, 4, 2, 2)
    assert [r["rank"] for r in s2["ranks"]] == [0, 1]
    assert abs(s1["heldout_loss"] - s2["heldout_loss"]) < 1e-5  # all-reduced over the ranks' held-out shares


def test_batch_size_not_divisible_by_the_ranks_is_one_line(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**{**BASE, "batch_size": 3}, max_steps=1, dist_timeout_s=30)
    procs = run_ranks(cfg, tmp_path, micro_tokenized, micro_target, 2, "odd", "rdzv")
    for r, p in enumerate(procs):
        assert p.wait(timeout=120) != 0
    err = (tmp_path / "odd_rdzv_r0.stderr").read_text()
    assert "train.batch_size (3) is the global batch of a step, split over 2 shards" in err


# -- 2. SIGKILL and resume, at the same K and at another K ----------------------------


def park_and_kill(procs, tmp: Path, marker_name: str):
    marker = tmp / f"{marker_name}.parked"
    deadline = time.time() + 120
    while not marker.exists():
        assert all(p.poll() is None for p in procs), "a rank ended before reaching the fault"
        assert time.time() < deadline, "no rank reached the fault"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)


@pytest.mark.parametrize("before,after", [(1, 1), (2, 1), (1, 2)])
def test_killed_run_resumes_exactly_at_any_shard_count(micro_target, micro_tokenized, tmp_path, before, after):
    """checkpoint_every=2, 6 steps. A run SIGKILLed at the start of step 6 (checkpoint at 4,
    step 5 lost) and restarted, with the same or another number of ranks, redoes step 5 and 6
    with the uninterrupted run's losses and ends with the same weights (fp32; atol 1e-6 at the
    same K, 1e-5 across K, as in test 1). The metrics history has every step once."""
    cfg = TrainConfig(**BASE, max_steps=6, checkpoint_every=2)
    train_here(cfg, tmp_path, micro_tokenized, micro_target, "ref")

    park = [{"at": "train.step", "step": 6, "rank": 0, "do": "park"}]
    procs = run_ranks(cfg, tmp_path, micro_tokenized, micro_target, before, "res", "a", faults=park)
    park_and_kill(procs, tmp_path, "res_a_r0")
    ck = Path(rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "x", "res")["run"].ckpt_dir)
    assert sorted(p.name for p in ck.glob("step*.pt")) == ["step0000002.pt", "step0000004.pt"]
    assert sorted(losses(ck / "metrics.csv")) == [1, 2, 3, 4, 5]  # step 5 is lost work
    assert not (tmp_path / "run_res/summary.json").exists()  # nothing published by a killed run

    wait_ok(run_ranks(cfg, tmp_path, micro_tokenized, micro_target, after, "res", "b"), tmp_path,
            [f"res_b_r{r}" for r in range(after)])
    summary = json.loads((tmp_path / "run_res/summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6 and summary["world_size"] == after
    L, R = losses(tmp_path / "run_ref/metrics.csv"), losses(tmp_path / "run_res/metrics.csv")
    assert sorted(R) == [1, 2, 3, 4, 5, 6]  # row 5 of the killed run was replaced, not duplicated
    tol = 1e-6 if before == after == 1 else 1e-5
    assert all(abs(L[s] - R[s]) <= tol for s in range(1, 7)), (L, R)
    assert max_diff(weights(tmp_path / "run_ref"), weights(tmp_path / "run_res")) <= tol
    assert sorted(p.name for p in ck.glob("step*.pt")) == ["step0000004.pt", "step0000006.pt"]


def test_corrupt_checkpoint_falls_back_to_the_one_before(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**BASE, max_steps=4, checkpoint_every=2)
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "c")
    identity = run_identity(cfg, str(micro_tokenized), str(micro_target))
    park_and_kill([spawn(a, tmp_path, "c", [{"at": "train.step", "step": 4, "do": "park"}])], tmp_path, "c")
    ck = a["run"].ckpt_dir
    intact = (ck / "step0000002.pt").read_bytes()
    (ck / "step0000003.pt").write_bytes(intact[: len(intact) // 2])  # a truncated newer checkpoint

    lines = []
    assert load_checkpoint(ck, identity, log=lines.append)["step"] == 2
    assert "step0000003.pt: cannot load" in lines[0] and "falling back" in lines[0]
    a = again(a)
    summary = train_rank(**a, log=quiet)  # the run resumes from the intact one and finishes
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 4

    with pytest.raises(UserError, match=r"step0000004\.pt: written by another run \(differs in code\)"):
        load_checkpoint(ck, dict(identity, code="0123456789abcdef"), log=quiet)
    for f in ck.glob("step*.pt"):
        f.write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"no checkpoint loads \(step0000004.pt, step0000003.pt are corrupt\); delete"):
        load_checkpoint(ck, identity, log=quiet)


# -- 3. a peer that never comes -------------------------------------------------------


def test_missing_peer_is_a_one_line_error(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**{**BASE, "batch_size": 2}, max_steps=2, dist_timeout_s=3.0)
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 2, "rdzv", "lonely")
    t0 = time.time()
    with pytest.raises(UserError) as e:
        train_rank(**a, log=quiet)
    msg = str(e.value)
    assert time.time() - t0 < 30
    assert "\n" not in msg
    assert "only some of the 2 ranks joined" in msg and "timed out after 3 s" in msg
    assert not dist.is_initialized()


# -- 4. features: fast path == output_hidden_states ----------------------------------


def test_context_features_fast_path_matches_hidden_states(micro_target):
    from dflashpipe.inputs.target import load_target

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


def test_context_features_build_the_causal_mask_once_per_shape(micro_target, monkeypatch):
    """Training passes no attention mask: transformers' mask builder (whose packed-sequence check waits for
    the GPU) runs once per batch shape, and the features are those of a fresh build; a padding mask is
    built every call."""
    from transformers import masking_utils

    from dflashpipe.drafter import features
    from dflashpipe.inputs.target import load_target

    target, _ = load_target(str(micro_target))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, target.config.vocab_size, (2, 24), generator=g)
    fresh = context_features(target, ids, None, [0, 1])  # an empty cache: built as transformers builds it
    assert features._SHAPE_MASKS[target.model]  # this shape's masks (none needed: causal attention) kept
    builds = []
    real = masking_utils.create_causal_mask

    @functools.wraps(real)  # its signature: the mask's caller passes the arguments it names
    def counted(*a, **k):
        builds.append(1)
        return real(*a, **k)

    monkeypatch.setattr(masking_utils, "create_causal_mask", counted)
    for _ in range(3):
        assert torch.equal(context_features(target, ids, None, [0, 1]), fresh)
    assert builds == []
    context_features(target, ids[:, :16], None, [0, 1])  # another shape: built once, then kept
    context_features(target, ids[:, :16], None, [0, 1])
    assert builds == [1]
    am = torch.ones_like(ids)
    am[1, 17:] = 0
    context_features(target, ids, am, [0, 1])
    context_features(target, ids, am, [0, 1])
    assert builds == [1, 1, 1]


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
    assert sorted(np.concatenate([rank_slice(x, r, 2) for r in range(2)]).tolist()) == sorted(x.tolist())
    assert [len(rank_slice(x, r, 4)) for r in range(4)] == [1, 1, 1, 1]


def test_repeat_weighs_a_training_dataset_and_never_holds_out_a_copy(one_rank_group):
    """train.repeat: a dataset's training samples drawn that many times per epoch (more steps per epoch);
    the held-out split is the unweighted one."""
    from types import SimpleNamespace

    from datasets import Dataset

    from dflashpipe.training.data import run_data

    ds = Dataset.from_dict({"dataset": ["math"] * 40 + ["code"] * 20, "id": [str(i) for i in range(60)],
                            "bucket": [128] * 60, "num_loss_tokens": [16] * 60})
    cfg = SimpleNamespace(heldout_samples=6, heldout_fraction=0.1, seed=0, batch_size=4, epochs=1.0, max_steps=None,
                          repeat={}, block_size=4)
    plain = run_data(ds, cfg, pad_id=0, source="t")
    weighed = run_data(ds, SimpleNamespace(**{**vars(cfg), "repeat": {"code": 3}}), pad_id=0, source="t")
    assert (weighed.heldout_idx == plain.heldout_idx).all()
    code = {i for i in plain.train_idx.tolist() if ds[i]["dataset"] == "code"}
    counts = np.bincount(weighed.train_idx, minlength=60)
    assert all(counts[i] == (3 if i in code else 1) for i in plain.train_idx.tolist())
    assert not set(weighed.train_idx.tolist()) & set(plain.heldout_idx.tolist())
    assert weighed.steps_per_epoch == len(weighed.train_idx) // 4 > plain.steps_per_epoch == len(plain.train_idx) // 4


def test_a_run_trains_on_the_samples_long_enough_for_its_blocks(one_rank_group):
    """The tokenized data is every run's (it does not depend on the drafter): a run leaves out the samples
    with fewer than 2 x block_size loss tokens, says how many, and holds out among the rest; none left is one
    line naming the key."""
    from types import SimpleNamespace

    from datasets import Dataset

    from dflashpipe.training.data import run_data
    from dflashpipe.jobs.errors import UserError

    loss = [4, 40] * 30  # every other sample too short for blocks of 8
    ds = Dataset.from_dict({"dataset": ["math"] * 60, "id": [str(i) for i in range(60)], "bucket": [128] * 60,
                            "num_loss_tokens": loss})
    cfg = SimpleNamespace(heldout_samples=3, heldout_fraction=0.5, seed=0, batch_size=4, epochs=1.0, max_steps=None,
                          repeat={}, block_size=8)
    lines = []
    data = run_data(ds, cfg, pad_id=0, source="t", log=lines.append)
    used = set(data.train_idx.tolist()) | set(data.heldout_idx.tolist())
    assert used == {i for i in range(60) if loss[i] >= 16} and len(data.heldout_idx) == 3
    assert lines == ["30 of 60 samples have fewer than 16 loss tokens (2 x drafter.block_size 8): not trained on"]
    assert len(run_data(ds, SimpleNamespace(**{**vars(cfg), "block_size": 2}), pad_id=0, source="t").train_idx) == 57
    with pytest.raises(UserError, match=r"^train: no sample of t has 96 loss tokens \(2 x drafter.block_size 48\)"):
        run_data(ds, SimpleNamespace(**{**vars(cfg), "block_size": 48}), pad_id=0, source="t")


# -- 6. it learns ------------------------------------------------------------------------


def test_loss_decreases(micro_target, micro_tokenized, tmp_path):
    cfg = TrainConfig(**BASE, max_steps=20, warmup_ratio=0.1, checkpoint_every=100, eval_every=10)
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "learn")
    # a run without a hot start (no priming) still makes room for every bucket's compiled graphs: on a GPU
    # a bucket past Dynamo's default limit of 8 would fall back to eager flex_attention, which is refused
    with torch._dynamo.config.patch(recompile_limit=8):
        s = train_rank(**a, log=quiet)
        assert torch._dynamo.config.recompile_limit >= 4 * 1 + 8  # room for (at least) one bucket's graphs
    rows = read_metrics(a["run"].metrics_csv)
    loss = [float(r["loss"]) for r in rows]
    assert len(loss) == 20
    assert np.mean(loss[-5:]) < np.mean(loss[:3]) - 0.3, loss
    assert s["heldout_loss"] < loss[0] - 0.3  # step 1's loss is the untrained drafter's
    assert [r["step"] for r in rows if r["heldout_loss"]] == ["10", "20"]
    assert s["ranks"][0]["first_step_seconds"] > 0 and s["tokens_per_s"] > 0 and s["resumed_from_step"] is None
    assert set(rows[0]) >= {"step", "epoch", "loss", "acc", "lr", "grad_norm", "tokens_per_s", "step_seconds", "peak_mem_mb"}
    from dflashpipe.export.write import export_final, load_drafter

    model, dcfg = load_drafter(export_final(a["run"].final_state, micro_target, tmp_path / "drafter", log=quiet))
    assert dcfg.block_size == 4 and dcfg.num_hidden_layers == 1 and dcfg.mask_token_id == 3


# -- 7. the target's outputs, kept across epochs -----------------------------------------


def test_cached_target_outputs_train_the_same_drafter_with_fewer_target_forwards(micro_target, micro_tokenized,
                                                                                  tmp_path, monkeypatch):
    """train.cache_target_features: from the second epoch on, the target's features come from the cache;
    the drafter, every loss and the held-out figures stay the same bit for bit (so the key reruns nothing)."""
    import dflashpipe.training.step as step

    calls = []
    real = step.context_features

    def counting(target, input_ids, *a, **k):
        calls.append(input_ids.shape[0])
        return real(target, input_ids, *a, **k)

    monkeypatch.setattr(step, "context_features", counting)
    runs = {}
    for cache in (False, True):
        calls.clear()
        cfg = TrainConfig(**{**BASE, "loss": "kl"}, epochs=2.5, checkpoint_every=100, cache_target_features=cache)
        a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, f"rdzv{cache}", f"cache{cache}")
        s = train_rank(**a, log=quiet)
        runs[cache] = (weights(Path(a["run"].final_state).parent), read_metrics(a["run"].metrics_csv), s, len(calls))
    (w0, m0, s0, n0), (w1, m1, s1, n1) = runs[False], runs[True]
    steps = len(m0)
    assert steps >= 4 and s0["heldout_loss"] == s1["heldout_loss"]
    assert max_diff(w0, w1) == 0.0 and [r["loss"] for r in m0] == [r["loss"] for r in m1]
    assert n0 > steps and n1 <= n0 - steps // 2  # the later epochs' batches ran no target forward


def test_the_target_cache_stops_growing_at_its_memory_limit():
    from dflashpipe.drafter.features import TargetCache

    cache, runs = TargetCache(max_bytes=2 * 4 * 16 * 4), []  # room for two batches of 4 rows of 16 floats

    def compute(batch):
        def run():
            runs.append(batch)
            return torch.full((4, 16), float(batch)), None
        return run

    for b in range(3):
        feats, _ = cache.outputs(tuple(range(4 * b, 4 * b + 4)), compute(b))
        assert feats[0, 0].item() == b
    assert len(cache) == 8 and cache.nbytes == 2 * 4 * 16 * 4  # the third batch ran but was not kept
    for b in range(3):
        assert cache.outputs(tuple(range(4 * b, 4 * b + 4)), compute(b))[0][0, 0].item() == b
    assert runs == [0, 1, 2, 2]  # read back: the two kept batches; run again: the third


def test_the_target_cache_is_off_with_more_than_one_rank_and_says_so():
    """With K ranks a sample goes to another rank in a later epoch: all ranks held their batch in 60% of the
    steps at K=2 and 20% at K=4 (simulated on the default run), while every rank cached nearly all samples."""
    from dflashpipe.training.step import resolve_setup, target_cache_off

    cfg = TrainConfig(**BASE, cache_target_features=True)
    assert resolve_setup(cfg, "cpu", 3, [0], world_size=1).target_cache is not None and not target_cache_off(cfg, 1)
    assert resolve_setup(cfg, "cpu", 3, [0], world_size=2).target_cache is None
    assert target_cache_off(cfg, 2).startswith("train.cache_target_features: off with 2 ranks: a sample goes to another")
    assert target_cache_off(TrainConfig(**BASE), 2) is None  # not asked for: nothing to say


# -- 8. the gradient clip inside a fused AdamW -------------------------------------


def test_fused_adamw_clips_in_its_step_as_clip_grad_norm_does(micro_target, micro_tokenized, tmp_path, monkeypatch):
    """A fused AdamW (CUDA's) takes the gradient clip as its grad_scale instead of a rescaling pass
    (distributed.clip_and_step): the same run as clip_grad_norm_ then the step, to rounding, over steps the
    clip scales and steps it leaves alone. Fused AdamW runs on the CPU too, so both paths run here."""
    import dflashpipe.training.distributed as distributed
    import dflashpipe.training.step as step

    def plain(opt, params, max_norm):  # the step before: rescale the gradients in memory, then step
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        return norm

    monkeypatch.setattr(distributed, "_kernel", lambda device: {"fused": True})
    cfg = TrainConfig(**{**BASE, "loss": "kl"}, epochs=2, checkpoint_every=100, grad_clip=0.5)
    runs = {}
    for name, fn in (("plain", plain), ("in_step", distributed.clip_and_step)):
        monkeypatch.setattr(step, "clip_and_step", fn)
        a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, f"rdzv_{name}", name)
        train_rank(**a, log=quiet)
        runs[name] = (weights(Path(a["run"].final_state).parent), read_metrics(a["run"].metrics_csv))
    (w0, m0), (w1, m1) = runs["plain"], runs["in_step"]
    assert len(m0) == len(m1) >= 4
    clipped = [float(r["grad_norm"]) > cfg.grad_clip for r in m0]
    assert 3 <= sum(clipped) <= len(m0) - 3  # both kinds of step
    for r0, r1 in zip(m0, m1):
        assert float(r1["loss"]) == pytest.approx(float(r0["loss"]), rel=1e-4)
        assert float(r1["grad_norm"]) == pytest.approx(float(r0["grad_norm"]), rel=1e-4)
    assert max_diff(w0, w1) < 1e-5
