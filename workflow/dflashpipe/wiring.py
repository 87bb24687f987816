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

from dflashpipe.evaluate.methods import METHODS, needs_ar_draft
from dflashpipe.inputs.target import write_target_id
from dflashpipe.jobs.codedeps import script_digest
from dflashpipe.jobs.compile_cache import COMPILE_CACHE
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
        # the tiny default target (trained when no target.path is configured)
        self.target_model = f"{r}/target/model"
        self.target_metrics = f"{r}/target/metrics.json"
        # the target's content fingerprint: what the rules read the target through (target.write_target_id)
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

    # -- datasets ---------------------------------------------------------------------
    def repo_path(self, p: str) -> str:
        """A config path: absolute, or relative to the working directory, else to the repository."""
        if os.path.isabs(p) or os.path.exists(p):
            return p
        return str(self.repo / p)  # the repository of the Snakefile (config.repo_path: of the library)

    def datasets_for(self, use: str) -> list[str]:
        return [name for name, spec in self.config["datasets"].items() if spec["use"] == use]

    def dataset_file(self, wildcards) -> list[str]:
        """Input function: the dataset's local file (none for a Hugging Face dataset)."""
        spec = self.config["datasets"][wildcards.dataset]
        return [self.repo_path(spec["path"])] if spec.get("path") else []

    def dataset_spec(self, wildcards) -> dict:
        """Params function: the dataset's config entry, its path resolved."""
        spec = dict(self.config["datasets"][wildcards.dataset])
        if spec.get("path"):
            spec["path"] = self.repo_path(spec["path"])
        return spec

    # -- target and its training data ---------------------------------------------------
    @property
    def builds_tiny_target(self) -> bool:
        return self.config["target"]["path"] is None

    def target_dir(self) -> str:
        """The target model directory: the configured checkpoint, or the tiny default."""
        if not self.builds_tiny_target:
            return self.config["target"]["path"]
        return self.paths.target_model

    def note_target_content(self) -> None:
        """At plan time: the target's fingerprint file, rewritten only when its content changed (a tiny
        target not built yet gets it from its rule)."""
        if self.builds_tiny_target and not os.path.isdir(self.target_dir()):
            return
        write_target_id(self.target_dir(), self.paths.target_id)

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

    def ar_draft_dir(self) -> list[str]:
        """The small AR draft model, when a listed evaluation method needs it."""
        return [self.paths.ar_draft] if self.needs_ar_draft() else []

    @staticmethod
    def method_labels() -> dict[str, str]:
        """The plots' legend label of every evaluation method, in the registry's order."""
        return {m.name: m.label for m in METHODS}

    def eval_summaries(self) -> list[str]:
        return [self.paths.eval_summary(d) for d in self.datasets_for("eval")]

    # -- the default target ---------------------------------------------------------------
    def all_outputs(self) -> list[str]:
        p = self.paths
        out = [p.prompts(name) for name in self.config["datasets"]]
        if self.builds_tiny_target:
            out.append(p.target_metrics)
        out += [p.tokenized, p.tokenized_stats]
        out += self.all_stamps()
        out += [p.train_summary, p.train_metrics, p.train_final, p.drafter]
        out += self.eval_summaries()
        out += [p.plot("tau")]
        return out
