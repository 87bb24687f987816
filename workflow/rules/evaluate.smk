if "assisted" in config["evaluate"]["methods"]:

    rule ar_draft:
        """A 1-layer autoregressive draft with the target's tokenizer: the assisted-generation peer."""
        conda:
            "../../envs/dflash.yaml"
        input:
            tokenized=TOKENIZED,
            target=target_dir(),
            code=lib_code("ar_draft.py"),
        output:
            directory(f"{R}/ar_draft"),
        params:
            cfg=result_params(config, "ar_draft"),
            seed=config["seed"],
        threads: config["ar_draft"]["threads"]
        resources:
            gpu=1,
        log:
            f"{R}/logs/ar_draft/ar_draft.log",
        script:
            "../scripts/ar_draft.py"


rule evaluate:
    """DFlash speculative decoding vs. AR and peers on one held-out dataset; lossless check."""
    conda:
        "../../envs/dflash.yaml"
    input:
        target=target_dir(),
        drafter=DRAFTER,
        prompts=prompts_file("{dataset}"),
        ar_draft=ar_draft_dir(),
        code=lib_code("evaluate.py"),
    output:
        samples=f"{R}/eval/{{dataset}}.samples.parquet",
        summary=eval_summary("{dataset}"),
    params:
        cfg=result_params(config, "evaluate"),
        seed=config["seed"],
        chat_template_kwargs=canonical(config["expand"]["chat_template_kwargs"]),
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1,
    log:
        f"{R}/logs/evaluate/{{dataset}}.log",
    script:
        "../scripts/evaluate.py"
