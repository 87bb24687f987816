rule expand_shard:
    """The target regenerates the replies of one shard of a training dataset (resumable)."""
    input:
        prompts=paths.prompts(),
        target=pipeline.target_inputs(),
    output:
        paths.expanded_shard(),
    log:
        paths.log("expand", "{dataset}.shard{shard}"),
    benchmark:
        paths.benchmark("expand_{dataset}.shard{shard}")
    wildcard_constraints:
        shard=r"\d+",
    conda:
        "../../envs/torch.yaml"
    threads: config["expand"]["threads"]
    resources:
        gpu=pipeline.expand_gpus(),
    params:
        code=pipeline.code("expand.py"),
        target=pipeline.target_dir(),
        settings=pipeline.result_params("expand"),
        n_shards=config["expand"]["shards"],
        seed=pipeline.expand_seed(),
    script:
        "../scripts/expand.py"


rule merge_expanded:
    """One parquet per dataset from its expansion shards."""
    input:
        shards=pipeline.expanded_shards,
    output:
        paths.expanded(),
    log:
        paths.log("expand", "{dataset}.merge"),
    conda:
        "../../envs/torch.yaml"
    threads: config["threads"]
    params:
        code=pipeline.code("merge_expanded.py"),
    script:
        "../scripts/merge_expanded.py"
