from dflashpipe.config import write_effective_config
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="effective_config", outputs=snakemake.output) as log:
    log(write_effective_config(snakemake.output[0], snakemake.params.config))
