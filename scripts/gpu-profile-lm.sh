#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-test.sh: the kernels of a 2-layer
# streamed training step of a preset's shapes under Nsight Compute (kernel
# durations only), summed by kernel name into $OUT/ncu-lm-<preset>.txt, then
# each launch of the element-wise kernels PROFILE_LAUNCHES names (default
# badd,cast,ucopy; empty for none) in order, with its grid and the GEMM before it.
#   bash scripts/gpu-profile-lm.sh [preset] [batch]
set -uo pipefail
preset=${1:-1b}
batch=${2:-4}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out" /tmp/prof-bin /tmp/prof-results
[ -x /tmp/prof-bin/bin/bench-lm ] || xz -dc gpu-bundle/bin.tar.xz | tar -C /tmp/prof-bin -xf - bin/bench-lm
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
report=$out/ncu-lm-$preset.txt
LM_BENCH=$preset:streamed LM_BENCH_LAYERS=2 LM_BENCH_STEPS=1 LM_BENCH_WARMUP=0 LM_BENCH_BATCH=$batch \
  BENCH_RESULTS_DIR=/tmp/prof-results timeout "${PROFILE_TIMEOUT:-240}" \
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv /tmp/prof-bin/bin/bench-lm --bench \
  >/tmp/ncu-lm.csv 2>/tmp/ncu-lm.err
echo "ncu exit $? ($ncu); preset $preset, 2 layers, batch $batch x 2048, one streamed step (forward, recompute, backward)" >"$report"
python3 scripts/ncu-summary.py /tmp/ncu-lm.csv 60 "${PROFILE_LAUNCHES-badd,cast,ucopy}" >>"$report" 2>&1
tail -n 5 /tmp/ncu-lm.err >>"$report"
