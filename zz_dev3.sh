#!/bin/bash
# Session 21 call 2: attention tests (the varlen backward), calibrate, the combined report with varlen and its peers.
REAL=$OUT; export OUT=/tmp/p; mkdir -p $OUT
export CQSA_CALIBRATION_DIR=$PWD/benches/results/calib; rm -rf "$CQSA_CALIBRATION_DIR"
t0=$(date +%s)
RUN_TAG=tests GPU_TEST_TOPICS="attention dist" bash gpu-bundle/run.sh tests; echo "tests $(( $(date +%s)-t0 ))s"
tar -C /tmp/p -czf $REAL/dev3.tgz .
RUN_TAG=cal GPU_ONLY=example-calibrate GPU_ARGS_calibrate="--estimate-n 4194304" bash gpu-bundle/run.sh examples; echo "cal $(( $(date +%s)-t0 ))s"
tar -C /tmp/p -czf $REAL/dev3.tgz .
RUN_TAG=attn CQSA_VERBOSE=1 GPU_ONLY=attention CQSA_BENCH_NS=4096,8192,16384 CQSA_BENCH_REPS=10 CQSA_BENCH_OOC=1 CQSA_OOC_N=4194304 PY_ARGS_attention_torch="--ns 4096,8192,16384 --reps 10" bash gpu-bundle/run.sh benches; echo "attn $(( $(date +%s)-t0 ))s"
tar -C /tmp/p -czf $REAL/dev3.tgz .
