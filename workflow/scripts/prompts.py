from dflashpipe.data import prepare_prompts
from dflashpipe.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name=f"prompts {snakemake.wildcards.dataset}") as log:
    df = prepare_prompts(snakemake.params.spec, snakemake.wildcards.dataset, snakemake.output[0])
    log(f"{len(df)} prompts ({df['reference'].notna().sum()} with a reference reply)")
