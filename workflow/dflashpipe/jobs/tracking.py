"""Experiment tracking of a drafter run: TensorBoard event files, and W&B (offline) on request.

The train loop (:mod:`dflashpipe.training.train`) hands over the figures it
already computes, at the points where it computes them; this module only
writes them. Only rank 0 writes (the figures are global: all-reduced over the
ranks); the other ranks hold a tracker that does nothing.

One directory per run, keyed like the checkpoints: a run whose checkpoints are
in ``<run dir>/checkpoints/<key>`` writes its events to
``<run dir>/tensorboard/<key>`` (``results/train/tensorboard/<key>`` in the
pipeline), so a resumed run appends to its own directory and a retrain after
an edit gets a new one. A resumed launch opens its writer with
``purge_step = checkpoint step + 1``: TensorBoard's readers then drop what the
killed launch wrote after the checkpoint, and every step is shown once. A run
that starts from step 1 (new, or a finished run trained again) clears its
directory first.

Tags (the metrics CSV's columns, grouped): ``train/{loss, acc, lr, grad_norm,
epoch}``, ``perf/{tokens_per_s, tokens_per_s_per_gpu, step_seconds,
peak_mem_mb}``, ``heldout/{loss, acc}`` and ``heldout/acc_pos{k}`` (top-1
accuracy at block position k), and, once per launch at its first step,
``start/...``: time to the first step, the first step's seconds, and the
hot-start check's priming seconds and compile-cache hits and misses.

W&B (``train.wandb: true``) logs the same figures in offline mode under
``<run dir>/wandb`` (one offline run per launch, grouped and named by the run
key; ``wandb sync`` uploads them; W&B cannot take steps back, so a resumed
launch's run repeats the steps the killed one did after its checkpoint). Nothing here changes what is trained, and
the settings are operational (not part of the run identity).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from dflashpipe.jobs.errors import UserError

#: metrics CSV column -> tag group
STEP_GROUPS = {
    "loss": "train", "acc": "train", "lr": "train", "grad_norm": "train", "epoch": "train",
    "tokens_per_s": "perf", "tokens_per_s_per_gpu": "perf", "step_seconds": "perf", "peak_mem_mb": "perf",
    "heldout_loss": "heldout", "heldout_acc": "heldout", "heldout_sim_tau": "heldout",
}  # fmt: skip


def tag_for(column: str) -> str:
    """The TensorBoard tag of a metrics CSV column (``heldout_acc`` -> ``heldout/acc``)."""
    group = STEP_GROUPS[column]
    return f"{group}/{column.removeprefix(group + '_')}"


def check_available(tensorboard: bool, wandb: bool) -> None:
    """One line, before training starts, when a tracker is asked for (``train.tensorboard``, ``train.wandb``)
    and its package is missing."""
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError(
            "train.tensorboard is true but the tensorboard package is not installed: pip install tensorboard "
            "(the version in requirements.txt), or set train.tensorboard: false"
        )
    if wandb and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "train.wandb is true but the wandb package is not installed: pip install wandb, or set train.wandb: false"
        )


def tracking_dirs(ckpt_dir: str | Path) -> tuple[Path, Path]:
    """(TensorBoard directory of this run, W&B directory of the run dir) for ``<run dir>/checkpoints/<key>``."""
    ckpt_dir = Path(ckpt_dir)
    run_dir = ckpt_dir.parent.parent
    return run_dir / "tensorboard" / ckpt_dir.name, run_dir / "wandb"


def _number(value) -> float | None:
    if value is None or value == "":
        return None
    x = float(value)
    return x if math.isfinite(x) else None


class Tracker:
    """Writes a run's figures (rank 0); ``enabled=False`` (other ranks, tracking off): every call is a no-op.

    ``tensorboard``, ``wandb``, ``wandb_project``: the ``train`` keys of the same names."""

    def __init__(self, ckpt_dir: str | Path, identity: dict, start_step: int, enabled: bool, *, tensorboard: bool,
                 wandb: bool, wandb_project: str, log=print):
        self._tb = self._wandb = None
        self.start_step = start_step
        if not enabled or not (tensorboard or wandb):
            return
        check_available(tensorboard, wandb)
        tb_dir, wandb_dir = tracking_dirs(ckpt_dir)
        key = Path(ckpt_dir).name
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if start_step == 0 and tb_dir.is_dir():  # from step 1: an earlier attempt's events are not this run's
                for old in tb_dir.glob("events.out.tfevents.*"):
                    old.unlink(missing_ok=True)
            tb_dir.mkdir(parents=True, exist_ok=True)
            # purge_step: readers drop the events a killed launch wrote after the checkpoint this one resumes
            self._tb = SummaryWriter(str(tb_dir), purge_step=start_step + 1 if start_step else None)
            if start_step == 0:
                self._tb.add_text("run/identity", f"```\n{json.dumps(identity, indent=2, default=str)}\n```", 0)
            log(f"TensorBoard events: {tb_dir} (tensorboard --logdir {tb_dir.parent})")
        if wandb:
            import wandb as wandb_lib

            wandb_dir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb_lib.init(mode="offline", dir=str(wandb_dir), project=wandb_project, name=key,
                                     group=key, config={"identity": identity, "resumed_from_step": start_step})
            log(f"W&B offline run: {Path(self._wandb.dir).parent} (upload it later with `wandb sync` on that directory)")

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def _write(self, step: int, values: dict) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if self._tb is not None:
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, step)
        if self._wandb is not None and values:
            self._wandb.log(values, step=step)

    def log_step(self, row: dict, acc_by_position: list | None = None, accept_by_position: list | None = None) -> None:
        """One row of the metrics CSV (the figures exactly as written there), and the held-out
        accuracy and conditional acceptance per block position (position 1 first) when this step evaluated."""
        if not self.enabled:
            return
        values = {tag_for(col): _number(row.get(col)) for col in STEP_GROUPS}
        for k, a in enumerate(acc_by_position or [], start=1):
            values[f"heldout/acc_pos{k:02d}"] = _number(a)
        for k, a in enumerate(accept_by_position or [], start=1):
            values[f"heldout/accept_pos{k:02d}"] = _number(a)
        self._write(int(row["step"]), values)

    def log_start(self, step: int, hot: dict | None, first_step_seconds: float | None,
                  time_to_first_step: float | None) -> None:
        """This launch's start: the figures the summary keeps per rank (rank 0's), at its first step."""
        if not self.enabled:
            return
        values = {"start/first_step_seconds": first_step_seconds, "start/time_to_first_step_s": time_to_first_step}
        if hot:
            values["start/prime_seconds"] = hot.get("prime_seconds")
            for name, n in (hot.get("counters") or {}).items():
                values[f"start/{name}"] = n
        self._write(step, values)

    def flush(self) -> None:
        """With each checkpoint: what a resume keeps is on disk."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
