rule prompts:
    """Load one configured dataset (local file or HF name) into the normal prompt table."""
    conda:
        "../../envs/dflash.yaml"
    input:
        data=dataset_file,
        code=lib_code("prompts.py"),
    output:
        prompts_file("{dataset}"),
    params:
        spec=dataset_spec,
    threads: config["threads"]
    log:
        f"{R}/logs/prompts/{{dataset}}.log",
    wildcard_constraints:
        dataset="[A-Za-z0-9_.-]+",
    script:
        "../scripts/prompts.py"
