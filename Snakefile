# DFlash drafter pipeline. The graph only wires files together; the logic lives
# in the dflashpipe package (workflow/dflashpipe), importable and tested on its own.
#
#   prompts -> expand (the target regenerates replies) -> tokenize
#   target (a real checkpoint, or the tiny default trained here)
#   warm_slot0 -> warm_slot1 -> ... (serial compile-warm, one per GPU slot; cache stamps)
#     -> train (K data-parallel ranks of one drafter run; needs ALL stamps) -> export
#       -> evaluate (per held-out dataset) -> tables -> plots (+ snakemake --report)
#
# Run: snakemake --cores 2            (CPU, embedded default)
#      snakemake --cores 8 --resources gpu=3

import os

from snakemake.utils import min_version

min_version("9.0")


report: "workflow/report/workflow.rst"


# the working directory's config/config.yaml (a project folder of your own: snakemake -d PROJECT -s
# CHECKOUT/Snakefile); without one, a --configfile alone (on the schema's defaults), else this checkout's.
# As a module (`module: snakefile: ...`), the importer's config.
CONFIGFILE = "config/config.yaml"
_here = os.path.exists(CONFIGFILE) or workflow.overwrite_configfiles


configfile: CONFIGFILE if _here else f"{workflow.basedir}/{CONFIGFILE}"


include: "workflow/rules/common.smk"
include: "workflow/rules/config.smk"
include: "workflow/rules/prompts.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/expand.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/warm.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/plots.smk"


rule all:
    default_target: True
    input:
        pipeline.all_outputs(),
