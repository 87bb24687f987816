import dataclasses

from dflashpipe.expand import ExpandSettings, expand_prompts
from dflashpipe.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name=f"expand {snakemake.wildcards.dataset} shard {snakemake.wildcards.shard}") as log:
    fields = {f.name for f in dataclasses.fields(ExpandSettings)}
    settings = ExpandSettings(**{k: v for k, v in snakemake.params.settings.items() if k in fields})
    expand_prompts(
        snakemake.input.prompts,
        snakemake.input.target,
        settings,
        snakemake.output[0],
        shard=int(snakemake.wildcards.shard),
        n_shards=snakemake.params.n_shards,
        log=log,
    )
