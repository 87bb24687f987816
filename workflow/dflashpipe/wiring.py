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

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from dflashpipe.export.files import EXPORT_FILES
from dflashpipe.evaluate.methods import METHODS, needs_ar_draft
from dflashpipe.inputs.target import SAVED_MODEL_FILES, target_fingerprint
from dflashpipe.inputs.tokenized import TOKENIZED_FILES
from dflashpipe.jobs.codedeps import script_digest
from dflashpipe.jobs.compile_cache import COMPILE_CACHE
from dflashpipe.jobs.filedigest import file_digest
from dflashpipe.jobs.settings import (canonical, compile_keys, expansion_seed, keys_marked, on_server, result_params,
                                      run_config)


class Paths:
    """Every file and folder the pipeline writes, under the results directory.

    Methods with wildcard arguments default to the wildcard itself (``"{dataset}"``),
    so ``paths.prompts()`` is a rule's output pattern and ``paths.prompts("math")``
    one concrete file.
    """

    # Table and figure files by the name the rules use for them (named outputs).
    TABLES = {
        "eval": "eval.csv",
        "groups": "eval_groups.csv",
        "positions": "per_position_acceptance.csv",
        "histogram": "acceptance_histogram.csv",
        "training": "training.csv",
        "compile": "compile.csv",
    }
    PLOTS = {
        "tau": "tau_speedup.png",
        "groups": "eval_groups.png",
        "positions": "per_position_acceptance.png",
        "histogram": "acceptance_histogram.png",
        "loss": "training_loss_acc.png",
        "tokens": "training_tokens_per_s.png",
        "compile": "compile_cold_vs_hot.png",
    }

    def __init__(self, results: str, runs: bool = False):
        r = self.results = results
        # a drafter run's folder: the results folder itself, or results/runs/<run> with named runs (config `runs`)
        self.runs = runs
        rr = self.run_root = f"{r}/runs/{{run}}" if runs else r
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
        # a draft vocabulary of n tokens from the tokenized data (evaluate.draft_vocab; rule draft_vocab)
        self.draft_vocab = f"{r}/tokenized/draft_vocab_{{n}}.json"
        # compile caches of the warm chain, one folder per GPU slot inside
        self.compile_cache = f"{r}/{COMPILE_CACHE}"
        # the training run: one job writes them all, for any number of shards
        self.train_summary = f"{rr}/train/summary.json"
        self.train_metrics = f"{rr}/train/metrics.csv"
        # the run's final weights (the train job's), and the export made from them (the export job's)
        self.train_final = f"{rr}/train/final.safetensors"
        self.drafter = f"{rr}/drafter"
        # the speed-up under load (evaluate.concurrency): every eval set's table and plot, per run
        self.concurrency_table = f"{rr}/tables/concurrency.csv"
        self.concurrency_plot = f"{rr}/plots/concurrency.png"
        # the named runs side by side (rule compare; with named runs only)
        # and the same per user turn and per category of the eval sets that have them
        self.compare = {"runs": f"{r}/tables/runs.csv", "recipes": f"{r}/tables/recipes.csv", "plot": f"{r}/plots/runs.png",
                        "runs_groups": f"{r}/tables/runs_groups.csv", "recipes_groups": f"{r}/tables/recipes_groups.csv",
                        "groups_plot": f"{r}/plots/runs_groups.png"}
        # the assisted-generation peer's draft model (with named runs, one per ar_draft settings and seed)
        self.ar_draft = f"{r}/ar_draft/{{ardraft}}" if runs else f"{r}/ar_draft"

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

    def warm_stamp(self, slot="{slot}", signature="{signature}") -> str:
        """A warm job's stamp; with named runs, one chain per compile signature (runs that compile the same
        code share it)."""
        return f"{self.results}/warm/{signature}/slot{slot}.json" if self.runs else f"{self.results}/warm/slot{slot}.json"

    def eval_samples(self, dataset: str = "{dataset}") -> str:
        return f"{self.run_root}/eval/{dataset}.samples.parquet"

    def eval_summary(self, dataset: str = "{dataset}") -> str:
        return f"{self.run_root}/eval/{dataset}.summary.json"

    def eval_concurrency(self, dataset: str = "{dataset}") -> str:
        return f"{self.run_root}/eval/{dataset}.concurrency.json"

    def table(self, name: str) -> str:
        return f"{self.run_root}/tables/{self.TABLES[name]}"

    def plot(self, name: str) -> str:
        return f"{self.run_root}/plots/{self.PLOTS[name]}"

    # -- logs ---------------------------------------------------------------------
    def log(self, stage: str, name: str) -> str:
        """``logs/<stage>/<name>.log``: one folder per stage."""
        return f"{self.results}/logs/{stage}/{name}.log"

    def run_log(self, stage: str, name: str) -> str:
        """A drafter run's job's log: in the run's folder (:meth:`log` with one run)."""
        return f"{self.run_root}/logs/{stage}/{name}.log"

    # -- benchmarks (Snakemake's per-job wall time, memory and I/O) -----------------
    def benchmark(self, name: str) -> str:
        return f"{self.results}/benchmarks/{name}.tsv"

    def run_benchmark(self, name: str) -> str:
        return f"{self.run_root}/benchmarks/{name}.tsv"

    @staticmethod
    def of_run(path: str, run: str | None, **wildcards) -> str:
        """``path`` (a pattern) for one run (and other wildcards given by name)."""
        for key, value in {"run": run, **wildcards}.items():
            if value is not None:
                path = path.replace(f"{{{key}}}", str(value))
        return path


