"""Checkpoints of a training run, what makes a run the same run, its resume, its metrics history (with its
experiment tracking) and its published outputs.

A run's checkpoints live in ``run_dir/checkpoints/<key>/``; the key hashes the
run identity (:func:`run_identity`): everything that changes the trained
weights, i.e. the drafter and train settings (operational keys excluded, see
the config schema), the seed, the tokenized data, the target, and the training
code by meaning (the same module closure the compile-warm stamps fingerprint;
comments, docstrings, log messages and where the files sit do not count,
see :func:`dflashpipe.jobs.codedeps.meaning_digest`), the target loader
(``target.py``) and the torch and transformers versions. So an edit of the training code or of a result-changing setting
starts a fresh run, and a killed run of the same code and settings finds its
own directory and resumes. The shard count is not part of the identity: the
optimiser state is saved whole, so a run resumes at any K.

Inside the directory:

* ``identity.json``: the identity, readable;
* ``step{N:07d}.pt``: the last two checkpoints (rank 0, atomic): weights, the
  full AdamW state, the step, the latest figures. A checkpoint that does not
  load (truncated, corrupt) is skipped for the one before it;
* ``metrics.csv``: one row per step, appended as training goes and cut back to
  the checkpoint's step on resume; published as the run's metrics output, so
  the history of a resumed run equals an uninterrupted one's;
* ``complete.json``: written once every rank finished and the outputs were
  published, with the run's summary and its final weights' metadata. A job that
  finds it belongs to a rerun of a FINISHED run (its warm stamps were remade
  after a comment edit or an ``x-compile`` key, its outputs went missing,
  ``--forcerun``): it writes the outputs again from the final checkpoint and
  trains no step (:func:`republish`). Nothing here is ever deleted but the
  checkpoints older than the newest two of the same run; to train a finished
  run again, delete its directory.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from dflashpipe.jobs.atomic import atomic_path, save_safetensors, torch_save, write_json
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.faults import failpoint
from dflashpipe.jobs.tracking import Tracker

from dflashpipe.training.distributed import broadcast_int, full_optimizer_state, gather, peak_mem_mb

METRIC_FIELDS = (
    "step", "epoch", "loss", "acc", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu",
    "step_seconds", "peak_mem_mb", "heldout_loss", "heldout_acc", "heldout_sim_tau",
)  # fmt: skip
KEEP = 2  # checkpoints kept
COMPLETE = "complete.json"  # a finished run (see the module docstring)


def run_identity(cfg, tokenized_dir: str, target_dir: str) -> dict:
    """Everything the trained weights depend on (readable; its hash keys the checkpoint directory)."""
    from dflashpipe.inputs.target import resolve_mask_token, target_fingerprint
    from dflashpipe.jobs.codedeps import module_closure
    from dflashpipe.jobs.hotstart import code_digest, train_step_code_files
    from dflashpipe.jobs.settings import operational_keys

    skip = set(operational_keys("train"))
    state = (Path(tokenized_dir) / "state.json").read_bytes()
    return {
        "train": {k: v for k, v in asdict(cfg).items() if k not in skip},
        "mask_token_id": resolve_mask_token(target_dir, cfg.mask_token_id)[0],  # as decided, not as configured
        "data": hashlib.sha256(state).hexdigest()[:16],
        "target": target_fingerprint(target_dir),
        "code": code_digest(train_step_code_files()),  # by meaning: a reworded log line resumes the run
        # the target's features come from load_target; the libraries' kernels and defaults change numbers
        "target_loader": code_digest(module_closure(Path(__file__).resolve().parents[1],
                                                    [target_fingerprint.__module__])),
        "versions": library_versions(),
    }


def library_versions() -> dict:
    """The versions of the libraries that compute the run (a new torch or transformers starts a new run)."""
    import transformers

    # plain strings (torch's version is a TorchVersion, which a weights_only load refuses)
    return {"torch": str(torch.__version__), "transformers": str(transformers.__version__)}


def checkpoint_dir(run_dir: str, identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return Path(run_dir) / "checkpoints" / key


def _steps(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("step*.pt"))


def start_run(ckpt_dir: Path, identity: dict, log=print) -> None:
    """Rank 0, once it has chosen the checkpoint this run resumes (so the directory is this run's): clear a
    killed writer's leftovers (checkpoints are never deleted here) and write the identity beside them."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for junk in ckpt_dir.glob(".tmp-*"):
        if junk.is_dir():
            shutil.rmtree(junk, ignore_errors=True)
        else:
            junk.unlink(missing_ok=True)
    if (ckpt_dir / COMPLETE).exists():  # finished, but republish could not write its outputs (see there)
        log(f"{ckpt_dir} holds a finished run of the same code and settings: it resumes from its newest checkpoint "
            "that loads")
    write_json(ckpt_dir / "identity.json", identity)


def resume(run, rank: int, log=print) -> dict | None:
    """The newest intact checkpoint of ``run`` (a :class:`~dflashpipe.training.train.TrainRun`), at any K:
    rank 0 chooses it, then clears a killed writer's leftovers, and every other rank loads the same one;
    None: a fresh start."""
    state = None
    if rank == 0:
        state = load_checkpoint(run.ckpt_dir, run.identity, log)
        start_run(run.ckpt_dir, run.identity, log)
    chosen = broadcast_int(state["step"] if state is not None else 0)
    if rank != 0 and chosen:
        state = load_checkpoint(run.ckpt_dir, run.identity, log, step=chosen)
    return state


def publish(r, p, history: MetricsHistory) -> dict:
    """The run's summary; its outputs, written by rank 0 once every rank finished (the metrics history, the
    final weights, the summary): no rank returns before they exist. ``r`` and ``p``: the rank and the
    progress of its loop (:class:`~dflashpipe.training.loop.Rank`, :class:`~dflashpipe.training.loop.Progress`)."""
    run = r.run
    summary = run_summary(r, p)
    if r.rank == 0:
        try:
            failpoint("train.export", rank=r.rank)
            history.close()
            meta = final_metadata(r.dcfg, r.data.total_steps, r.setup.autocast_dtype)
            write_outputs(history.path, r.drafter.state_dict(), meta, summary, metrics_csv=run.metrics_csv,
                          final_state=run.final_state, summary_json=run.summary_json)
            if run.final_state:
                r.log(f"final weights (step {r.data.total_steps}) in {run.final_state}")
        except OSError as err:
            raise UserError(
                f"train: cannot write the run's outputs ({err}); fix that and rerun: the run resumes at its final "
                f"checkpoint in {run.ckpt_dir} and only writes them"
            ) from None
    dist.barrier()  # no rank reports success before the outputs exist
    return summary


def run_summary(r, p) -> dict:
    """The run's summary (the same on every rank; a collective), with each rank's own figures: ``r`` and ``p``,
    the rank and the progress of its loop (:mod:`.loop`)."""
    cfg, setup, data, dev, world_size, last = r.run.cfg, r.setup, r.data, r.setup.device, r.run.world_size, p.last
    steady = p.step_times[1:] or p.step_times  # the first step includes any compile
    steady_tokens = p.step_tokens[1:] or p.step_tokens
    tokens_per_s = (sum(steady_tokens) / sum(steady)) if steady else None
    ranks = gather({
        "rank": r.rank,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "hot_start": p.hot,
        "first_step_seconds": p.first_step_seconds,
        "time_to_first_step_s": (p.t_first_done - p.t_start) if p.t_first_done else None,
        "peak_mem_mb": peak_mem_mb(dev),
        "started_at": p.t_start,
        "finished_at": time.time(),
    })
    return {
        "steps": data.total_steps,
        "epochs": data.total_steps / data.steps_per_epoch,
        "steps_per_epoch": data.steps_per_epoch,
        "global_batch": cfg.batch_size,
        "rank_batch": setup.rank_batch,
        "train_samples": len(data.train_idx),
        "heldout_samples": len(data.heldout_idx),
        "final_loss": last["loss"],
        "final_acc": last["acc"],
        "heldout_loss": last["heldout_loss"],
        "heldout_acc": last["heldout_acc"],
        # expected tau of greedy decoding on the held-out blocks (heldout.py), to set beside the measured one
        "heldout_sim_tau": last.get("heldout_sim_tau"),
        "heldout_accept_by_position": last.get("accept_by_position"),
        "arch": r.dcfg.arch,
        "loss": cfg.loss,
        "position_weights": cfg.position_weights,
        "tokens_per_s": tokens_per_s,  # context tokens of all ranks per second
        "tokens_per_s_per_gpu": tokens_per_s / world_size if tokens_per_s else None,
        "total_seconds": time.time() - p.t_start,
        "world_size": world_size,
        "attention": setup.attention,
        "dtype": "bf16" if setup.autocast_dtype else "fp32",
        "resumed_from_step": p.start_step or None,
        "checkpoint_dir": str(r.run.ckpt_dir),
        "ranks": ranks,
    }


def heldout_code() -> str:
    """The held-out evaluation code by meaning (not part of the run identity, but of the figures in its summary)."""
    from dflashpipe.jobs.codedeps import module_closure
    from dflashpipe.jobs.hotstart import code_digest

    return code_digest(module_closure(Path(__file__).resolve().parents[1], ["training.heldout"]))


def mark_complete(ckpt_dir: Path, summary_json: str, final_state: str) -> None:
    """The run finished and its outputs exist: keep its summary and its final weights' metadata beside the
    checkpoints, so that a rerun writes the outputs again without training (:func:`republish`)."""
    from safetensors import safe_open

    with safe_open(final_state, "pt") as f:
        meta = f.metadata()
    write_json(Path(ckpt_dir) / COMPLETE, {"finished_at": time.time(), "summary": json.loads(Path(summary_json).read_text()),
                                           "final_metadata": meta, "heldout_code": heldout_code()})


def republish(ckpt_dir: Path, identity: dict, metrics_csv: str, summary_json: str, final_state: str,
              log=print) -> dict | None:
    """A finished run's outputs written again, no step trained: the final weights from its final
    checkpoint (the same tensors and metadata), the metrics history and the summary it finished with.
    None (train, or resume) unless ``ckpt_dir`` holds a finished run whose final checkpoint loads; also
    None when the held-out evaluation code changed since: the run then resumes at its final checkpoint,
    which trains no step and evaluates the held-out samples again for the summary."""
    ckpt_dir = Path(ckpt_dir)
    try:
        done = json.loads((ckpt_dir / COMPLETE).read_text())
        summary, meta = done["summary"], done["final_metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (ckpt_dir / "metrics.csv").is_file():
        return None
    if done.get("heldout_code") != heldout_code():
        log(f"{ckpt_dir} holds this run, finished, but the held-out evaluation code changed since: it resumes at "
            "its final checkpoint to evaluate again (no step is trained)")
        return None
    final = ckpt_dir / f"step{int(summary['steps']):07d}.pt"
    state, problem = _load(final)
    if state is None or state.get("identity") != identity:
        log(f"WARNING: {final}: cannot load ({problem or 'another run'}); the finished run resumes from the "
            "checkpoint before it")
        return None
    write_outputs(ckpt_dir / "metrics.csv", state["model"], meta, summary, metrics_csv=metrics_csv,
                  final_state=final_state, summary_json=summary_json)
    log(f"{ckpt_dir} holds this run, finished (step {summary['steps']}): its outputs are written again from there "
        "and no step is trained (delete that directory to train it again)")
    return summary


def save_checkpoint(ckpt_dir: Path, step: int, model_state: dict, optimizer_state: dict, identity: dict,
                    last: dict) -> Path:
    """Rank 0: write step{N:07d}.pt atomically, then keep only the last two."""
    path = ckpt_dir / f"step{step:07d}.pt"
    state = {
        "format": 2,
        "step": step,  # also the data position: batches are a function of the step
        "model": model_state,
        "optimizer": optimizer_state,
        "identity": identity,
        "last": last,
    }
    torch_save(state, path)
    for old in _steps(ckpt_dir)[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def final_metadata(drafter_config, step: int, export_dtype) -> dict:
    """The metadata of the run's final weights, for the export rule: ``drafter_config`` (JSON of
    :class:`~dflashpipe.drafter.model.DrafterConfig`), ``step`` and ``export_dtype`` (the training autocast
    dtype the export casts to; empty: as stored)."""
    return {"drafter_config": json.dumps(drafter_config.to_dict()), "step": str(step),
            "export_dtype": str(export_dtype or "").removeprefix("torch.")}


def write_outputs(history_csv: Path, model_state: dict, meta: dict, summary: dict, *, metrics_csv: str,
                  final_state: str | None, summary_json: str) -> None:
    """The run's outputs, each written atomically, by :func:`publish` after training and by :func:`republish`
    for a finished run: ``metrics_csv`` (a copy of the metrics history ``history_csv``), ``final_state``
    (the final weights ``model_state`` as safetensors with ``meta``, for the export rule,
    export/write.py: export_final; skipped when None) and ``summary_json`` (``summary``)."""
    with atomic_path(metrics_csv) as tmp:
        shutil.copyfile(history_csv, tmp)
    if final_state:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        with atomic_path(final_state) as tmp:
            save_safetensors(state, tmp, metadata=meta)
    write_json(summary_json, summary)


def _load(path: Path) -> tuple[dict | None, str | None]:
    """(the checkpoint, None), or (None, why it does not load). Memory-mapped: K ranks reading one file
    share its pages."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True), None
    except Exception as err:  # noqa: BLE001 - truncated, corrupt or missing
        return None, (str(err).strip().splitlines() or [type(err).__name__])[0][:120]


def load_checkpoint(ckpt_dir: Path, identity: dict, log=print, step: int | None = None) -> dict | None:
    """The newest checkpoint that loads and belongs to this run; None if there is none.

    A checkpoint that does not load is skipped, with a line in the log, for the
    one before it; if none loads, one line names them. ``step``: exactly that
    checkpoint (the one rank 0 chose; the other ranks must load the same).
    """
    paths = [ckpt_dir / f"step{step:07d}.pt"] if step else _steps(ckpt_dir)
    bad = []
    for path in reversed(paths):
        state, detail = _load(path)
        if state is None:  # truncated or corrupt: fall back to the previous one
            if step:
                raise UserError(f"{path}: cannot load ({detail}), although rank 0 resumed from it; rerun") from None
            log(f"WARNING: {path}: cannot load ({detail}); falling back to the checkpoint before it")
            bad.append(path.name)
            continue
        if state.get("identity") != identity:
            theirs = state.get("identity") or {}
            diff = [k for k in sorted(set(theirs) | set(identity)) if theirs.get(k) != identity.get(k)]
            raise UserError(
                f"{path}: written by another run (differs in {', '.join(diff) or 'format'}); "
                f"delete {ckpt_dir} to start over"
            )
        return state
    if bad:
        raise UserError(f"{ckpt_dir}: no checkpoint loads ({', '.join(bad)} are corrupt); delete {ckpt_dir} to start over")
    return None


class MetricsHistory:
    """A rank's record of its run, kept with the checkpoints: the per-step metrics, the experiment tracking
    (TensorBoard / W&B, :class:`~dflashpipe.jobs.tracking.Tracker`) and the checkpoints themselves. Rank 0
    writes; the other ranks take part in the checkpoint's collective and write nothing."""

    def __init__(self, r, resume_step: int):
        """``r``: the rank (:class:`~dflashpipe.training.loop.Rank`: its run, drafter, optimiser and log)."""
        run, writer = r.run, r.rank == 0
        self.path = Path(run.ckpt_dir) / "metrics.csv"
        self.identity = run.identity
        self.drafter, self.opt, self.log = r.drafter, r.opt, r.log
        self._file = None
        if writer:
            self._open(resume_step)
        self.tracker = Tracker(run.ckpt_dir, run.identity, resume_step, enabled=writer, tensorboard=run.cfg.tensorboard,
                               wandb=run.cfg.wandb, wandb_project=run.cfg.wandb_project, log=r.log)

    def _open(self, resume_step: int) -> None:
        """The history cut back to the checkpoint it resumes, open for appending."""
        kept = []
        if resume_step > 0 and self.path.is_file():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= resume_step]
        if [int(r["step"]) for r in kept] != list(range(1, resume_step + 1)):
            self.log(f"WARNING: {self.path} holds {len(kept)} rows for the {resume_step} steps of the checkpoint it "
                     "resumes (a lost write); the published metrics will miss those steps")
        with atomic_path(self.path) as tmp:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")
                w.writeheader()
                w.writerows(kept)
        self._file = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=METRIC_FIELDS, extrasaction="ignore", lineterminator="\n")

    def record(self, row: dict, held: dict | None, start: dict | None, last: dict | None) -> None:
        """Step ``row["step"]``: its metrics row and tracker events (``held``: the held-out figures when the step
        evaluated; ``start``: this launch's start figures at its first step, :meth:`Tracker.log_start`'s
        keywords) and, when ``last`` is given, its checkpoint with those latest figures. Every rank calls it."""
        step = int(row["step"])
        if self._file is not None:
            self._writer.writerow(row)
            self._file.flush()
        if start is not None:
            self.tracker.log_start(step, **start)
        self.tracker.log_step(row, held and held["acc_by_position"], held and held["accept_by_position"])
        if last is None:
            return
        optimizer_state = full_optimizer_state(self.opt)  # a collective: every rank takes part
        if self._file is not None:  # the history and the events on disk first: a resume never finds a gap
            os.fsync(self._file.fileno())
        self.tracker.flush()
        if self._file is not None:
            path = save_checkpoint(self.path.parent, step, self.drafter.state_dict(), optimizer_state, self.identity,
                                   last)
            self.log(f"checkpoint step {step}: {path.name}")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tracker.close()
