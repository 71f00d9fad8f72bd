#!/usr/bin/env bash
# Makes the bitsandbytes wheel that scripts/bnb-fixtures.py needs on the GPU
# machine (which has torch 2.11, transformers 5.x and CUDA 13.0 libraries but
# no package index and no bitsandbytes), in the git-ignored folder .whl/
# (carry it: `carry: [".whl"]`).
#
#   bash scripts/bnb-wheel.sh
#
# bitsandbytes 0.50.2's manylinux x86_64 wheel (about 43 MB) holds a library
# per CUDA and ROCm version; the repacked one keeps only the CUDA 13.0 library
# (libbitsandbytes_cuda130.so) and the CPU one, and drops the others from its
# RECORD, so it installs as the same version at a few MB.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
DIR=.whl
VERSION=0.50.2
# The GPU machine's python3 (device KINDS.md: Python 3.12.3).
TARGET_PY=312

mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
  --implementation cp --abi "cp$TARGET_PY" \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$tmp" "bitsandbytes==$VERSION"
wheel=$(ls "$tmp"/bitsandbytes-"$VERSION"-*.whl)
rm -f "$DIR"/bitsandbytes-*.whl

"$PY" - "$wheel" "$DIR" <<'EOF'
import os, sys, zipfile

src, out_dir = sys.argv[1], sys.argv[2]
dst = os.path.join(out_dir, os.path.basename(src))
keep_libs = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")

def dropped(name):
    base = os.path.basename(name)
    return base.startswith("libbitsandbytes_") and base not in keep_libs

with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    if not any(os.path.basename(n) == keep_libs[0] for n in names):
        sys.exit(f"{src}: no {keep_libs[0]} in the wheel")
    gone = [n for n in names if dropped(n)]
    for n in names:
        if n in gone:
            continue
        data = zin.read(n)
        if n.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if l.split(",")[0] not in gone).encode()
        zout.writestr(zin.getinfo(n), data)
mb = lambda p: os.path.getsize(p) / 1e6
print(f"{dst}: {mb(dst):.1f} MB (from {mb(src):.1f} MB; dropped {len(gone)} libraries)")
EOF
