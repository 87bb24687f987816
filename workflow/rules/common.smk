# Snakemake wiring only: the config is checked and completed, then bound to the
# rules' paths, input functions and params builders (dflashpipe.wiring).
# Nothing here runs a stage; no stage script imports dflashpipe.wiring.

import os
import sys
from pathlib import Path

# the checkout (this file is its workflow/rules/common.smk): workflow.basedir is the importer's folder
# when the workflow runs as a module of another
REPO = Path(workflow.current_basedir).parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from dflashpipe.config import DATASET_NAME, prepare_config, run_gpus
from dflashpipe.jobs.bytecode import share_bytecode_cache
from dflashpipe.jobs.checkout import pin_code
from dflashpipe.jobs.errors import UserError
from dflashpipe.jobs.faults import failpoint
from dflashpipe.jobs.filedigest import share_cache
from dflashpipe.jobs.memo import FORCED_ENV, forced_rules
from dflashpipe.jobs.writable import unwritable
from dflashpipe.wiring import Pipeline

# the jobs (new Python processes) import this checkout's library, not an installed one
pin_code(REPO / "workflow")
# the jobs' OpenMP threads sleep while they wait instead of spinning: where other work shares the
# cores (a laptop, two jobs at once), spinning threads slow a training step (docs/results-cpu.md)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# where the Python installation keeps no bytecode and will write none (container images), the jobs keep
# theirs in the workflow's cache instead of compiling torch and transformers from source in every job
share_bytecode_cache()

_config_source = ", ".join(str(f) for f in workflow.configfiles) or "config"
# --resources gpu=N (else this machine's GPUs): the GPU counts the config leaves null default to it
_gpu_budget = workflow.global_resources.get("gpu")
_gpu_budget = getattr(_gpu_budget, "value", _gpu_budget)
try:
    for _note in prepare_config(
        config,
        _config_source,
        workflow.config_settings.configfiles,
        workflow.config_settings.config,
        gpus=run_gpus(_gpu_budget, workflow.remote_exec),
        budget=_gpu_budget if isinstance(_gpu_budget, int) else None,
    ):
        print(_note, file=sys.stderr)
except UserError as err:
    raise SystemExit(f"ERROR: {err}")

pipeline = Pipeline(config, repo=REPO)
paths = pipeline.paths
# the fault tests' Ctrl-C while Snakemake plans (dflashpipe.jobs.faults)
failpoint("workflow.plan")


wildcard_constraints:
    run=DATASET_NAME,
    ardraft=r"[0-9a-f]{12}",


# the jobs' cache of big files' digests (a target's weights are read once per file version); a dry run
# reads it and writes nothing
share_cache(config["results"], write=not workflow.output_settings.dryrun)


# the rules told to run again (--forcerun, -F, -f) compute, never restore their kept outputs
# (dflashpipe.jobs.memo): the jobs this process starts, a cluster's too, inherit the variable
onstart:
    os.environ[FORCED_ENV] = forced_rules(
        workflow.dag_settings.forceall,
        workflow.dag_settings.forcetargets,
        workflow.dag_settings.forcerun,
    )
    # every job about to run can write its outputs, log and benchmark, or one line before any starts (a
    # read-only results/ got Snakemake's OSError traceback; dflashpipe.jobs.writable)
    _blocked = unwritable(
        (
            job.rule.name,
            [*job.output, *job.log, *([job.benchmark] if job.benchmark else [])],
        )
        for job in workflow.dag.needrun_jobs()
    )
    if _blocked:
        raise SystemExit(f"ERROR: {_blocked}")
