rule tokenize:
    """Chat template + assistant-only loss mask + length filter -> one datasets dataset."""
    conda:
        "../../envs/dflash.yaml"
    input:
        expanded=expand(f"{R}/expanded/{{name}}.parquet", name=datasets_for("train")),
        target=target_dir(),
        code=lib_code("tokenize.py"),
    output:
        data=directory(TOKENIZED),
        stats=TOKENIZED_STATS,
    params:
        names=datasets_for("train"),
        block_size=config["drafter"]["block_size"],
        buckets=config["tokenize"]["buckets"],
        cut_replies=config["tokenize"]["cut_replies"],
        chat_template_kwargs=canonical(config["expand"]["chat_template_kwargs"]),
    threads: config["threads"]
    log:
        f"{R}/logs/tokenize/tokenize.log",
    script:
        "../scripts/tokenize.py"
