from dflashpipe.jobs.runtime import job
from dflashpipe.stages import plots

i, o = snakemake.input, snakemake.output
with job(snakemake.log[0], name="plots", outputs=snakemake.output):
    plots.tau_speedup(i.eval, o.tau, snakemake.params.method_labels)
    plots.groups(i.groups, o.groups)
    plots.per_position(i.positions, o.positions)
    plots.histogram(i.histogram, o.histogram)
    plots.training_curves(i.training, o.loss, o.tokens, i.train_summary)
    plots.compile_times(i.compile, o.compile, list(i.stamps))
