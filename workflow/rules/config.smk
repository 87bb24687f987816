rule effective_config:
    """The config as the run uses it, every key: the schema's defaults, the embedded tiny target's recipe
    (config/tiny_target.yaml, for that target only) and the config files."""
    output:
        paths.effective_config,
    log:
        paths.log("config", "effective_config"),
    localrule: True
    conda:
        "../../envs/light.yaml"
    params:
        code=pipeline.code("effective_config.py"),
        config=pipeline.effective_config(),
        recipe=pipeline.recipe()["recipe"],
    script:
        "../scripts/effective_config.py"
