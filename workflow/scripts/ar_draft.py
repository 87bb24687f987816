import dataclasses

from dflashpipe.evaluate.ar_draft import ARDraftConfig, train_ar_draft
from dflashpipe.lease import lease_for_job
from dflashpipe.runtime import job
from dflashpipe.tokenize import load_tokenized

p = snakemake.params
with job(snakemake.log[0], threads=snakemake.threads, name="ar_draft") as log:
    lease = lease_for_job(snakemake.config)
    known = {f.name for f in dataclasses.fields(ARDraftConfig)}
    values = {**p.cfg, "max_minutes": snakemake.config["ar_draft"]["max_minutes"]}  # a safety stop: not a param
    cfg = ARDraftConfig(**{k: v for k, v in values.items() if k in known}, seed=p.seed)
    token_lists = load_tokenized(snakemake.input.tokenized)["input_ids"]
    metrics = train_ar_draft(token_lists, snakemake.input.target, snakemake.output[0], cfg, log=log, device=lease.device)
    log(f"AR draft: {metrics}")
