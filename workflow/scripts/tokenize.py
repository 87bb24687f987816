from dflashpipe.inputs.tokenize import tokenize_expanded
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config

with job(snakemake.log[0], threads=snakemake.threads, name="tokenize", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        config = job_config(snakemake)
        tokenize_expanded(
            dict(zip(snakemake.params.names, snakemake.input.expanded)),
            snakemake.params.target,
            config["tokenize"]["buckets"],
            folder_of(snakemake.output.data),
            snakemake.output.stats,
            chat_template_kwargs=config["expand"]["chat_template_kwargs"],
            cut_replies=config["tokenize"]["cut_replies"],
            reply_ids=config["tokenize"]["reply_ids"],
            log=log,
        )
        memo.keep(log)
