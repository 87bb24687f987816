#!/usr/bin/env bash
# The recipe benchmark (benchmarks/recipes.py) on one GPU, as committed in benchmarks/results/recipes_h200/.
#
#   bash benchmarks/gpu_recipes.sh OUT tiny    [SEEDS]   # the embedded default: tiny target trained here
#   bash benchmarks/gpu_recipes.sh OUT smollm2 [SEEDS]   # SmolLM2-135M-Instruct (TARGET=its HF dir, or
#                                                        # GGUF=the .gguf file to build it from)
#
# Every recipe takes the same data, steps, seeds and attention path (SDPA with the dense DFlash mask,
# nothing compiled: the recipes differ in graphs, and a comparison should not time compiles); the
# evaluation runs the target and drafter steps as CUDA graphs (evaluate.target_step: static).
# Work files go to WORK (default $TMPDIR/recipes); the tables and the plot are copied to OUT/WHAT.
set -euo pipefail
OUT=$1
WHAT=$2
SEEDS=${3:-0,1,2}
WORK=${WORK:-${TMPDIR:-/tmp}/recipes}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
COMMON=(--seeds "$SEEDS" --copy-to "$OUT/$WHAT" --set train.attention=sdpa --set evaluate.target_step=static
        --set expand.decode_step=static)
case $WHAT in
tiny)
    # config/config.yaml as the CPU default runs it (1.2 epochs, 3 layers, block 16), batch 256 expansion
    python3 benchmarks/recipes.py --out "$WORK/tiny" --threads 16 --window 128 --set expand.batch_size=256 "${COMMON[@]}"
    ;;
smollm2)
    TARGET=${TARGET:-$WORK/smollm2-135m-instruct}
    if [ ! -d "$TARGET" ]; then
        python3 resources/make_real_target.py --out "$TARGET" ${GGUF:+--gguf "$GGUF"}
    fi
    # config/smollm2.yaml with 1 epoch (~600 steps of 8 sequences) per recipe
    python3 benchmarks/recipes.py --out "$WORK/smollm2" --config config/smollm2.yaml --target "$TARGET" --window 256 \
        --set train.epochs=1 "${COMMON[@]}"
    ;;
*)
    echo "usage: $0 OUT tiny|smollm2 [SEEDS]" >&2
    exit 2
    ;;
esac
