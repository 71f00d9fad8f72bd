#!/usr/bin/env bash
# Shows what ptxas made of one of our CUDA kernels, here, without a GPU: its
# register and spill report, ptxas's wgmma warnings, and the SASS with an
# instruction histogram. Reading the SASS is how we found the Hopper
# backward's per-tile bookkeeping (mask checks, descriptor arithmetic).
#
#   scripts/kernel-sass.sh KERNEL.cu FUNCTION [OUT.sass]
#   scripts/kernel-sass.sh kernels/src/attention_hopper.cu cqsa_bwd_hopper_bf16_d128
#
# Built for sm_90a when FUNCTION is one of the Hopper kernels (`_hopper_`),
# otherwise for CUDA_COMPUTE_CAP (default 90). A "C7510"-"C7520" line from
# ptxas ("wgmma.mma_async instructions are serialized") means every wgmma
# waits for the previous one: look for WARPGROUP.DEPBAR after each HGMMA.
#
# cuobjdump and nvdisasm are not in the CUDA 13.0 wheels of cuda-toolchain.sh;
# they come from their own wheels into .cuda-tools/ (git-ignored) on first use.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,16p' "$0"; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
eval "$("$root/scripts/cuda-toolchain.sh")"
src=$1 fun=$2 out=${3:-$root/target/sass/$2.sass}
tools=${CUDA_SASS_TOOLS_DIR:-$root/.cuda-tools}
if [ ! -x "$tools/nvidia/cu13/bin/cuobjdump" ] || [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
  echo "kernel-sass: installing cuobjdump and nvdisasm into $tools" >&2
  python3 -m pip install --quiet --disable-pip-version-check --target "$tools" \
    'nvidia-cuda-cuobjdump==13.2.*' 'nvidia-cuda-nvdisasm>=13.2' >&2
fi
export PATH=$tools/nvidia/cu13/bin:$PATH
case $fun in
  *_hopper_*) arch=(-gencode arch=compute_90a,code=sm_90a) ;;
  *) arch=(-arch=sm_${CUDA_COMPUTE_CAP:-90}) ;;
esac
mkdir -p "$(dirname "$out")"
cubin=$(mktemp --suffix=.cubin) log=$(mktemp)
trap 'rm -f "$cubin" "$log"' EXIT
nvcc "${arch[@]}" -O3 --use_fast_math -std=c++17 -I"$(dirname "$src")" -cubin -Xptxas -v "$src" -o "$cubin" 2>"$log"
grep -A3 "Compiling entry function '$fun'" "$log" | grep -E "registers|spill" || true
grep -E "C75[0-9][0-9].*'$fun'" "$log" || echo "ptxas: no wgmma warnings for $fun"
cuobjdump -sass -fun "$fun" "$cubin" | sed 's@/\* 0x[0-9a-f]* \*/@@' | grep -v '^\s*$' >"$out"
echo "$(grep -c '/\*[0-9a-f]\{4\}\*/' "$out") instructions in $out; the most frequent:"
grep -oE '/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_]+' "$out" | awk '{print $NF}' | sort | uniq -c | sort -rn | head -20
