#!/usr/bin/env bash
# Produces benches/results/reliability-h200.json on the GPU machine from the
# bundle that scripts/gpu-test.sh builds (soak and reliability are benches, so
# they are in it). In stages, each of which fits one device call (10 minutes):
#
#   bash scripts/gpu-reliability.sh tests   # faults (CUDA, device-full case included), reduced soak, crash (50 SIGKILLs)
#   bash scripts/gpu-reliability.sh soak    # benches/soak.rs: 10,000 steps (SOAK_STEPS to change)
#   bash scripts/gpu-reliability.sh fuzz    # benches/fuzz.rs: 10^5 cases per target (FUZZ_CASES to change)
#   bash scripts/gpu-reliability.sh table   # benches/reliability.rs: runs the fault cases, bad inputs, reads the three above
#
# (several stages in one call: `bash scripts/gpu-reliability.sh tests soak`).
# Results accumulate in target/reliability (target/ is ignored, so it stays on
# a warm machine between calls) and come back as $OUT/reliability-results.tar.gz
# (crash-h200.json, soak-h200.json, fuzz-h200.json, reliability-h200.json),
# beside run.sh's summaries and logs. Exits non-zero if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
res=$PWD/target/reliability
mkdir -p "$res"
export BENCH_RESULTS_DIR=$res
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
fail=0
for stage in "$@"; do
  case "$stage" in
    tests)
      STREAMER_CRASH_REPORT=$res/crash-h200.json GPU_TEST_TOPICS="faults soak crash" \
        GPU_ONLY=integration RUN_TAG=rel-tests bash gpu-bundle/run.sh tests || fail=1 ;;
    soak) GPU_ONLY=soak RUN_TAG=rel-soak bash gpu-bundle/run.sh benches || fail=1 ;;
    fuzz) GPU_ONLY=fuzz RUN_TAG=rel-fuzz bash gpu-bundle/run.sh benches || fail=1 ;;
    table) GPU_ONLY=reliability RUN_TAG=rel-table bash gpu-bundle/run.sh benches || fail=1 ;;
    *) echo "unknown stage $stage (tests, soak, fuzz, table)" >&2; exit 2 ;;
  esac
done
tar -czf "$out/reliability-results.tar.gz" -C "$res" .
ls -l "$res"
exit $fail
