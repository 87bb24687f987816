from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job
from dflashpipe.stages.shards import merge_shards

with job(snakemake.log[0], threads=snakemake.threads, name=f"merge {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        n = merge_shards(list(snakemake.input.shards), snakemake.output[0])
        log(f"{n} rows from {len(snakemake.input.shards)} shard(s)")
        memo.keep(log)
