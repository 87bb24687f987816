from dflashpipe.inputs.target import write_target_id
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="target_id", outputs=snakemake.output) as log:
    write_target_id(snakemake.output[0], snakemake.params.fingerprint)
    log(f"target {snakemake.config['target']['path']}: fingerprint {snakemake.params.fingerprint}")
