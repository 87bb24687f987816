from dflashpipe.config import settings
from dflashpipe.drafter.launch import run_training
from dflashpipe.drafter.train import TrainConfig
from dflashpipe.runtime import job

config = snakemake.config
train = config["train"]
shards, nodes = train["shards"], train["nodes"]
with job(snakemake.log.main, threads=snakemake.threads, name=f"train ({nodes} x {shards} rank(s))") as log:
    # the whole sections (params hold the result-changing keys only to trigger reruns)
    cfg = settings(TrainConfig, config["drafter"], config["train"], seed=config["seed"])
    run_training(
        nodes=nodes,
        shards=shards,  # ranks per node
        threads_per_rank=max(1, snakemake.threads // shards),
        cfg=cfg,
        tokenized=snakemake.input.tokenized,
        target=snakemake.params.target,
        run_dir=snakemake.params.run_dir,
        cache_root=snakemake.params.cache_root,
        stamps=list(snakemake.input.stamps),
        gpu_config={"gpu": config["gpu"], "results": config["results"]},
        rank_logs=list(snakemake.log.ranks),
        node_logs=list(snakemake.log.nodes),
        metrics_csv=snakemake.output.metrics,
        summary_json=snakemake.output.summary,
        final_state=snakemake.output.final,  # the final weights; the export rule writes the drafter from them
        log=log,
    )
