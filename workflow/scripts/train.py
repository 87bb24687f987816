from dflashpipe.drafter.launch import run_training
from dflashpipe.drafter.train import TrainConfig
from dflashpipe.runtime import job

p, config = snakemake.params, snakemake.config
shards = config["train"]["shards"]
with job(snakemake.log.main, threads=snakemake.threads, name=f"train ({shards} rank(s))") as log:
    # params hold the result-changing keys (they trigger reruns); the operational ones are read here
    cfg = TrainConfig.from_sections(p.drafter, {**config["train"], **p.train}, p.seed)
    run_training(
        world_size=shards,
        threads_per_rank=max(1, snakemake.threads // shards),
        cfg=vars(cfg),
        tokenized=snakemake.input.tokenized,
        target=snakemake.input.target,
        run_dir=p.run_dir,
        cache_root=p.cache_root,
        stamps=list(snakemake.input.stamps),
        gpu_config={"gpu": config["gpu"], "results": config["results"]},
        rank_logs=list(snakemake.log.ranks),
        metrics_csv=snakemake.output.metrics,
        summary_json=snakemake.output.summary,
        final_state=snakemake.output.final,  # the final weights; the export rule writes the drafter from them
        log=log,
    )
