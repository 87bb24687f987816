from dflashpipe.export.write import export_final
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.memo import Memo
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="export", outputs=snakemake.output) as log:
    memo = Memo(snakemake)
    if not memo.restore(log):  # the same inputs (by content), params and code: their outputs
        run = {"target": snakemake.params.target, "datasets": snakemake.params.datasets,
               "stats": snakemake.input.stats, "summary": snakemake.input.summary,
               "recipe": snakemake.params.recipe,
               "caveat": snakemake.params.caveat}
        export_final(snakemake.input.final, snakemake.params.target, folder_of(snakemake.output.drafter), log=log, run=run)
        memo.keep(log)
