from dflashpipe.jobs.runtime import job
from dflashpipe.stages.tables import write_tables

with job(snakemake.log[0], name="tables", outputs=snakemake.output) as log:
    write_tables(
        eval_summaries=dict(zip(snakemake.params.datasets, snakemake.input.eval)),
        metrics_csv=snakemake.input.metrics,
        train_summary=snakemake.input.train_summary,
        stamps=list(snakemake.input.stamps),
        out=dict(snakemake.output.items()),
        log=log,
        caveat=snakemake.params.caveat,
    )
