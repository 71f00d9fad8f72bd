#!/usr/bin/env bash
# Builds every CUDA test binary, the examples and the benches here (no GPU
# needed), strips them and bundles them into gpu-bundle/ (git-ignored, < 64 MiB)
# with a run.sh that runs them all on the GPU machine:
#
#   scripts/gpu-test.sh                      # build + bundle
#   # device tool: carry ["gpu-bundle"], command: bash gpu-bundle/run.sh
#
# Building from a second worktree while another builds in this one: set
# CUDA_TOOLCHAIN_DIR to this checkout's .cuda and CARGO_TARGET_DIR to its
# target/cuda, so both builds use the same paths in RUSTFLAGS and share the
# compiled dependencies instead of rebuilding each other's. Tests that read
# fixtures through CARGO_MANIFEST_DIR look for them at the path of the
# checkout that built them: run such a bundle from that checkout.
#
# run.sh writes each binary's output and a one-screen summary under $OUT
# (or ./gpu-out) and exits non-zero when anything failed. Extra arguments to
# run.sh select what runs: `tests`, `benches`, `examples` (default: all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
eval "$(scripts/cuda-toolchain.sh)"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/cuda}
bundle=$root/gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/bin"

# The executables cargo says it built (its JSON messages on stdin): with
# `tests`, "name<TAB>path" of each test binary; otherwise
# "kind<TAB>name<TAB>path" of each example and bench.
executables() {
  python3 -c '
import json, sys
tests = sys.argv[1] == "tests"
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m.get("target", {}).get("kind", [""])[0]
    if tests and m["profile"]["test"]:
        print(m["target"]["name"] + "\t" + m["executable"])
    elif not tests and kind in ("example", "bench"):
        print(kind + "\t" + m["target"]["name"] + "\t" + m["executable"])
' "$1"
}

# Test binaries: cargo tells which executables it built.
cargo test --release --workspace --features cuda --no-run --message-format=json 2>/dev/null \
  | executables tests >"$bundle/tests.list" || true
# The listing above hides cargo's messages; this shows errors, if any, readably.
cargo test --release --workspace --features cuda --no-run

# Release binaries: examples and benches.
cargo build --release --features cuda --examples --benches --message-format=json 2>/dev/null \
  | executables release >"$bundle/release.list" || true
cargo build --release --features cuda --examples --benches

: >"$bundle/manifest"
while IFS=$'\t' read -r name exe; do
  cp "$exe" "$bundle/bin/test-$name"
  echo "test	test-$name" >>"$bundle/manifest"
done <"$bundle/tests.list"
while IFS=$'\t' read -r kind name exe; do
  cp "$exe" "$bundle/bin/$kind-$name"
  echo "$kind	$kind-$name" >>"$bundle/manifest"
done <"$bundle/release.list"
strip "$bundle"/bin/*
# One solid xz stream with a large dictionary: every binary carries the same
# ~32 MB of Candle kernels, which the dictionary then stores once. Preset 1
# compresses the 1 GB tar in about 35 s of one core to 22 MB; preset 6 took
# 15 minutes for 19 MB.
tar -C "$bundle" -cf - bin | xz --lzma2=preset=1,dict=256MiB -T1 >"$bundle/bin.tar.xz"
rm -rf "$bundle/bin" "$bundle/tests.list" "$bundle/release.list"
cp scripts/gpu-run.sh "$bundle/run.sh"
cp scripts/nccl-lib.sh "$bundle/nccl-lib.sh"
# Benchmarks may read helper scripts (PyTorch references) from benches/.
du -sh "$bundle"
echo "bundle ready: $(cat "$bundle/manifest" | wc -l) binaries"
