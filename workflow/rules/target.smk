if config["target"]["path"] is None:

    rule tiny_target:
        """Train the embedded default target: a tiny Qwen3 on the shipped chats."""
        input:
            train=[prompts_file(n) for n in config["target"]["tiny"]["train_datasets"]],
            heldout=prompts_file(config["target"]["tiny"]["heldout_dataset"]),
            code=lib_code("tiny_target.py"),
        output:
            model=directory(f"{R}/target/model"),
            metrics=f"{R}/target/metrics.json",
        params:
            # max_minutes is a safety stop, not a setting of the model: read by the
            # script from the config so that changing it does not retrain the target.
            cfg={k: v for k, v in config["target"]["tiny"].items() if k != "max_minutes"},
            seed=config["seed"],
        threads: config["target"]["tiny"]["threads"]
        log:
            f"{R}/logs/target/tiny_target.log",
        script:
            "../scripts/tiny_target.py"