class Pipeline:
    """A prepared (validated, defaults filled) config, seen from the rules."""

    def __init__(self, config: dict, repo: str | os.PathLike):
        self.config = config
        self.repo = Path(repo)
        self.lib = self.repo / "workflow" / "dflashpipe"
        self.scripts = self.repo / "workflow" / "scripts"
        self.paths = Paths(config["results"], runs=bool(config["runs"]))
        # the drafter runs (config `runs`); None: the one run of a config without them
        self.run_names = list(config["runs"]) or [None]
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

    def recipe(self, wildcards=None) -> dict:
        """Params function: what the model card records of a run's config: the recipe line and the
        result-changing keys of the sections that decide the drafter (an operational key reruns no export)."""
        from dflashpipe.config import recipe_line

        cfg = self.run_cfg(self._run(wildcards))
        return {"recipe": recipe_line(cfg), "seed": cfg["seed"],
                **{s: result_params(cfg, s) for s in ("drafter", "train", "expand", "tokenize")}}

    def caveat(self) -> str | None:
        """What the run's figures are not (the tiny target on data off its domain), for the tables and the card."""
        from dflashpipe.config import tiny_target_caveat

        return tiny_target_caveat(self.config)

    def result_params(self, section: str) -> dict:
        """The result-changing keys of a config section (operational ones are read at run time)."""
        return result_params(self.config, section)

    # -- drafter runs (config `runs`: each an overlay; the per-run rules take a {run} wildcard) ------------
    @staticmethod
    def _run(wildcards) -> str | None:
        return getattr(wildcards, "run", None)

    def run_cfg(self, run: str | None) -> dict:
        return run_config(self.config, run)

    def run_params(self, section: str):
        """Params function: a run's result-changing keys of ``section``."""
        return lambda wildcards: result_params(self.run_cfg(self._run(wildcards)), section)

    def run_seed(self, wildcards) -> int:
        """Params function: a run's seed."""
        return self.run_cfg(self._run(wildcards))["seed"]

    def run_threads(self, section: str):
        """Threads function: a run's ``<section>.threads``."""
        return lambda wildcards: self.run_cfg(self._run(wildcards))[section]["threads"]

    def expand_seed(self) -> int:
        """Sampling seed of the expansion (:func:`~dflashpipe.jobs.settings.expansion_seed`)."""
        return expansion_seed(self.config)

    def expand_gpus(self) -> int:
        """GPU slots an expansion job holds: none when an OpenAI-compatible server generates."""
        return 0 if on_server(self.config["expand"]["backend"]) else 1

    def chat_template_kwargs(self) -> dict:
        return canonical(self.config["expand"]["chat_template_kwargs"])

    def compile_settings(self, run: str | None = None) -> dict:
        """The config that decides a run's compiled code (the warm jobs' params: other keys do not rerun them)."""
        cfg = self.run_cfg(run)
        return {"drafter": result_params(cfg, "drafter"), "train": {k: cfg["train"][k] for k in sorted(compile_keys())}}

    def signature(self, run: str | None) -> str:
        """A run's compile signature: runs with the same one share a warm chain."""
        return hashlib.sha256(json.dumps(self.compile_settings(run), sort_keys=True).encode()).hexdigest()[:12]

    def signatures(self) -> dict[str, str]:
        """Each compile signature of the runs and the first run that has it, in the warm chain's order."""
        out = {}
        for run in self.run_names:
            out.setdefault(self.signature(run), run)
        return dict(sorted(out.items()))

    def warm_compile(self, wildcards) -> dict:
        """Params function: the compile settings of a warm job's chain."""
        return self.compile_settings(self.signatures()[wildcards.signature] if self.paths.runs else None)

    @staticmethod
    def torch_version() -> str:
        """Installed torch (without importing it): a new torch invalidates the compile caches."""
        return importlib.metadata.version("torch")

    # -- GPU slots, warm chain, training ---------------------------------------------------
    def warm_log(self, kind: str) -> str:
        """A warm job's log (``kind`` log) or benchmark file: one per slot (and compile signature)."""
        name = "{signature}.slot{slot}" if self.paths.runs else "slot{slot}"
        return self.paths.log("warm", name) if kind == "log" else self.paths.benchmark(f"warm_{name}")

    def _chain(self) -> list[tuple[str | None, int]]:
        """Every warm job: the slots of each compile signature (one signature with one run)."""
        signatures = list(self.signatures()) if self.paths.runs else [None]
        return [(sig, slot) for sig in signatures for slot in range(self.slots)]

    def _stamp(self, sig: str | None, slot: int) -> str:
        return self.paths.warm_stamp(slot, sig) if sig else self.paths.warm_stamp(slot)

    def previous_stamp(self, wildcards) -> list[str]:
        """Input function: warm_slot{i} waits for warm_slot{i-1} of its chain (it seeds its compile cache from
        it), so no two compiles of a chain overlap; the chains of several compile signatures take turns by a
        lock (:func:`dflashpipe.jobs.lease.one_compile_at_a_time`), not by files, so that a run added or
        taken out reruns no other run's chain."""
        slot = int(wildcards.slot)
        return [self._stamp(getattr(wildcards, "signature", None), slot - 1)] if slot > 0 else []

    def all_stamps(self) -> list[str]:
        return [self._stamp(sig, slot) for sig, slot in self._chain()]

    def run_stamps(self, wildcards) -> list[str]:
        """Input function: the warm stamps of a run's compile signature (every slot's)."""
        sig = self.signature(self._run(wildcards)) if self.paths.runs else None
        return [self._stamp(sig, slot) for slot in range(self.slots)]

    def train_threads(self, wildcards=None) -> int:
        """Threads function: CPU threads of a run's training job: its ranks' on one node (with several nodes,
        each node's)."""
        return self.shards * self.run_cfg(self._run(wildcards))["train"]["threads"]

    def warm_threads(self, wildcards) -> int:
        """Threads function: a warm job's (its chain's first run's ``train.threads``)."""
        run = self.signatures()[wildcards.signature] if self.paths.runs else None
        return self.run_cfg(run)["train"]["threads"]

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
        return [self.paths.run_log("train", f"rank{k}") for k in range(self.ranks)]

    def train_node_logs(self) -> list[str]:
        """The node launchers' logs of a run on several nodes (none on one: the job is the launcher)."""
        return [self.paths.run_log("train", f"node{k}") for k in range(self.nodes)] if self.nodes > 1 else []

    # -- evaluation (the methods: dflashpipe.evaluate.methods) ---------------------------------
    def needs_ar_draft(self, run: str | None = None) -> bool:
        """Whether a run's listed evaluation methods need the small AR draft (then rule ar_draft trains it)."""
        return needs_ar_draft(self.run_cfg(run)["evaluate"]["methods"])

    def ar_signature(self, run: str | None) -> str:
        """What makes a run's AR draft (its settings and seed): runs with the same one share it."""
        cfg = self.run_cfg(run)
        return hashlib.sha256(json.dumps([result_params(cfg, "ar_draft"), cfg["seed"]]).encode()).hexdigest()[:12]

    def ar_drafts(self) -> dict[str, str]:
        """Each AR draft the runs need, by its signature, and the first run that needs it."""
        out = {}
        for run in self.run_names:
            if self.needs_ar_draft(run):
                out.setdefault(self.ar_signature(run), run)
        return out

    def ar_draft_run(self, wildcards) -> str | None:
        return self.ar_drafts()[wildcards.ardraft] if self.paths.runs else None

    def ar_draft_params(self, section: str):
        """Params function of rule ar_draft: its run's result-changing keys of ``section`` (or its seed)."""
        def value(wildcards):
            cfg = self.run_cfg(self.ar_draft_run(wildcards))
            return cfg["seed"] if section == "seed" else result_params(cfg, section)
        return value

    def ar_draft_log(self) -> str:
        return self.paths.log("ar_draft", "{ardraft}" if self.paths.runs else "ar_draft")

    def ar_draft_benchmark(self) -> str:
        return self.paths.benchmark("ar_draft_{ardraft}" if self.paths.runs else "ar_draft")

    def ar_draft_files(self, wildcards=None) -> list[str]:
        """Input function: the small AR draft's files of a run, when its evaluation methods need it."""
        return self.run_ar_draft_files(self._run(wildcards))

    def run_ar_draft_files(self, run: str | None) -> list[str]:
        if not self.needs_ar_draft(run):
            return []
        files = self.paths.ar_draft_files()
        return [Paths.of_run(f, None, ardraft=self.ar_signature(run)) for f in files] if self.paths.runs else files

    def draft_vocab_files(self, wildcards=None) -> list[str]:
        """Input function of rules evaluate and concurrency: the run's draft vocabulary (``evaluate.draft_vocab``), if any."""
        return self.run_draft_vocab_files(self._run(wildcards))

    def run_draft_vocab_files(self, run: str | None) -> list[str]:
        n = self.run_cfg(run)["evaluate"]["draft_vocab"]
        return [self.paths.draft_vocab.format(n=int(n))] if n else []  # int: YAML's 48.0 passes the schema

    @staticmethod
    def method_labels() -> dict[str, str]:
        """The plots' legend label of every evaluation method, in the registry's order."""
        return {m.name: m.label for m in METHODS}

    # -- the speed-up under load (evaluate.concurrency) --------------------------------------------------
    def concurrency_levels(self, run: str | None) -> list[int] | str:
        """A run's ``evaluate.concurrency``: ``auto`` (the device decides: dflashpipe.evaluate.concurrency), a list,
        or [] (not measured)."""
        return self.run_cfg(run)["evaluate"]["concurrency"]

    def measures_concurrency(self) -> bool:
        """Whether any run measures the speed-up under load (then rules concurrency and its report exist)."""
        return any(self.concurrency_levels(run) for run in self.run_names)

    def eval_params(self, wildcards) -> dict:
        """Params function of rule evaluate: the run's result-changing ``evaluate`` keys, less the speed-up
        under load's (``x-concurrency``: a new concurrency reruns no batch-1 evaluation)."""
        skip = keys_marked("evaluate", "concurrency")
        return {k: v for k, v in result_params(self.run_cfg(self._run(wildcards)), "evaluate").items() if k not in skip}

    def concurrency_params(self, wildcards) -> dict:
        """Params function of rule concurrency: the keys its figures depend on."""
        ev = self.run_cfg(self._run(wildcards))["evaluate"]
        keys = {k: ev[k] for k in (*keys_marked("evaluate", "concurrency"), "max_new_tokens", "num_prompts", "temperature")}
        return canonical({**keys, "draft_vocab": int(ev["draft_vocab"])})  # int: as its file's name (YAML's 48.0)

    def concurrency_files(self, wildcards=None) -> list[str]:
        """Input function of rule concurrency_report: a run's measurements (one per eval dataset)."""
        return [Paths.of_run(self.paths.eval_concurrency(d), self._run(wildcards)) for d in self.datasets_for("eval")]

    def eval_summaries(self, wildcards=None) -> list[str]:
        """Input function: a run's evaluation summaries (one per eval dataset)."""
        return [Paths.of_run(self.paths.eval_summary(d), self._run(wildcards)) for d in self.datasets_for("eval")]

    # -- the runs compared ------------------------------------------------------------------
    def compare_inputs(self) -> dict:
        """Rule compare's inputs: every run's eval table, training summary and table per turn and category
        (eval_groups.csv), in the config's order."""
        p = self.paths
        return {"eval": [Paths.of_run(p.table("eval"), r) for r in self.run_names],
                "summaries": [Paths.of_run(p.train_summary, r) for r in self.run_names],
                "groups": [Paths.of_run(p.table("groups"), r) for r in self.run_names]}

    def run_overlays(self) -> list:
        """Rule compare's param: ``[name, overlay]`` of every run, in the config's order."""
        return [[name, canonical(overlay)] for name, overlay in self.config["runs"].items()]

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
        for run in self.run_names:
            per_run = [p.train_summary, p.train_metrics, p.train_final, *p.drafter_files()]
            per_run += [f for d in self.datasets_for("eval") for f in (p.eval_summary(d), p.eval_samples(d))]
            per_run += [p.table(name) for name in p.TABLES] + [p.plot(name) for name in p.PLOTS]
            out += [Paths.of_run(f, run) for f in per_run]
            out += self.run_ar_draft_files(run)
            out += self.run_draft_vocab_files(run)
            if self.concurrency_levels(run):
                out += [Paths.of_run(f, run) for f in (*self.concurrency_files(), p.concurrency_table, p.concurrency_plot)]
        if self.paths.runs:
            out += list(p.compare.values())
        return list(dict.fromkeys(out))
