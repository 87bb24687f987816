from dflashpipe.evaluate.run import evaluate_dataset
from dflashpipe.evaluate.settings import EvalRun, EvalSettings
from dflashpipe.jobs.compile_cache import use_leased_slot_cache
from dflashpipe.jobs.lease import lease_for_job
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import settings

p = snakemake.params
with job(snakemake.log[0], threads=snakemake.threads, name=f"evaluate {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        lease = lease_for_job(snakemake.config)
        log(f"leased slot {lease.slot}: device {lease.device}")
        use_leased_slot_cache(snakemake.config, lease, log)
        run = EvalRun(
            settings(EvalSettings, p.cfg, seed=p.seed, chat_template_kwargs=p.chat_template_kwargs),
            target_dir=p.target,
            drafter_dir=folder_of(snakemake.input.drafter),
            prompts_parquet=snakemake.input.prompts,
            samples_out=snakemake.output.samples,
            summary_out=snakemake.output.summary,
            ar_draft_dir=folder_of(snakemake.input.ar_draft) if snakemake.input.ar_draft else None,
            device=lease.device,
        )
        evaluate_dataset(run, log=log)
        memo.keep(log)
