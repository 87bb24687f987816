rule warm_slot:
    """Compile on GPU slot i alone, into its own cache, exactly what a shard runs; write a stamp."""
    input:
        previous=pipeline.previous_stamp,
        tokenized=paths.tokenized_files(),
        target=pipeline.target_inputs(),
    output:
        paths.warm_stamp(),
    log:
        pipeline.warm_log("log"),
    benchmark:
        pipeline.warm_log("benchmark")
    wildcard_constraints:
        slot=r"\d+",
        signature=r"[0-9a-f]{12}",
    conda:
        "../../envs/torch.yaml"
    threads: pipeline.warm_threads
    resources:
        gpu=1,
    params:
        code=pipeline.code("warm.py"),
        target=pipeline.target_dir(),
        compile=pipeline.warm_compile,
        seed=config["seed"],
        torch=pipeline.torch_version(),
        cache_root=paths.compile_cache,
    script:
        "../scripts/warm.py"
