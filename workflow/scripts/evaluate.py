from dflashpipe.evaluate.run import evaluate_dataset
from dflashpipe.lease import lease_for_job
from dflashpipe.runtime import job

p = snakemake.params
cfg = p.cfg
with job(snakemake.log[0], threads=snakemake.threads, name=f"evaluate {snakemake.wildcards.dataset}") as log:
    lease = lease_for_job(snakemake.config)
    log(f"leased slot {lease.slot}: device {lease.device}")
    evaluate_dataset(
        snakemake.input.target,
        snakemake.input.drafter,
        snakemake.input.prompts,
        snakemake.output.samples,
        snakemake.output.summary,
        max_new_tokens=cfg["max_new_tokens"],
        temperature=cfg["temperature"],
        num_prompts=cfg["num_prompts"],
        ar_draft_dir=snakemake.input.ar_draft[0] if snakemake.input.ar_draft else None,
        prompt_lookup_num_tokens=cfg["prompt_lookup_num_tokens"],
        device=lease.device,
        seed=p.seed,
        methods=cfg["methods"],
        lossless=cfg["lossless"],
        chat_template_kwargs=p.chat_template_kwargs,
        log=log,
    )
