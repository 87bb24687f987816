rule expand_shard:
    """The target regenerates the replies of one shard of a training dataset (resumable)."""
    conda:
        "../../envs/dflash.yaml"
    input:
        prompts=prompts_file("{dataset}"),
        target=target_dir(),
        code=lib_code("expand.py"),
    output:
        f"{R}/expanded/{{dataset}}/shard{{shard}}.parquet",
    params:
        settings=result_params(config, "expand"),
        n_shards=config["expand"]["shards"],
        seed=config["seed"] if config["expand"]["temperature"] > 0 else 0,  # greedy: no rerun on a new seed
    threads: config["expand"]["threads"]
    resources:
        gpu=1,
    log:
        f"{R}/logs/expand/{{dataset}}.shard{{shard}}.log",
    wildcard_constraints:
        shard=r"\d+",
    script:
        "../scripts/expand.py"


rule merge_expanded:
    """One parquet per dataset from its expansion shards."""
    conda:
        "../../envs/dflash.yaml"
    input:
        shards=expanded_shards,
        code=lib_code("merge_expanded.py"),
    output:
        f"{R}/expanded/{{dataset}}.parquet",
    threads: config["threads"]
    log:
        f"{R}/logs/expand/{{dataset}}.merge.log",
    script:
        "../scripts/merge_expanded.py"
