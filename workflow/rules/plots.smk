rule tables:
    """CSV tables: evaluation per dataset and method (and per turn, category), acceptance, training, compile."""
    input:
        eval=pipeline.eval_summaries,
        metrics=paths.train_metrics,
        train_summary=paths.train_summary,
        stamps=pipeline.run_stamps,
    output:
        eval=paths.table("eval"),
        groups=paths.table("groups"),
        positions=paths.table("positions"),
        histogram=paths.table("histogram"),
        training=paths.table("training"),
        compile=paths.table("compile"),
    log:
        paths.run_log("plots", "tables"),
    conda:
        "../../envs/light.yaml"
    params:
        code=pipeline.code("tables.py"),
        datasets=pipeline.datasets_for("eval"),
        caveat=pipeline.caveat(),
    script:
        "../scripts/tables.py"


rule plots:
    """PNG figures (results/plots/), each with a caption in the Snakemake report."""
    input:
        eval=paths.table("eval"),
        groups=paths.table("groups"),
        positions=paths.table("positions"),
        histogram=paths.table("histogram"),
        training=paths.table("training"),
        compile=paths.table("compile"),
        train_summary=paths.train_summary,
        stamps=pipeline.run_stamps,
    output:
        tau=report(
            paths.plot("tau"),
            caption="../report/tau_speedup.rst",
            category="Evaluation",
        ),
        groups=report(
            paths.plot("groups"),
            caption="../report/eval_groups.rst",
            category="Evaluation",
        ),
        positions=report(
            paths.plot("positions"),
            caption="../report/per_position.rst",
            category="Evaluation",
        ),
        histogram=report(
            paths.plot("histogram"),
            caption="../report/histogram.rst",
            category="Evaluation",
        ),
        loss=report(
            paths.plot("loss"),
            caption="../report/training.rst",
            category="Training",
        ),
        tokens=report(
            paths.plot("tokens"),
            caption="../report/throughput.rst",
            category="Training",
        ),
        compile=report(
            paths.plot("compile"),
            caption="../report/compile.rst",
            category="Training",
        ),
    log:
        paths.run_log("plots", "plots"),
    conda:
        "../../envs/light.yaml"
    params:
        code=pipeline.code("plots.py"),
        method_labels=pipeline.method_labels(),
    script:
        "../scripts/plots.py"


if paths.runs:

    rule compare:
        """The named runs side by side: per run and eval set, and per recipe (mean, min-max over its seeds); the
        same per turn and per category of the sets that have them."""
        input:
            **pipeline.compare_inputs(),
        output:
            runs=paths.compare["runs"],
            recipes=paths.compare["recipes"],
            plot=report(
                paths.compare["plot"],
                caption="../report/runs.rst",
                category="Runs",
            ),
            runs_groups=paths.compare["runs_groups"],
            recipes_groups=paths.compare["recipes_groups"],
            groups_plot=report(
                paths.compare["groups_plot"],
                caption="../report/runs_groups.rst",
                category="Runs",
            ),
        log:
            paths.log("plots", "compare"),
        conda:
            "../../envs/light.yaml"
        params:
            code=pipeline.code("compare.py"),
            runs=pipeline.run_overlays(),
            seed=config["seed"],
        script:
            "../scripts/compare.py"


if pipeline.measures_concurrency():

    rule concurrency_report:
        """The speed-up under load of every held-out dataset: a table, a plot, and where DFlash stops paying."""
        input:
            pipeline.concurrency_files,
        output:
            table=paths.concurrency_table,
            plot=report(
                paths.concurrency_plot,
                caption="../report/concurrency.rst",
                category="Evaluation",
            ),
        log:
            paths.run_log("plots", "concurrency"),
        conda:
            "../../envs/light.yaml"
        params:
            code=pipeline.code("concurrency_report.py"),
            datasets=pipeline.datasets_for("eval"),
        script:
            "../scripts/concurrency_report.py"
