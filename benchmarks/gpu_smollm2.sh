#!/usr/bin/env bash
# SmolLM2-135M-Instruct as the target on one GPU (benchmarks/results/smollm2_h200/), in stages that
# fit calls of at most 10 minutes on a machine that keeps /tmp between calls made back to back:
#
#   bash benchmarks/gpu_smollm2.sh stash  GGUF_PART_A   # the first half of the .gguf to $WORK
#   bash benchmarks/gpu_smollm2.sh data   GGUF_PART_B [OUT]  # join, build the target, expand, tokenize
#   bash benchmarks/gpu_smollm2.sh train  OUT           # recipes and data rules side by side (tau)
#   bash benchmarks/gpu_smollm2.sh speed  OUT           # the default recipe alone: speed-ups, AR floor
#
# On a machine with the registry, `data` can start from the installed package instead:
#   GGUF=$(python -c '...') bash benchmarks/gpu_smollm2.sh data -
# Data: config/smollm2.yaml's mix (21,681 prompts), expanded once by the batched backend; tokenized
# once per way of reading the replies (tokenize.cut_replies x tokenize.reply_ids).
set -euo pipefail
STAGE=$1
ARG=${2:-}
WORK=${WORK:-/tmp/smollm2}
TARGET=$WORK/target
DATA=$WORK/data
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
mkdir -p "$WORK"
R=(python3 benchmarks/recipes.py --config "${CONFIG:-config/smollm2.yaml}" --target "$TARGET" --data "$DATA"
   --set train.attention=sdpa)
# the rules compared: the default first
VARIANTS=("cut_loop generated" "cut_loop text" "drop generated" "mask_end generated")
# the runs of the train stage (NAME RECIPE SEED CUT_REPLIES REPLY_IDS): the default recipe on each rule,
# the other recipes on the default rule; the speed stage evaluates the first SPEED_RUNS alone
RUNS=("default dflash2 0 cut_loop generated" "dspark dspark 0 cut_loop generated"
      "dflash_kl dflash_kl 0 cut_loop generated" "dflash_ce dflash_ce 0 cut_loop generated"
      "text dflash2 0 cut_loop text" "drop dflash2 0 drop generated" "mask_end dflash2 0 mask_end generated")

report() {  # DIR OUT: DIR's files as OUT/NAME.tar.gz, its .md and .png files beside it
    mkdir -p "$2"
    tar czf "$2/$(basename "$1").tar.gz" -C "$(dirname "$1")" "$(basename "$1")"
    find "$1" -maxdepth 1 \( -name '*.md' -o -name '*.png' \) -exec cp {} "$2/" \;
}

case $STAGE in
stash)
    cp "$ARG" "$WORK/gguf.part_a"
    ;;
data)
    OUTDIR=${3:-}
    if [ ! -d "$TARGET" ]; then
        gguf=${GGUF:-$WORK/smollm2.gguf}
        [ -n "${GGUF:-}" ] || cat "$WORK/gguf.part_a" "$ARG" > "$gguf"
        sha256sum "$gguf"
        python3 resources/make_real_target.py --out "$TARGET" --gguf "$gguf"
    fi
    # the first variant writes the prompts and the expansions; the others only tokenize them again
    set -- ${VARIANTS[0]}
    "${R[@]}" --out "$WORK/prep" --data-only --set tokenize.cut_replies=$1 --set tokenize.reply_ids=$2
    for v in "${VARIANTS[@]:1}"; do
        set -- $v
        "${R[@]}" --out "$WORK/prep_$1_$2" --data-only --set tokenize.cut_replies=$1 \
            --set tokenize.reply_ids=$2 > "$WORK/prep_$1_$2.log" 2>&1 &
    done
    wait
    if [ -n "$OUTDIR" ]; then
        mkdir -p "$WORK/report_data"
        cp "$DATA"/*_stats.json "$WORK"/prep*/recipes.log "$WORK/report_data/" 2>/dev/null || true
        for f in "$WORK"/prep_*/recipes.log; do cp "$f" "$WORK/report_data/$(basename "$(dirname "$f")").log"; done
        python3 -c "import pandas as pd, glob
for f in sorted(glob.glob('$DATA/expanded_*.parquet')):
    df = pd.read_parquet(f, columns=['finish_reason', 'num_new_tokens'])
    print(f.split('/')[-1], len(df), df.finish_reason.value_counts().to_dict(), int(df.num_new_tokens.sum()))
" | tee "$WORK/report_data/expanded.txt"
        report "$WORK/report_data" "$OUTDIR"
    fi
    ;;
