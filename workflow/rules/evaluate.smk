if pipeline.ar_drafts():

    rule ar_draft:
        """A 1-layer autoregressive draft with the target's tokenizer, for the methods that need it (assisted)."""
        input:
            tokenized=paths.tokenized_files(),
            target=pipeline.target_inputs(),
        output:
            paths.ar_draft_files(),
        log:
            pipeline.ar_draft_log(),
        benchmark:
            pipeline.ar_draft_benchmark()
        conda:
            "../../envs/torch.yaml"
        threads: config["ar_draft"]["threads"]
        resources:
            gpu=1,
        params:
            code=pipeline.code("ar_draft.py"),
            target=pipeline.target_dir(),
            cfg=pipeline.ar_draft_params("ar_draft"),
            seed=pipeline.ar_draft_params("seed"),
            run=pipeline.ar_draft_run,
        script:
            "../scripts/ar_draft.py"


rule evaluate:
    """DFlash speculative decoding vs. AR and peers on one held-out dataset; lossless check."""
    input:
        target=pipeline.target_inputs(),
        drafter=paths.drafter_files(),
        prompts=paths.prompts(),
        ar_draft=pipeline.ar_draft_files,
        draft_vocab=pipeline.draft_vocab_files,
    output:
        samples=paths.eval_samples(),
        summary=paths.eval_summary(),
    log:
        paths.run_log("evaluate", "{dataset}"),
    benchmark:
        paths.run_benchmark("evaluate_{dataset}")
    conda:
        "../../envs/torch.yaml"
    threads: pipeline.run_threads("evaluate")
    resources:
        gpu=1,
    params:
        code=pipeline.code("evaluate.py"),
        target=pipeline.target_dir(),
        cfg=pipeline.eval_params,
        seed=pipeline.run_seed,
        chat_template_kwargs=pipeline.chat_template_kwargs(),
    script:
        "../scripts/evaluate.py"


if pipeline.measures_concurrency():

    rule concurrency:
        """The speed-up under load on one held-out dataset: AR and DFlash decoding many prompts at once."""
        input:
            target=pipeline.target_inputs(),
            drafter=paths.drafter_files(),
            prompts=paths.prompts(),
            draft_vocab=pipeline.draft_vocab_files,
        output:
            paths.eval_concurrency(),
        log:
            paths.run_log("concurrency", "{dataset}"),
        benchmark:
            paths.run_benchmark("concurrency_{dataset}")
        conda:
            "../../envs/torch.yaml"
        threads: pipeline.run_threads("evaluate")
        resources:
            gpu=1,
        params:
            code=pipeline.code("concurrency.py"),
            target=pipeline.target_dir(),
            cfg=pipeline.concurrency_params,
            chat_template_kwargs=pipeline.chat_template_kwargs(),
        script:
            "../scripts/concurrency.py"
