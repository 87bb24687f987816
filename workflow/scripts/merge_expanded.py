from dflashpipe.jobs.runtime import job
from dflashpipe.stages.shards import merge_shards

with job(snakemake.log[0], threads=snakemake.threads, name=f"merge {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    n = merge_shards(list(snakemake.input.shards), snakemake.output[0])
    log(f"{n} rows from {len(snakemake.input.shards)} shard(s)")
