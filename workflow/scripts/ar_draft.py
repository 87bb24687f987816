import dataclasses

from dflashpipe.evaluate.ar_draft import ARDraftConfig, train_ar_draft
from dflashpipe.lease import lease_device
from dflashpipe.runtime import job
from dflashpipe.tokenize import load_tokenized

p = snakemake.params
with job(snakemake.log[0], threads=snakemake.threads, name="ar_draft") as log:
    lease = lease_device(p.lock_dir, p.slots, timeout_s=p.lease_timeout_s)
    known = {f.name for f in dataclasses.fields(ARDraftConfig)}
    cfg = ARDraftConfig(**{k: v for k, v in p.cfg.items() if k in known}, seed=p.seed)
    token_lists = load_tokenized(snakemake.input.tokenized)["input_ids"]
    metrics = train_ar_draft(token_lists, snakemake.input.target, snakemake.output[0], cfg, log=log, device=lease.device)
    log(f"AR draft: {metrics}")
