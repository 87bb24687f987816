from dflashpipe.training.launch import run_training
from dflashpipe.training.train import TrainConfig, TrainRun
from dflashpipe.jobs.folders import folder_of
from dflashpipe.jobs.runtime import job
from dflashpipe.jobs.settings import job_config, settings

config = job_config(snakemake)  # a named run's overlay merged in
train = config["train"]
shards, nodes = train["shards"], train["nodes"]
with job(snakemake.log.main, threads=snakemake.threads, name=f"train ({nodes} x {shards} rank(s))", outputs=snakemake.output) as log:
    run = TrainRun(
        # the whole sections (params hold the result-changing keys only to trigger reruns)
        cfg=settings(TrainConfig, config["drafter"], config["train"], seed=config["seed"]),
        tokenized_dir=folder_of(snakemake.input.tokenized),
        target_dir=snakemake.params.target,
        run_dir=snakemake.params.run_dir,
        metrics_csv=snakemake.output.metrics,
        summary_json=snakemake.output.summary,
        final_state=snakemake.output.final,  # the final weights; the export rule writes the drafter from them
        nodes=nodes,
        shards=shards,  # ranks per node
        threads=max(1, snakemake.threads // shards),  # per rank
        cache_root=snakemake.params.cache_root,
        stamps=tuple(snakemake.input.stamps),
        rank_logs=tuple(snakemake.log.ranks),
        node_logs=tuple(snakemake.log.nodes),
    )
    run_training(run, gpu_config={"gpu": config["gpu"], "results": config["results"]}, log=log)
