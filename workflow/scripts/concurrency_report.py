from dflashpipe.jobs.runtime import job
from dflashpipe.stages.concurrency import write_concurrency_report

with job(snakemake.log[0], name="concurrency_report", outputs=snakemake.output) as log:
    write_concurrency_report(dict(zip(snakemake.params.datasets, snakemake.input)), snakemake.output.table,
                             snakemake.output.plot, log=log)
