#!/usr/bin/env bash
# Session 22 call 1 (temporary): harness checks and the window profile, attention tests, attention bench without OOC.
REAL=$OUT; export OUT=/tmp/p; export CQSA_CALIBRATION_DIR=$PWD/benches/results/calib; rm -rf "$CQSA_CALIBRATION_DIR" /tmp/p; mkdir -p /tmp/p
H=target/attn-harness/attention
( time $H 3 ) > $REAL/harness3.txt 2>&1; echo "harness3 rc=$?"; grep -c "^OK" $REAL/harness3.txt; grep -c "^FAIL" $REAL/harness3.txt
$H 8 > $REAL/harness8.txt 2>&1; echo "harness8 rc=$?"; cat $REAL/harness8.txt
( time ncu --clock-control none -k regex:'cqsa_(fwd|bwd)_hopper' --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats $H 9 ) > $REAL/ncu-window.txt 2>&1; echo "ncu rc=$?"; grep -E "cqsa_|Duration|Throughput|Hit Rate" $REAL/ncu-window.txt | head -60
RUN_TAG=tests GPU_TEST_TOPICS="attention" bash gpu-bundle/run.sh tests > $REAL/tests.txt 2>&1; echo "tests rc=$?"; tail -15 $REAL/tests.txt
tar -C /tmp/p -czf $REAL/dev1a.tgz .
RUN_TAG=attn CQSA_VERBOSE=1 GPU_ONLY=attention CQSA_BENCH_NS=4096,8192,16384 CQSA_BENCH_REPS=10 PY_ARGS_attention_torch="--ns 4096,8192,16384 --reps 10" bash gpu-bundle/run.sh benches > $REAL/bench.txt 2>&1; echo "bench rc=$?"; tail -30 $REAL/bench.txt
tar -C /tmp/p -czf $REAL/dev1.tgz .
