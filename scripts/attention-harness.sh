#!/usr/bin/env bash
# Builds the standalone kernel harness (kernels/harness/attention_harness.cu) for
# the GPU machine: no GPU needed here, the CUDA toolkit of cuda-toolchain.sh.
#
#   scripts/attention-harness.sh [KERNEL.cu ...]   # default: kernels/src/attention.cu
#   # device tool: carry ["target/attn-harness"],
#   #   command: target/attn-harness/attention 0   (correctness), ... 1 (benchmark)
#   #            ... 3 (the Hopper kernels' correctness), ... 4 (the forward's benchmark), ... 5 (forward + backward), ... 6 (Hopper forward + backward alone), ... 7 (the same after a second of load each)
#            ... 8 (the sliding-window target's shapes, timed), ... 9 (the same once each, for ncu), ... 10 (does a pageable copy wait for the stream?), ... 11 (short sequences, timed)
#
# With CUDA_COMPUTE_CAP=90 (the default) the binary also holds the Hopper kernels
# (kernels/src/attention_hopper.cu, or HOPPER_KERNEL=...), built for sm_90a.
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
  if [ "$cap" = 90 ]; then
    h=${HOPPER_KERNEL:-$root/kernels/src/attention_hopper.cu}
    h=$(cd "$(dirname "$h")" && pwd)/$(basename "$h")
    flags=(-gencode arch=compute_90a,code=sm_90a -DHFILE="\"$h\"")
  else
    flags=(-arch=sm_$cap)
  fi
  nvcc "${flags[@]}" -O3 --use_fast_math -std=c++17 -DKFILE="\"$k\"" \
    "$root/kernels/harness/attention_harness.cu" -o "$out/$name"
  echo "built $out/$name"
done
