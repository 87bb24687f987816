"""Experiment tracking: a real (micro) training run writes TensorBoard events equal to its
metrics CSV, a killed and resumed run shows every step once, and the tracking settings are
operational (no new run, no retrain).

TensorBoard's own reader (EventAccumulator) reads the events back, as the TensorBoard UI does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
from test_train import BASE, again, park_and_kill, quiet, rank_args, read_metrics, spawn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflashpipe.training.checkpoint import run_identity
from dflashpipe.training.train import TrainConfig, train_rank
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.tracking import STEP_GROUPS, tag_for, tracking_dirs


def scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step shown twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def raw_steps(tb_dir: Path, tag: str) -> list[int]:
    """Every event of ``tag`` in the files, purged or not (what the reader has to sort out)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            steps += [ev.step for v in ev.summary.value if v.tag == tag]
    return steps


def test_events_equal_the_metrics_and_a_resumed_run_shows_each_step_once(micro_target, micro_tokenized, tmp_path):
    """6 steps, checkpoints every 2, held-out at 3 and 6. The first launch is SIGKILLed at the
    start of step 6 (checkpoint 4; step 5 lost work); whether or not its step 5 reached the disk,
    a stale step-5 loss is left in its directory, as a launch killed after a flush leaves it. The resumed launch appends to the same
    directory; TensorBoard's reader shows each step once, with the figures of the metrics CSV."""
    cfg = TrainConfig(**BASE, max_steps=6, checkpoint_every=2, eval_every=3)
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv_a", "tb")
    park_and_kill([spawn(a, tmp_path, "tb", [{"at": "train.step", "step": 6, "do": "park"}])], tmp_path, "tb")
    tb_dir, _ = tracking_dirs(a["run"].ckpt_dir)
    assert tb_dir == tmp_path / "run_tb" / "tensorboard" / a["run"].ckpt_dir.name  # keyed like the checkpoints
    assert {1, 2, 3, 4} <= set(scalars(tb_dir)["train/loss"])  # flushed with the checkpoint of step 4 (5: maybe)

    from torch.utils.tensorboard import SummaryWriter

    # event files are read in name order, which starts with the second they were opened in: launches
    # a second apart at least, as real ones are (a launch loads its models first)
    time.sleep(1.1)
    with SummaryWriter(str(tb_dir)) as stale:  # what a launch killed after flushing step 5 leaves
        stale.add_scalar("train/loss", 99.0, 5)

    a = again(a)
    time.sleep(1.1)
    summary = train_rank(**a, log=quiet)
    assert summary["resumed_from_step"] == 4
    assert sorted(p.name for p in tb_dir.iterdir()) == sorted(p.name for p in tb_dir.glob("events.out.tfevents.*"))
    assert raw_steps(tb_dir, "train/loss").count(5) >= 2  # on disk more than once; the resumed launch's purge_step

    got = scalars(tb_dir)
    rows = read_metrics(a["run"].metrics_csv)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    for col in STEP_GROUPS:
        want = {int(r["step"]): float(r[col]) for r in rows if r[col] != ""}
        assert want, col
        have = got[tag_for(col)]
        assert sorted(have) == sorted(want), (col, sorted(have), sorted(want))
        for step, v in want.items():
            assert math.isclose(have[step], v, rel_tol=1e-6, abs_tol=1e-6), (col, step, have[step], v)
    assert sorted(got["heldout/loss"]) == [3, 6] and got["train/loss"][5] != 99.0

    # held-out accuracy per block position (1..block_size-1) at the evaluations; the weighted
    # accuracy is a weighted mean of them
    positions = sorted(t for t in got if t.startswith("heldout/acc_pos"))
    assert positions == [f"heldout/acc_pos{k:02d}" for k in range(1, BASE["block_size"])]
    for step in (3, 6):
        by_pos = [got[t][step] for t in positions]
        assert all(0.0 <= x <= 1.0 for x in by_pos)
        assert min(by_pos) - 1e-6 <= got["heldout/acc"][step] <= max(by_pos) + 1e-6

    # each launch's start, at its first step: the first and the resumed one
    for tag in ("start/first_step_seconds", "start/time_to_first_step_s"):
        assert sorted(got[tag]) == [1, 5] and all(v > 0 for v in got[tag].values())


def test_tracking_settings_are_operational(micro_target, micro_tokenized, tmp_path):
    """Not part of the run identity (the same checkpoints, no retrain), not rule params, not in the
    code digest; with TensorBoard off nothing is written."""
    from conftest import mini_config

    from dflashpipe.config import validate_config
    from dflashpipe.jobs.hotstart import train_step_code_files
    from dflashpipe.jobs.settings import SCHEMA_PATH, result_params

    on = TrainConfig(**BASE, max_steps=1)
    off = dataclasses.replace(on, tensorboard=False, wandb=True, wandb_project="elsewhere")
    assert run_identity(on, str(micro_tokenized), str(micro_target)) == run_identity(off, str(micro_tokenized), str(micro_target))
    cfg = mini_config()
    cfg["train"]["wandb"] = True
    validate_config(cfg, str(SCHEMA_PATH))
    assert cfg["train"]["tensorboard"] is True and {"tensorboard", "wandb", "wandb_project"}.isdisjoint(result_params(cfg, "train"))
    assert not any(f.endswith("jobs/tracking.py") for f in train_step_code_files())

    quiet_cfg = dataclasses.replace(on, tensorboard=False)
    a = rank_args(tmp_path, quiet_cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "off")
    train_rank(**a, log=quiet)
    assert (tmp_path / "run_off" / "metrics.csv").exists() and not (tmp_path / "run_off" / "tensorboard").exists()


def test_wandb_asked_for_but_missing_is_one_line_before_training(micro_target, micro_tokenized, tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    cfg = TrainConfig(**BASE, max_steps=1, wandb=True)
    a = rank_args(tmp_path, cfg, micro_tokenized, micro_target, 0, 1, "rdzv", "wb")
    with pytest.raises(UserError) as e:
        train_rank(**a, log=quiet)
    msg = str(e.value)
    assert "\n" not in msg and "train.wandb" in msg and "pip install wandb" in msg and "train.wandb: false" in msg
    assert not a["run"].ckpt_dir.exists()  # raised before anything started
