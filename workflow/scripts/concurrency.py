from dflashpipe.evaluate.concurrency import ConcurrencyRun, measure_concurrency
from dflashpipe.evaluate.settings import EvalSettings
from dflashpipe.jobs.compile_cache import lease_gpu_slot
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings

config = job_config(snakemake)  # a named run's overlay merged in
with job(snakemake.log[0], threads=snakemake.threads, name=f"concurrency {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        lease = lease_gpu_slot(config, log)
        ev = config["evaluate"]
        measure_concurrency(
            ConcurrencyRun(
                target_dir=snakemake.params.target,
                drafter_dir=folder_of(snakemake.input.drafter),
                prompts_parquet=snakemake.input.prompts,
                out_json=snakemake.output[0],
                levels=ev["concurrency"],  # "auto" or a list
                waves=ev["concurrency_waves"],
                settings=settings(EvalSettings, ev, seed=config["seed"],
                                  chat_template_kwargs=config["expand"]["chat_template_kwargs"]),
                device=lease.device,
                draft_vocab_json=snakemake.input.draft_vocab[0] if snakemake.input.draft_vocab else None,
            ),
            log=log,
        )
        memo.keep(log)
