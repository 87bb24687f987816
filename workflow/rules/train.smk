rule train:
    """ONE drafter run: K data-parallel ranks started together (one GPU each); waits for every warm stamp."""
    conda:
        "../../envs/dflash.yaml"
    input:
        stamps=all_stamps(),
        tokenized=TOKENIZED,
        target=target_dir(),
        code=lib_code("train.py"),
    output:
        summary=TRAIN_SUMMARY,
        metrics=TRAIN_METRICS,
        drafter=directory(DRAFTER),
    params:
        drafter=result_params(config, "drafter"),
        train=result_params(config, "train"),
        seed=config["seed"],
        cache_root=CACHE_ROOT,
        run_dir=lambda wildcards, output: os.path.dirname(output.summary),
    # train.shards and train.threads are read at run time (operational): a new shard count is the
    # same recipe, but reruns the warm chain (other shapes per rank), and so this job
    threads: SHARDS * config["train"]["threads"]
    resources:
        gpu=SHARDS,
    log:
        main=f"{R}/logs/train/train.log",
        ranks=expand(f"{R}/logs/train/rank{{k}}.log", k=range(SHARDS)),
    benchmark:
        f"{R}/benchmarks/train.tsv"
    script:
        "../scripts/train.py"
