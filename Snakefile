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

from snakemake.utils import min_version

min_version("9.0")


report: "workflow/report/workflow.rst"


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
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
