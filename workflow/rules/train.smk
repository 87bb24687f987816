rule train:
    """ONE drafter run: K data-parallel ranks started together (one GPU each); waits for every warm stamp."""
    input:
        stamps=pipeline.run_stamps,
        tokenized=paths.tokenized_files(),
        target=pipeline.target_inputs(),
    output:
        summary=paths.train_summary,
        metrics=paths.train_metrics,
        final=paths.train_final,
    log:
        main=paths.run_log("train", "train"),
        ranks=pipeline.train_rank_logs(),
        nodes=pipeline.train_node_logs(),
    benchmark:
        paths.run_benchmark("train")
    conda:
        "../../envs/torch.yaml"
    # train.shards, train.nodes and train.threads are read at run time (operational): another GPU count is
    # the same recipe, but remakes the warm chain (other shapes per rank), and so reruns this job
    threads: pipeline.train_threads
    resources:
        **pipeline.train_resources(),
    params:
        code=pipeline.code("train.py"),
        target=pipeline.target_dir(),
        drafter=pipeline.run_params("drafter"),
        train=pipeline.run_params("train"),
        seed=pipeline.run_seed,
        cache_root=paths.compile_cache,
        run_dir=pipeline.run_dir,
    script:
        "../scripts/train.py"


rule export:
    """The drafter export from the run's final weights: an export-code edit reruns this, never training."""
    input:
        final=paths.train_final,
        target=pipeline.target_inputs(),
        # what the model card tells of the run: its held-out figures and the data's size
        summary=paths.train_summary,
        stats=paths.tokenized_stats,
    output:
        drafter=paths.drafter_files(),
    log:
        paths.run_log("export", "export"),
    benchmark:
        paths.run_benchmark("export")
    conda:
        "../../envs/torch.yaml"
    threads: 1
    params:
        code=pipeline.code("export.py"),
        target=pipeline.target_dir(),
        datasets={n: config["datasets"][n] for n in pipeline.datasets_for("train")},
        # the card's record of the config that trained it
        recipe=pipeline.recipe,
        caveat=pipeline.caveat(),
    script:
        "../scripts/export.py"
