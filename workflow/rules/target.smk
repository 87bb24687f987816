if pipeline.builds_tiny_target:

    rule tiny_target:
        """Train the embedded default target: a tiny Qwen3 on the shipped chats."""
        input:
            **pipeline.tiny_target_prompts(),
        output:
            model=directory(paths.target_model),
            metrics=paths.target_metrics,
            target_id=paths.target_id,
        log:
            paths.log("target", "tiny_target"),
        benchmark:
            paths.benchmark("tiny_target")
        conda:
            "../../envs/torch.yaml"
        threads: config["target"]["tiny"]["threads"]
        params:
            code=pipeline.code("tiny_target.py"),
            # threads and the max_minutes safety stop: read at run time
            cfg=pipeline.result_params("target.tiny"),
            seed=config["seed"],
        script:
            "../scripts/tiny_target.py"
