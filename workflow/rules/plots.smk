rule tables:
    """CSV tables of the run: evaluation per dataset and method, acceptance, training, compile times."""
    conda:
        "../../envs/dflash.yaml"
    input:
        eval=[eval_summary(d) for d in datasets_for("eval")],
        metrics=TRAIN_METRICS,
        train_summary=TRAIN_SUMMARY,
        stamps=all_stamps(),
        code=lib_code("tables.py"),
    output:
        eval=f"{R}/tables/eval.csv",
        positions=f"{R}/tables/per_position_acceptance.csv",
        histogram=f"{R}/tables/acceptance_histogram.csv",
        training=f"{R}/tables/training.csv",
        compile=f"{R}/tables/compile.csv",
    params:
        datasets=datasets_for("eval"),
    log:
        f"{R}/logs/plots/tables.log",
    script:
        "../scripts/tables.py"


rule plots:
    """PNG figures (results/plots/), each with a caption in the Snakemake report."""
    conda:
        "../../envs/dflash.yaml"
    input:
        eval=f"{R}/tables/eval.csv",
        positions=f"{R}/tables/per_position_acceptance.csv",
        histogram=f"{R}/tables/acceptance_histogram.csv",
        training=f"{R}/tables/training.csv",
        compile=f"{R}/tables/compile.csv",
        code=lib_code("plots.py"),
    output:
        tau=report(f"{R}/plots/tau_speedup.png", caption="../report/tau_speedup.rst", category="Evaluation"),
        positions=report(f"{R}/plots/per_position_acceptance.png", caption="../report/per_position.rst", category="Evaluation"),
        histogram=report(f"{R}/plots/acceptance_histogram.png", caption="../report/histogram.rst", category="Evaluation"),
        loss=report(f"{R}/plots/training_loss_acc.png", caption="../report/training.rst", category="Training"),
        tokens=report(f"{R}/plots/training_tokens_per_s.png", caption="../report/throughput.rst", category="Training"),
        compile=report(f"{R}/plots/compile_cold_vs_hot.png", caption="../report/compile.rst", category="Training"),
    log:
        f"{R}/logs/plots/plots.log",
    script:
        "../scripts/plots.py"
