from dflashpipe.inputs.data import prepare_prompts
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config

with job(snakemake.log[0], threads=snakemake.threads, name=f"prompts {snakemake.wildcards.dataset}", outputs=snakemake.output) as log:
    prepare_prompts(snakemake.params.spec, snakemake.wildcards.dataset, snakemake.output.prompts,
                    stats_path=snakemake.output.stats, log=log,
                    max_bad_rows=job_config(snakemake)["data"]["max_bad_rows"])  # operational: read at run time
