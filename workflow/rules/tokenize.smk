rule tokenize:
    """Chat template + loss mask on the target's replies -> one datasets dataset (not the drafter's: any run reads it)."""
    input:
        expanded=pipeline.expanded_train(),
        target=pipeline.target_inputs(),
    output:
        data=paths.tokenized_files(),
        stats=paths.tokenized_stats,
    log:
        paths.log("tokenize", "tokenize"),
    conda:
        "../../envs/torch.yaml"
    threads: config["threads"]
    params:
        code=pipeline.code("tokenize.py"),
        target=pipeline.target_dir(),
        names=pipeline.datasets_for("train"),
        buckets=config["tokenize"]["buckets"],
        cut_replies=config["tokenize"]["cut_replies"],
        reply_ids=config["tokenize"]["reply_ids"],
        chat_template_kwargs=pipeline.chat_template_kwargs(),
    script:
        "../scripts/tokenize.py"


rule draft_vocab:
    """The n tokens most frequent in the trained replies: what a draft picks among (evaluate.draft_vocab)."""
    input:
        data=paths.tokenized_files(),
    output:
        paths.draft_vocab,
    log:
        paths.log("draft_vocab", "{n}"),
    wildcard_constraints:
        n=r"[1-9][0-9]*",
    conda:
        "../../envs/torch.yaml"
    params:
        code=pipeline.code("draft_vocab.py"),
    script:
        "../scripts/draft_vocab.py"
