from dflashpipe.inputs.draft_vocab import write_draft_vocab
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.runtime import job

with job(snakemake.log[0], threads=snakemake.threads, name="draft_vocab", outputs=snakemake.output) as log:
    write_draft_vocab(folder_of(snakemake.input.data), int(snakemake.wildcards.n), snakemake.output[0], log=log)
