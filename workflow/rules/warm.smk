rule warm_slot:
    """Compile on GPU slot i alone, into its own cache, exactly what a shard runs; write a stamp."""
    conda:
        "../../envs/dflash.yaml"
    input:
        previous=previous_stamp,
        tokenized=TOKENIZED,
        target=target_dir(),
        code=lib_code("warm.py"),
    output:
        warm_stamp("{slot}"),
    params:
        compile=compile_settings(),
        seed=config["seed"],
        torch=torch_version(),
        cache_root=CACHE_ROOT,
    threads: config["train"]["threads"]
    resources:
        gpu=1,
    log:
        f"{R}/logs/warm/slot{{slot}}.log",
    benchmark:
        f"{R}/benchmarks/warm_slot{{slot}}.tsv"
    wildcard_constraints:
        slot=r"\d+",
    script:
        "../scripts/warm.py"
