rule train_shard:
    """Rank k of K data-parallel shards of ONE drafter run; starts only when every slot is warm."""
    input:
        stamps=all_stamps(),
        tokenized=f"{R}/tokenized/train",
        target=target_dir(),
        code=lib_code("train_shard.py"),
    output:
        summary=f"{R}/train/shard{{shard}}.summary.json",
        metrics=f"{R}/train/shard{{shard}}.metrics.csv",
    params:
        drafter=config["drafter"],
        train=section_params("train"),
        seed=config["seed"],
        cache_root=CACHE_ROOT,
        run_dir=f"{R}/train",
    threads: config["train"]["threads"]
    resources:
        gpu=1,
    log:
        f"{R}/logs/train/shard{{shard}}.log",
    benchmark:
        f"{R}/benchmarks/train_shard{{shard}}.tsv"
    wildcard_constraints:
        shard=r"[1-9]\d*",
    script:
        "../scripts/train_shard.py"


use rule train_shard as train_shard0 with:
    output:
        summary=f"{R}/train/shard0.summary.json",
        metrics=f"{R}/train/shard0.metrics.csv",
        drafter=directory(f"{R}/drafter"),
    log:
        f"{R}/logs/train/shard0.log",
    benchmark:
        f"{R}/benchmarks/train_shard0.tsv"
