from dflashpipe.jobs.atomic import write_json
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="target_id", outputs=snakemake.output) as log:
    write_json(snakemake.output[0], {"fingerprint": snakemake.params.fingerprint})
    log(f"target {snakemake.config['target']['path']}: fingerprint {snakemake.params.fingerprint}")
