from dflashpipe.evaluate.run import evaluate_dataset
from dflashpipe.evaluate.settings import EvalRun, EvalSettings
from dflashpipe.jobs.compile_cache import lease_gpu_slot
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings

p = snakemake.params
config = job_config(snakemake)  # a named run's overlay merged in
with job(snakemake.log[0], threads=snakemake.threads, name=f"evaluate {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        lease = lease_gpu_slot(config, log)
        run = EvalRun(
            settings(EvalSettings, config["evaluate"], seed=config["seed"],
                     chat_template_kwargs=config["expand"]["chat_template_kwargs"]),
            target_dir=p.target,
            drafter_dir=folder_of(snakemake.input.drafter),
            prompts_parquet=snakemake.input.prompts,
            samples_out=snakemake.output.samples,
            summary_out=snakemake.output.summary,
            ar_draft_dir=folder_of(snakemake.input.ar_draft) if snakemake.input.ar_draft else None,
            draft_vocab_json=snakemake.input.draft_vocab[0] if snakemake.input.draft_vocab else None,
            device=lease.device,
        )
        evaluate_dataset(run, log=log)
        memo.keep(log)
