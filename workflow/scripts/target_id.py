from dflashpipe.inputs.target import write_target_id
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config

with job(snakemake.log[0], threads=snakemake.threads, name="target_id", outputs=snakemake.output) as log:
    write_target_id(snakemake.output[0], snakemake.params.fingerprint)
    log(f"target {job_config(snakemake)['target']['path']}: fingerprint {snakemake.params.fingerprint}")
