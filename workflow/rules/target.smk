if pipeline.builds_tiny_target:

    rule tiny_target:
        """Train the embedded default target: a tiny Qwen3 on the shipped chats."""
        input:
            **pipeline.tiny_target_prompts(),
        output:
            model=paths.target_model_files(),
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

else:

    rule target_id:
        """The configured target's content fingerprint, read while planning (rule all's first step): what
        the rules read the target through."""
        output:
            paths.target_id,
        log:
            paths.log("target", "fingerprint"),
        localrule: True
        conda:
            "../../envs/light.yaml"
        params:
            code=pipeline.code("target_id.py"),
            fingerprint=pipeline.target_fingerprint(),
        script:
            "../scripts/target_id.py"
