#!/usr/bin/env bash
# Builds the standalone kernel harness (kernels/harness/attention_harness.cu) for
# the GPU machine: no GPU needed here, the CUDA toolkit of cuda-toolchain.sh.
#
#   scripts/attention-harness.sh [KERNEL.cu ...]   # default: kernels/src/attention.cu
#   # device tool: carry ["target/attn-harness"],
#   #   command: target/attn-harness/attention 0   (correctness), ... 1 (benchmark)
#
# One binary per kernel source, named after it, in target/attn-harness/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
eval "$("$root/scripts/cuda-toolchain.sh")"
out=$root/target/attn-harness
mkdir -p "$out"
cap=${CUDA_COMPUTE_CAP:-90}
[ $# -gt 0 ] || set -- "$root/kernels/src/attention.cu"
for k in "$@"; do
  k=$(cd "$(dirname "$k")" && pwd)/$(basename "$k")
  name=$(basename "$k" .cu)
  nvcc -arch=sm_$cap -O3 --use_fast_math -std=c++17 -DKFILE="\"$k\"" \
    "$root/kernels/harness/attention_harness.cu" -o "$out/$name"
  echo "built $out/$name"
done
