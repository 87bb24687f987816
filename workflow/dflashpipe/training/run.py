"""What one training run is: its settings (:class:`TrainConfig`, the config's ``drafter`` and ``train``
sections) and the run itself (:class:`TrainRun`: settings, inputs, outputs, identity, world), built once
by the job and taken whole by :func:`dflashpipe.training.train.train_rank`.

A module of its own: :mod:`.train` builds and runs a rank from it, :mod:`.loop` steps it, and
:mod:`.launch` sends it to the ranks; none of them imports another for it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from dflashpipe.jobs.settings import schema_settings

from dflashpipe.training.checkpoint import checkpoint_dir, run_identity
from dflashpipe.drafter.model import ARCH_FIELDS


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@schema_settings("drafter", "train")
class TrainConfig:
    """The ``drafter`` and ``train`` sections and ``seed``, as one rank takes them: built once by the job
    (:func:`dflashpipe.jobs.settings.settings`), sent to the ranks as JSON. Defaults: the schema's."""

    JOB_KEYS = ("shards", "nodes", "threads")  # the job's rank processes and their threads (scripts/train.py)

    num_layers: int  # drafter layers
    block_size: int
    # the architecture keys (arch, layer_types, sliding_window, the dflash2 keys): declared once, as the
    # DrafterConfig fields of the same names (model.ARCH_FIELDS); handed to it as they are (build)
    __annotations__.update(ARCH_FIELDS)
    num_anchors: int  # N anchors per sequence, padded with keep=False
    target_layer_ids: list[int] | None  # None: default_target_layer_ids(L, num_layers)
    mask_token_id: int | None  # None: tokenizer.mask_token_id, else error
    batch_size: int  # sequences per step, over all ranks (the global batch)
    epochs: float
    max_steps: int | None  # cap (for tests / quick runs)
    lr: float
    warmup_ratio: float
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    loss_chunk_size: int
    checkpoint_every: int  # steps
    eval_every: int  # 0: only at the end
    heldout_samples: int  # deterministic held-out split of the tokenized data (by hash of id), at most this many
    heldout_fraction: float  # ... and at most this share of the samples (data.heldout_size)
    repeat: dict  # training dataset name -> draws of each of its samples per epoch (the mix's weights)
    seed: int
    loss: str  # kl (the target's distribution) | ce (the data's tokens)
    tv_weight: float  # + that multiple of the total variation to the target (or the label)
    position_weights: str  # decay (exp(-(k-1)/gamma), the paper) | dpace
    selector_weight: float  # dflash2: the candidate selector's loss, relative to the token loss
    cache_target_features: bool  # keep the frozen target's outputs per sample for later epochs (small targets)
    target_fp8: bool  # the target's decoder-layer linears in FP8 for its forward (.fp8)
    attention: str  # auto: flex on CUDA, sdpa (dense mask) on CPU
    compile: str  # flex path (CUDA): layers | flex (flex_attention alone) | none (guard stops it)
    activation_memory_budget: float  # < 1: the compiled backward recomputes instead of saving (less memory)
    dtype: str  # auto: bf16 autocast on CUDA with fp32 master weights; fp32 on CPU
    dist_timeout_s: float
    tensorboard: bool  # experiment tracking (dflashpipe.jobs.tracking; operational: not in the run identity)
    wandb: bool
    wandb_project: str


@dataclass(frozen=True)
class TrainRun:
    """One training run, whole: its settings, inputs, outputs, identity and world.

    Built once by the job (``workflow/scripts/train.py``); the launcher adds the identity (computed
    once: every rank keys the same run) and the rendezvous, and sends it to the node launchers and the
    ranks as ONE JSON file (:meth:`to_json`). :func:`~dflashpipe.training.launch.run_training`, its rank
    processes and :func:`train_rank` take it whole (a rank adds its rank and device).
    """

    cfg: TrainConfig  # the drafter and train sections and seed: every setting of the run
    # inputs
    tokenized_dir: str
    target_dir: str
    # outputs
    run_dir: str  # the run's checkpoints (checkpoints/<identity key>/: ckpt_dir) and launch files
    metrics_csv: str
    summary_json: str
    final_state: str | None = None  # the final weights (the export rule writes the drafter from them)
    identity: dict | None = None  # what the weights depend on (checkpoint.run_identity); None: not computed yet
    # world: ranks, their threads and logs, where they meet; the same for every rank
    nodes: int = 1
    shards: int = 1  # ranks per node, one GPU each
    threads: int = 1  # CPU threads per rank
    init_method: str = "env://"  # how the ranks meet (torch.distributed; the launcher's agent sets env://)
    cache_root: str | None = None  # the GPU slots' warm compile caches
    stamps: tuple[str, ...] = ()  # slot k's warm stamp (the hot start of local rank k); empty: none
    rank_logs: tuple[str, ...] = ()
    node_logs: tuple[str, ...] = ()  # the node launchers' (several nodes)
    hosts: tuple[str, ...] = ()  # the allocation's nodes (several nodes)
    master: str | None = None  # the first node's address:port, where the agents meet (several nodes)
    run_id: str | None = None  # one launch: a killed launch's files are never reused

    @property
    def world_size(self) -> int:
        return self.nodes * self.shards

    @property
    def ckpt_dir(self) -> Path:
        if self.identity is None:
            raise ValueError("TrainRun.ckpt_dir: the run has no identity yet (TrainRun.identified)")
        return checkpoint_dir(self.run_dir, self.identity)

    def identified(self) -> TrainRun:
        """This run with its identity (computed here, once, if it has none)."""
        if self.identity is not None:
            return self
        return replace(self, identity=run_identity(self.cfg, self.tokenized_dir, self.target_dir))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainRun:
        values = json.loads(text)
        values["cfg"] = TrainConfig(**values["cfg"])
        tuples = {f.name for f in fields(cls) if str(f.type).startswith("tuple")}
        return cls(**{k: tuple(v) if k in tuples else v for k, v in values.items()})


# ---------------------------------------------------------------------------
# Building: target, drafter, step setup
# ---------------------------------------------------------------------------
