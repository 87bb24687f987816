from dflashpipe.jobs.runtime import job
from dflashpipe.stages.compare import write_compare

with job(snakemake.log[0], name="compare", outputs=snakemake.output) as log:
    runs = dict(snakemake.params.runs)  # [name, overlay] in the config's order
    write_compare(runs, snakemake.params.seed, dict(zip(runs, snakemake.input.eval)),
                  dict(zip(runs, snakemake.input.summaries)), dict(zip(runs, snakemake.input.groups)),
                  dict(snakemake.output.items()), log=log)
