from dflashpipe.inputs.tokenize import tokenize_expanded
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="tokenize", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        tokenize_expanded(
            dict(zip(snakemake.params.names, snakemake.input.expanded)),
            snakemake.params.target,
                snakemake.params.buckets,
            folder_of(snakemake.output.data),
            snakemake.output.stats,
            chat_template_kwargs=snakemake.params.chat_template_kwargs,
            cut_replies=snakemake.params.cut_replies,
            reply_ids=snakemake.params.reply_ids,
            log=log,
        )
        memo.keep(log)
