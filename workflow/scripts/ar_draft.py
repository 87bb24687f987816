from dflashpipe.evaluate.ar_draft import ARDraftConfig, train_ar_draft
from dflashpipe.inputs.tokenized import load_tokenized
from dflashpipe.jobs.lease import lease_for_job
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings

with job(snakemake.log[0], threads=snakemake.threads, name="ar_draft", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        config = job_config(snakemake)  # the overlay of a run this AR draft serves (params.run)
        lease = lease_for_job(config)
        cfg = settings(ARDraftConfig, config["ar_draft"], seed=config["seed"])
        token_lists = load_tokenized(folder_of(snakemake.input.tokenized))["input_ids"]
        metrics = train_ar_draft(token_lists, snakemake.params.target, folder_of(snakemake.output), cfg, log=log, device=lease.device)
        log(f"AR draft: {metrics}")
        memo.keep(log)