train)
    # every run on the same GPU at once: tau does not depend on the GPU's load (the speed stage
    # measures speed alone); the same steps, data order and anchors for every row
    STEPS=${STEPS:-700}
    mkdir -p "$ARG" "$WORK/report_train"
    pids=()
    run() {  # NAME RECIPE SEED CUT IDS
        timeout "${RUN_LIMIT_S:-540}" "${R[@]}" --out "$WORK/runs/$1" --recipes "$2" --seeds "$3" \
            --label "$2 [$4, $5]" --set tokenize.cut_replies=$4 --set tokenize.reply_ids=$5 \
            --set train.max_steps=$STEPS --set train.eval_every=100 --set evaluate.target_step=static \
            --set evaluate.num_prompts=${EVAL_PROMPTS:-24} --methods dflash > "$WORK/report_train/$1.log" 2>&1 &
        pids+=($!)
    }
    for r in "${RUNS[@]}"; do run $r; done
    for p in "${pids[@]}"; do wait "$p" || echo "a run failed or was stopped: $p"; done
    for d in "$WORK"/runs/*/; do
        cp "$d"/runs/*/metrics.csv "$WORK/report_train/$(basename "$d")_metrics.csv" 2>/dev/null || true
    done
    done_runs=$(for d in "$WORK"/runs/*/; do if [ -f "$d/runs.csv" ]; then echo "$d"; fi; done)
    [ -z "$done_runs" ] || python3 benchmarks/recipes.py --out "$WORK/report_train" --combine $done_runs
    python3 benchmarks/plot_data_curve.py "$WORK/runs" "$WORK/report_train/data_curve.png" \
        | tee "$WORK/report_train/data_curve.txt" || true
    report "$WORK/report_train" "$ARG"
    ;;
speed)
    # each recipe's drafter alone on the GPU: compiled AR beside it on every eval set; then the peers
    mkdir -p "$ARG" "$WORK/report_speed"
    python3 benchmarks/ar_floor.py --target "$TARGET" --out "$WORK/report_speed/ar_floor.json" || echo "ar_floor failed"
    done_runs=()
    for r in "${RUNS[@]:0:${SPEED_RUNS:-2}}"; do
        set -- $r
        [ -d "$WORK/runs/$1/runs/${2}_s$3/drafter" ] || continue
        rm -rf "$WORK/speed/$1" && mkdir -p "$WORK/speed" && cp -r "$WORK/runs/$1" "$WORK/speed/$1"
        rm -f "$WORK/speed/$1/runs/${2}_s$3/"*.summary.json
        "${R[@]}" --out "$WORK/speed/$1" --recipes "$2" --seeds "$3" --label "$2 [$4, $5]" \
            --set tokenize.cut_replies=$4 --set tokenize.reply_ids=$5 --set train.max_steps=${STEPS:-700} \
            --set evaluate.target_step=compiled --set evaluate.num_prompts=${EVAL_PROMPTS:-32} --methods dflash,ar \
            > "$WORK/report_speed/$1.log" 2>&1 && done_runs+=("$WORK/speed/$1") || echo "speed of $1 failed"
    done
    [ ${#done_runs[@]} -eq 0 ] || python3 benchmarks/recipes.py --out "$WORK/report_speed" --combine "${done_runs[@]}"
    # the peers (HF generate, prompt lookup: eager, ~10x slower per token) on fewer prompts
    set -- ${RUNS[0]}
    rm -rf "$WORK/peers" && cp -r "$WORK/runs/$1" "$WORK/peers" && rm -f "$WORK/peers/runs/${2}_s$3/"*.summary.json
    "${R[@]}" --out "$WORK/peers" --recipes "$2" --seeds "$3" --label "$2 [$4, $5]" --set tokenize.cut_replies=$4 \
        --set tokenize.reply_ids=$5 --set train.max_steps=${STEPS:-700} --set evaluate.target_step=compiled \
        --set evaluate.num_prompts=${PEER_PROMPTS:-4} --methods dflash,ar,hf_generate,prompt_lookup \
        > "$WORK/report_speed/peers.log" 2>&1 || echo "peers failed"
    mkdir -p "$WORK/report_speed/peers"
    cp "$WORK/peers/runs.csv" "$WORK/peers/runs/${2}_s$3/"*.summary.json "$WORK/report_speed/peers/" || true
    for d in "${done_runs[@]}"; do
        mkdir -p "$WORK/report_speed/$(basename "$d")"
        cp "$d"/runs/*/*.summary.json "$WORK/report_speed/$(basename "$d")/" || true
    done
    report "$WORK/report_speed" "$ARG"
    ;;
*)
    echo "usage: $0 stash|data|train|speed ARG" >&2
    exit 2
    ;;
esac
