import dataclasses

from dflashpipe.expand import ExpandSettings, expand_prompts
from dflashpipe.lease import lease_device
from dflashpipe.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name=f"expand {snakemake.wildcards.dataset} shard {snakemake.wildcards.shard}") as log:
    p = snakemake.params
    lease = lease_device(p.lock_dir, p.slots, timeout_s=p.lease_timeout_s)  # any free GPU slot
    log(f"leased slot {lease.slot}: device {lease.device}")
    fields = {f.name for f in dataclasses.fields(ExpandSettings)}
    settings = ExpandSettings(**{k: v for k, v in snakemake.params.settings.items() if k in fields})
    expand_prompts(
        snakemake.input.prompts,
        snakemake.input.target,
        settings,
        snakemake.output[0],
        shard=int(snakemake.wildcards.shard),
        n_shards=snakemake.params.n_shards,
        device=lease.device,
        log=log,
    )
