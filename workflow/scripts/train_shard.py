import os

from dflashpipe.drafter.train import TrainConfig, checkpoint_dir, rendezvous_url, train_shard
from dflashpipe.hotstart import hot_start, use_slot_cache
from dflashpipe.lease import lease_for_job
from dflashpipe.runtime import job

rank = int(getattr(snakemake.wildcards, "shard", 0))
p = snakemake.params
shards = p.train["shards"]
with job(snakemake.log[0], threads=snakemake.threads, name=f"train shard {rank}/{shards}") as log:
    lease = lease_for_job(snakemake.config, slot=rank)
    log(f"leased slot {rank}: device {lease.device} (CUDA_VISIBLE_DEVICES={lease.visible_devices})")
    use_slot_cache(p.cache_root, rank)
    runtime = {k: v for k, v in snakemake.config["train"].items() if k not in p.train}  # threads, checkpoint_every, ...
    cfg = TrainConfig.from_sections(p.drafter, {**p.train, **runtime}, p.seed)
    ckpt_dir = checkpoint_dir(p.run_dir, [p.drafter, p.train, p.seed], snakemake.input.tokenized, snakemake.input.target)
    train_shard(
        cfg,
        snakemake.input.tokenized,
        snakemake.input.target,
        ckpt_dir,
        rank,
        shards,
        rendezvous_url(os.path.join(p.run_dir, "rendezvous"), os.environ["DFLASH_RUN_ID"]),
        lease.device,
        snakemake.output.metrics,
        snakemake.output.summary,
        export_dir=getattr(snakemake.output, "drafter", None),
        log=log,
        hot_start=hot_start(snakemake.input.stamps[rank], lease.device),
    )
