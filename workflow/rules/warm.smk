rule warm_slot:
    """Compile on GPU slot i alone, into its own cache, exactly what a shard runs; write a stamp."""
    input:
        previous=pipeline.previous_stamp,
        tokenized=paths.tokenized_files(),
        target=pipeline.target_inputs(),
    output:
        paths.warm_stamp(),
    log:
        paths.log("warm", "slot{slot}"),
    benchmark:
        paths.benchmark("warm_slot{slot}")
    wildcard_constraints:
        slot=r"\d+",
    conda:
        "../../envs/torch.yaml"
    threads: config["train"]["threads"]
    resources:
        gpu=1,
    params:
        code=pipeline.code("warm.py"),
        target=pipeline.target_dir(),
        compile=pipeline.compile_settings(),
        seed=config["seed"],
        torch=pipeline.torch_version(),
        cache_root=paths.compile_cache,
    script:
        "../scripts/warm.py"
