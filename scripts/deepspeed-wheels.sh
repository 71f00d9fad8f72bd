#!/usr/bin/env bash
# Makes the wheels that the DeepSpeed ZeRO-3 peer (benches/deepspeed_zero3.py,
# run there by scripts/gpu-deepspeed.sh) needs on the GPU machine, which has no
# package index, in the git-ignored folder .whl/ (carry it: `carry: [".whl"]`).
#
#   bash scripts/deepspeed-wheels.sh
#
# - deepspeed 0.19.8 is published as source only: its wheel is built here with
#   DS_BUILD_OPS=0 (pure Python; DeepSpeedCPUAdam is JIT-built there by ninja
#   and g++ at first use, about a minute).
# - Its needs that the GPU machine lacks (its image has torch 2.11, einops,
#   msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm, nvidia-ml-py):
#   hjson and pydantic 2 with pydantic-core (compiled: cp312, manylinux),
#   annotated-types and typing-inspection; typing-extensions travels too, since
#   pydantic needs a recent one and the image's version is not known here.
# About 5 MB in all. Wheels of these packages at other versions are removed
# from .whl/ (two versions of one package stop the install there).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
DIR=.whl
# The GPU machine's python3 (device KINDS.md: Python 3.12.3).
TARGET_PY=312
# name (as in a wheel's file name) and version; pinned so that every run
# carries the same set. pydantic 2.14.4 pins pydantic-core 2.50.5.
PINS="deepspeed 0.19.8
hjson 3.1.0
pydantic 2.14.4
pydantic_core 2.50.5
annotated_types 0.8.0
typing_inspection 0.4.5
typing_extensions 4.16.0"

mkdir -p "$DIR"
while read -r name version; do
  for f in "$DIR/$name"-*.whl; do
    [ -e "$f" ] || continue
    [[ "$(basename "$f")" == "$name-$version-"* ]] || { echo "removing $f"; rm -f "$f"; }
  done
done <<<"$PINS"

ds=$(awk '$1=="deepspeed"{print $2}' <<<"$PINS")
if ! [ -e "$DIR/deepspeed-$ds-py3-none-any.whl" ]; then
  tmp=$(mktemp -d)
  echo "building deepspeed $ds (DS_BUILD_OPS=0) ..."
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-cache-dir "deepspeed==$ds" -w "$tmp"
  mv "$tmp/deepspeed-$ds-py3-none-any.whl" "$DIR/"
  rm -rf "$tmp"
fi

# The others, for the GPU machine's Python whatever this machine's is.
specs=$(awk '$1!="deepspeed"{gsub("_","-",$1); print $1"=="$2}' <<<"$PINS")
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
  --implementation cp --abi "cp$TARGET_PY" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" $specs

ls -la "$DIR"
du -sh "$DIR"
