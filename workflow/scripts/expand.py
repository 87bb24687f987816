from dflashpipe.config import settings
from dflashpipe.expand import ExpandSettings, expand_prompts
from dflashpipe.lease import lease_for_job
from dflashpipe.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name=f"expand {snakemake.wildcards.dataset} shard {snakemake.wildcards.shard}") as log:
    p = snakemake.params
    lease = lease_for_job(snakemake.config)  # any free GPU slot
    log(f"leased slot {lease.slot}: device {lease.device}")
    expand_prompts(
        snakemake.input.prompts,
        snakemake.input.target,
        settings(ExpandSettings, p.settings, seed=p.seed),
        snakemake.output[0],
        shard=int(snakemake.wildcards.shard),
        n_shards=snakemake.params.n_shards,
        device=lease.device,
        log=log,
    )
