if config["target"]["path"] is None:

    rule tiny_target:
        """Train the embedded default target: a tiny Qwen3 on the shipped chats."""
        conda:
            "../../envs/dflash.yaml"
        input:
            train=[prompts_file(n) for n in config["target"]["tiny"]["train_datasets"]],
            heldout=prompts_file(config["target"]["tiny"]["heldout_dataset"]),
            code=lib_code("tiny_target.py"),
        output:
            model=directory(f"{R}/target/model"),
            metrics=f"{R}/target/metrics.json",
        params:
            cfg=result_params(config, "target.tiny"),  # threads and the max_minutes safety stop: read at run time
            seed=config["seed"],
        threads: config["target"]["tiny"]["threads"]
        log:
            f"{R}/logs/target/tiny_target.log",
        script:
            "../scripts/tiny_target.py"
