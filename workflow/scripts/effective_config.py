from dflashpipe.jobs.runtime import job
from dflashpipe.stages.effective_config import write_effective_config

with job(snakemake.log[0], threads=snakemake.threads, name="effective_config", outputs=snakemake.output) as log:
    write_effective_config(snakemake.output[0], snakemake.params.config, snakemake.params.recipe)
    log(snakemake.params.recipe)
