"""The Snakemake workflow's wiring: every path the rules write, and what the rules pass on.

``Paths`` names each output, log and benchmark file once; ``Pipeline`` binds a
prepared config to the rules' input functions and params builders. The rule
files (``workflow/rules/*.smk``) only refer to these by name, so a file name is
spelled in exactly one place.

Only ``workflow/rules/common.smk`` imports this module; no stage script does.
The code param (``codedeps``) follows the stage scripts' imports, so an
edit here reruns no stage: a changed path or param shows up in the plan itself.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from dflashpipe.drafter.files import EXPORT_FILES
from dflashpipe.evaluate.methods import METHODS, needs_ar_draft
from dflashpipe.inputs.target import SAVED_MODEL_FILES, target_fingerprint
from dflashpipe.inputs.tokenize import TOKENIZED_FILES
from dflashpipe.jobs.codedeps import script_digest
from dflashpipe.jobs.compile_cache import COMPILE_CACHE
from dflashpipe.jobs.filedigest import file_digest
from dflashpipe.jobs.settings import canonical, compile_keys, on_server, result_params


class Paths:
    """Every file and folder the pipeline writes, under the results directory.

    Methods with wildcard arguments default to the wildcard itself (``"{dataset}"``),
    so ``paths.prompts()`` is a rule's output pattern and ``paths.prompts("math")``
    one concrete file.
    """

    # Table and figure files by the name the rules use for them (named outputs).
    TABLES = {
        "eval": "eval.csv",
        "positions": "per_position_acceptance.csv",
        "histogram": "acceptance_histogram.csv",
        "training": "training.csv",
        "compile": "compile.csv",
    }
    PLOTS = {
        "tau": "tau_speedup.png",
        "positions": "per_position_acceptance.png",
        "histogram": "acceptance_histogram.png",
        "loss": "training_loss_acc.png",
        "tokens": "training_tokens_per_s.png",
        "compile": "compile_cold_vs_hot.png",
    }

    def __init__(self, results: str):
        r = self.results = results
        # the config the run used, every key (rule effective_config)
        self.effective_config = f"{r}/effective_config.yaml"
        # the tiny default target (trained when no target.path is configured)
        self.target_model = f"{r}/target/model"
        self.target_metrics = f"{r}/target/metrics.json"
        # the target's content fingerprint: what the rules read a configured target through (rule target_id)
        self.target_id = f"{r}/target/fingerprint.json"
        # tokenized training data (one datasets dataset) and its statistics
        self.tokenized = f"{r}/tokenized/train"
        self.tokenized_stats = f"{r}/tokenized/stats.json"
        # compile caches of the warm chain, one folder per GPU slot inside
        self.compile_cache = f"{r}/{COMPILE_CACHE}"
        # the training run: one job writes them all, for any number of shards
        self.train_summary = f"{r}/train/summary.json"
        self.train_metrics = f"{r}/train/metrics.csv"
        # the run's final weights (the train job's), and the export made from them (the export job's)
        self.train_final = f"{r}/train/final.safetensors"
        self.drafter = f"{r}/drafter"
        # the assisted-generation peer's draft model
        self.ar_draft = f"{r}/ar_draft"

    # -- the files of the folders a stage writes as a whole: each is an output of its own, so that a file
    # deleted from the folder makes the job run again (Snakemake dates a directory output by the folder)
    def target_model_files(self) -> list[str]:
        return [f"{self.target_model}/{f}" for f in SAVED_MODEL_FILES]

    def tokenized_files(self) -> list[str]:
        return [f"{self.tokenized}/{f}" for f in TOKENIZED_FILES]

    def drafter_files(self) -> list[str]:
        return [f"{self.drafter}/{f}" for f in EXPORT_FILES]

    def ar_draft_files(self) -> list[str]:
        return [f"{self.ar_draft}/{f}" for f in SAVED_MODEL_FILES]

    # -- stage outputs ----------------------------------------------------------
    def prompts(self, dataset: str = "{dataset}") -> str:
        return f"{self.results}/prompts/{dataset}.parquet"

    def prompts_stats(self, dataset: str = "{dataset}") -> str:
        return f"{self.results}/prompts/{dataset}.stats.json"

    def expanded_shard(self, dataset: str = "{dataset}", shard="{shard}") -> str:
        return f"{self.results}/expanded/{dataset}/shard{shard}.parquet"

    def expanded(self, dataset: str = "{dataset}") -> str:
        return f"{self.results}/expanded/{dataset}.parquet"

    def warm_stamp(self, slot="{slot}") -> str:
        return f"{self.results}/warm/slot{slot}.json"

    def eval_samples(self, dataset: str = "{dataset}") -> str:
        return f"{self.results}/eval/{dataset}.samples.parquet"

    def eval_summary(self, dataset: str = "{dataset}") -> str:
        return f"{self.results}/eval/{dataset}.summary.json"

    def table(self, name: str) -> str:
        return f"{self.results}/tables/{self.TABLES[name]}"

    def plot(self, name: str) -> str:
        return f"{self.results}/plots/{self.PLOTS[name]}"

    # -- logs ---------------------------------------------------------------------
    def log(self, stage: str, name: str) -> str:
        """``logs/<stage>/<name>.log``: one folder per stage."""
        return f"{self.results}/logs/{stage}/{name}.log"

    # -- benchmarks (Snakemake's per-job wall time, memory and I/O) -----------------
    def benchmark(self, name: str) -> str:
        return f"{self.results}/benchmarks/{name}.tsv"


class Pipeline:
    """A prepared (validated, defaults filled) config, seen from the rules."""

    def __init__(self, config: dict, repo: str | os.PathLike):
        self.config = config
        self.repo = Path(repo)
        self.lib = self.repo / "workflow" / "dflashpipe"
        self.scripts = self.repo / "workflow" / "scripts"
        self.paths = Paths(config["results"])
        # the GPU counts, as dflashpipe.config.resolve_gpus filled and checked them
        self.slots = config["gpu"]["slots"]
        self.shards = config["train"]["shards"]  # training ranks per node
        self.nodes = config["train"]["nodes"]
        self.ranks = self.shards * self.nodes

    # -- code params ------------------------------------------------------------------
    def code(self, script: str) -> str:
        """What the stage's script and the library modules it imports (transitively) mean: a param, so
        that a change to them reruns the stage, and a comment, a docstring, a log message or a module's
        move to another folder or name does not (:mod:`dflashpipe.jobs.codedeps`)."""
        return script_digest(self.lib, self.scripts / script)

    # -- datasets (their paths resolved and checked by dflashpipe.config.prepare_config) -------------
    def datasets_for(self, use: str) -> list[str]:
        return [name for name, spec in self.config["datasets"].items() if spec["use"] == use]

    def dataset_file(self, wildcards) -> list[str]:
        """Input function: the dataset's local file (none for a Hugging Face dataset); the rule reads it by
        its content (:meth:`dataset_content`), not by its date."""
        spec = self.config["datasets"][wildcards.dataset]
        return [spec["path"]] if spec.get("path") else []

    def dataset_content(self, wildcards) -> str | None:
        """Params function: the sha256 of the dataset's local file, so that other content reruns its prompts
        and a touch, or the same bytes written again, nothing (read once per file version: filedigest)."""
        spec = self.config["datasets"][wildcards.dataset]
        return file_digest(spec["path"]) if spec.get("path") else None

    def dataset_spec(self, wildcards) -> dict:
        """Params function: the dataset's config entry."""
        return dict(self.config["datasets"][wildcards.dataset])

    # -- target and its training data ---------------------------------------------------
    @property
    def builds_tiny_target(self) -> bool:
        return self.config["target"]["path"] is None

    def target_dir(self) -> str:
        """The target model directory: the configured checkpoint, or the tiny default."""
        if not self.builds_tiny_target:
            return self.config["target"]["path"]
        return self.paths.target_model

    def target_fingerprint(self) -> str:
        """A configured target's content fingerprint, read while the workflow plans (nothing is written: a
        dry run writes nothing): rule target_id's param, so that a content change reruns what reads the
        target, and a touch or the same bytes copied back nothing."""
        return target_fingerprint(self.target_dir())

    def target_inputs(self) -> list[str]:
        """What a rule that reads the target takes as input: the fingerprint file; for the tiny target trained
        here also its files (a file of it deleted or rewritten reruns what reads it)."""
        if self.builds_tiny_target:
            return [self.paths.target_id, *self.paths.target_model_files()]
        return [self.paths.target_id]

    def tiny_target_prompts(self) -> dict:
        tiny = self.config["target"]["tiny"]
        return {
            "train": [self.paths.prompts(n) for n in tiny["train_datasets"]],
            "heldout": self.paths.prompts(tiny["heldout_dataset"]),
        }

    def expanded_shards(self, wildcards) -> list[str]:
        """Input function: the expansion shards of one dataset."""
        n = self.config["expand"]["shards"]
        return [self.paths.expanded_shard(wildcards.dataset, i) for i in range(n)]

    def expanded_train(self) -> list[str]:
        return [self.paths.expanded(n) for n in self.datasets_for("train")]

    # -- params -------------------------------------------------------------------------
    def effective_config(self) -> dict:
        """The whole config as the run uses it (defaults and the tiny target's recipe filled in)."""
        return canonical(self.config)

    def recipe(self) -> dict:
        """What the model card records of the config: the recipe line and the result-changing keys of the
        sections that decide the drafter (an operational key reruns no export)."""
        from dflashpipe.config import recipe_line

        return {"recipe": recipe_line(self.config), "seed": self.config["seed"],
                **{s: self.result_params(s) for s in ("drafter", "train", "expand", "tokenize")}}

    def caveat(self) -> str | None:
        """What the run's figures are not (the tiny target on data off its domain), for the tables and the card."""
        from dflashpipe.config import tiny_target_caveat

        return tiny_target_caveat(self.config)

    def result_params(self, section: str) -> dict:
        """The result-changing keys of a config section (operational ones are read at run time)."""
        return result_params(self.config, section)

    def expand_seed(self) -> int:
        """Sampling seed of the expansion; greedy decoding ignores it, so a new seed reruns nothing."""
        return self.config["seed"] if self.config["expand"]["temperature"] > 0 else 0

    def expand_gpus(self) -> int:
        """GPU slots an expansion job holds: none when an OpenAI-compatible server generates."""
        return 0 if on_server(self.config["expand"]["backend"]) else 1

    def chat_template_kwargs(self) -> dict:
        return canonical(self.config["expand"]["chat_template_kwargs"])

    def compile_settings(self) -> dict:
        """The config that decides compiled code (the warm jobs' params: other keys do not rerun them)."""
        train = self.config["train"]
        return {"drafter": self.result_params("drafter"), "train": {k: train[k] for k in sorted(compile_keys())}}

    @staticmethod
    def torch_version() -> str:
        """Installed torch (without importing it): a new torch invalidates the compile caches."""
        return importlib.metadata.version("torch")

    # -- GPU slots, warm chain, training ---------------------------------------------------
    def previous_stamp(self, wildcards) -> list[str]:
        """Input function: warm_slot{i} waits for warm_slot{i-1}, so no two compiles ever overlap."""
        slot = int(wildcards.slot)
        return [self.paths.warm_stamp(slot - 1)] if slot > 0 else []

    def all_stamps(self) -> list[str]:
        return [self.paths.warm_stamp(i) for i in range(self.slots)]

    def train_threads(self) -> int:
        """CPU threads of the training job: its ranks' on one node (with several nodes, each node's)."""
        return self.shards * self.config["train"]["threads"]

    def train_resources(self) -> dict:
        """The training job's resources: on one node, ``gpu=K`` (``--resources gpu`` counts it; SLURM's
        executor asks for ``--gpus=K``). On N nodes a SLURM allocation of N nodes with ``shards`` GPUs
        each (``--gres=gpu:G``, one task per node) in which the job itself starts the node launchers with
        srun (the executor's ``mpi`` mode; ``tasks_per_gpu: 0`` keeps it from asking tasks per GPU)."""
        if self.nodes == 1:
            return {"gpu": self.shards}
        return {"nodes": self.nodes, "tasks": self.nodes, "mpi": "srun", "gres": f"gpu:{self.shards}", "tasks_per_gpu": 0}

    @staticmethod
    def run_dir(wildcards, output) -> str:
        """Params function: the training run's folder, the one its summary is written to."""
        return os.path.dirname(output.summary)

    def train_rank_logs(self) -> list[str]:
        return [self.paths.log("train", f"rank{k}") for k in range(self.ranks)]

    def train_node_logs(self) -> list[str]:
        """The node launchers' logs of a run on several nodes (none on one: the job is the launcher)."""
        return [self.paths.log("train", f"node{k}") for k in range(self.nodes)] if self.nodes > 1 else []

    # -- evaluation (the methods: dflashpipe.evaluate.methods) ---------------------------------
    def needs_ar_draft(self) -> bool:
        """Whether a listed evaluation method needs the small AR draft (then rule ar_draft trains it)."""
        return needs_ar_draft(self.config["evaluate"]["methods"])

    def ar_draft_files(self) -> list[str]:
        """The small AR draft model's files, when a listed evaluation method needs it."""
        return self.paths.ar_draft_files() if self.needs_ar_draft() else []

    @staticmethod
    def method_labels() -> dict[str, str]:
        """The plots' legend label of every evaluation method, in the registry's order."""
        return {m.name: m.label for m in METHODS}

    def eval_summaries(self) -> list[str]:
        return [self.paths.eval_summary(d) for d in self.datasets_for("eval")]

    # -- the default target ---------------------------------------------------------------
    def all_outputs(self) -> list[str]:
        """Every file a user sees: each one deleted is made again by a plain rerun (with what reads it)."""
        p = self.paths
        out = [p.effective_config]
        out += [f for name in self.config["datasets"] for f in (p.prompts(name), p.prompts_stats(name))]
        if self.builds_tiny_target:
            out += [*p.target_model_files(), p.target_metrics]
        out += [p.expanded(name) for name in self.datasets_for("train")]
        out += [*p.tokenized_files(), p.tokenized_stats]
        out += self.all_stamps()
        out += [p.train_summary, p.train_metrics, p.train_final, *p.drafter_files(), *self.ar_draft_files()]
        out += [f for d in self.datasets_for("eval") for f in (p.eval_summary(d), p.eval_samples(d))]
        out += [p.table(name) for name in p.TABLES] + [p.plot(name) for name in p.PLOTS]
        return out
