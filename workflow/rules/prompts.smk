rule prompts:
    """Load one configured dataset (local file or HF name) into the normal prompt table."""
    input:
        # by content (params.content), not by date
        data=ancient(pipeline.dataset_file),
    output:
        prompts=paths.prompts(),
        stats=paths.prompts_stats(),
    log:
        paths.log("prompts", "{dataset}"),
    wildcard_constraints:
        dataset=DATASET_NAME,
    conda:
        "../../envs/light.yaml"
    threads: config["threads"]
    params:
        code=pipeline.code("prompts.py"),
        spec=pipeline.dataset_spec,
        content=pipeline.dataset_content,
    script:
        "../scripts/prompts.py"
