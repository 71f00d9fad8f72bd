#!/usr/bin/env bash
# The open issues' GPU checks, in stages that each fit one device call, from
# the bundle that scripts/gpu-test.sh builds. Every stage writes run.sh's
# summaries and logs under $OUT, its result files under $OUT/res/<stage>,
# and packs everything into $OUT/all.tar (one file comes back, however many
# rows ran):
#
#   bash scripts/gpu-checks.sh house       # every CUDA test (bitsandbytes fixtures written
#                                          # first), then the streaming and lm 3b benches:
#                                          # the house issue's no-regression check (~280 s)
#   bash scripts/gpu-checks.sh tests       # every CUDA test only (the first part of house)
#   bash scripts/gpu-checks.sh quantized   # 8B generate at batch 1 (nf4, bf16) with the
#                                          # transformers + bitsandbytes peer, the 8B bf16 rows
#                                          # in a 24 GiB cap (~330 s)
#   bash scripts/gpu-checks.sh generate-nf4 # quantized's batch-1 nf4 and bf16 rows, no peer
#                                          # (~150 s; GEN_NF4_TIMELINE=1: nf4's timeline)
#   bash scripts/gpu-checks.sh qlora       # LoRA r 16 on all seven projections of an 8B NF4
#                                          # base in a 24 GiB cap: the default policy, then
#                                          # spilling to the host (spill:6GiB:40GiB), then
#                                          # the bf16 base without a cap, then transformers +
#                                          # PEFT + bitsandbytes QLoRA at 8B (~330 s)
#   bash scripts/gpu-checks.sh qlora-accum # that 8B NF4 LoRA step in the cap as QLORA_ACCUM
#                                          # (1 2 4 8; set empty: none) micro-batches in turn, as the
#                                          # LoRA plan chooses (NF4, and bf16 unless
#                                          # QLORA_DENSE_PLAN=0), 4 with
#                                          # keep:X for X in QLORA_KEEP (none), then the bf16
#                                          # base without a cap (~450 s)
#   bash scripts/gpu-checks.sh qlora-timeline # qlora-accum's LoRA plan row with the pool's
#                                          # timeline and host spans (~80 s)
#   bash scripts/gpu-checks.sh qlora70     # the same LoRA on a 70B NF4 base, 4 x 2,048 tokens in
#                                          # a 24 GiB cap (host ~51 GiB; QLORA70_PLAN=1: as the
#                                          # LoRA plan splits it), then the same peer
#                                          # resident (~45 GiB of weights) in the same call
#   bash scripts/gpu-checks.sh generate8   # 8B bf16 generate, batches 1, 64, 256 streamed without
#                                          # a budget, batch 1 keeping 24 layers resident,
#                                          # then in a 24 GiB cap: every layer
#                                          # streamed, the best split (first layers resident),
#                                          # the planner's choice; transformers + accelerate at
#                                          # batches 16-128 in the same budget (~400 s)
#   bash scripts/gpu-checks.sh generate24  # the 24 GiB rows of generate8 only, each a job of
#                                          # GEN24_JOB (8) prompts per sequence in flight (a
#                                          # long job, as the throughput issue's workloads are;
#                                          # GEN24_ROWS=1: the every-layer-streamed row only),
#                                          # then the transformers + accelerate peer at batches
#                                          # GEN24_PEER_BATCHES (64,128; none: no peer) (~500 s)
#   bash scripts/gpu-checks.sh split       # the batch_generate and pretrained CUDA tests, then
#                                          # generate8 (GEN8_BATCHES=1 for a shorter call)
#   bash scripts/gpu-checks.sh generate70  # 70B NF4 streamed generate in a 24 GiB cap (~250 s
#                                          # of it the run; the host needs ~80 GiB); GEN70_JOB
#                                          # (6) prompts per sequence in flight, GEN70_HOST_KV_GIB
#                                          # (0; a list such as 0,40: one row each) host memory
#                                          # the plan may give to kv caches (the host needs that
#                                          # much more)
#   bash scripts/gpu-checks.sh setup       # host masters of 8B shapes from a file, and an 8B
#                                          # NF4 base (benches/setup.rs), beside transformers'
#                                          # from_pretrained of the same shapes in f32
#                                          # (benches/setup_torch.py; the host needs ~60 GiB)
#   bash scripts/gpu-checks.sh train8b     # 8B full fine-tune without a budget, DeviceAdamW:
#                                          # 8 x 2,048 and 2 x 8,192 tokens a step (the training
#                                          # issue's no-regression and long-sequence rows; ~119 GiB
#                                          # of device memory: an H200 only; ~500 s;
#                                          # train8b-2k runs the 2,048-token row only;
#                                          # each row writes the pool's timeline)
#   bash scripts/gpu-checks.sh train8b-cap24  # 8B full fine-tune in a 24 GiB cap, host AdamW with
#                                          # bf16 moments, inputs offloaded, 4 x 8 x 2,048 tokens
#                                          # in one weight visit, with the pool's timeline (the
#                                          # host needs ~105 GiB; ~250 s)
#   bash scripts/gpu-checks.sh train14b    # Qwen2.5-14B shapes, full fine-tune, 8 x 2,048 tokens,
#                                          # the device plan's choice (LORA_BENCH_PLAN=1) with f32
#                                          # and with bf16 moments (an H200 only; host ~60 GiB;
#                                          # train14b-f32 or train14b-bf16 runs one of the two)
#   bash scripts/gpu-checks.sh profile8b   # the kernels of two Llama 3.1 8B layers' streamed
#                                          # step, 8 x 2,048 tokens, recomputed, under Nsight
#                                          # Compute (scripts/gpu-profile-lm.sh; ~200 s)
#
# Several stages in one call: `bash scripts/gpu-checks.sh house quantized`.
# Unpack: tar -xf all.tar (then each logs-<tag>.tar.gz).
set -uo pipefail
cd "$(dirname "$0")/.."
B=${BUNDLE:-gpu-bundle}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export RUN_TAR=all.tar
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1
fail=0
# r TAG VAR=VALUE... CMD...: one run.sh invocation with its results under res/TAG.
r() {
  local tag=$1
  shift
  mkdir -p "$OUT/res/$tag"
  env RUN_TAG="$tag" BENCH_RESULTS_DIR="$OUT/res/$tag" "$@" || fail=1
}
bnb() {
  python3 -m pip install -q --no-deps --target /tmp/bnb .whl/bitsandbytes-0.50.2-*.whl
  export PYTHONPATH=/tmp/bnb
}
# Every CUDA test, the bitsandbytes fixtures written first.
cuda_tests() {
  bnb
  python3 scripts/bnb-fixtures.py /tmp/bnb-fx >"$OUT/bnb-fixtures.log" 2>&1
  r tests BNB_FIXTURES=/tmp/bnb-fx timeout 240 bash "$B/run.sh" tests
}
G="GPU_ONLY=bench-generate"
for stage in "$@"; do
  case "$stage" in
    tests)
      cuda_tests
      ;;
    house)
      cuda_tests
      r stream GPU_ONLY=bench-streaming timeout 120 bash "$B/run.sh" benches
      r lm3b GPU_ONLY=bench-lm LM_BENCH=3b:streamed LM_BENCH_ACTIVATIONS=auto \
        LM_BENCH_OPTIMIZER=device LM_BENCH_STEPS=3 LM_BENCH_WARMUP=1 timeout 200 bash "$B/run.sh" benches
      ;;
    quantized)
      r nf4 $G GEN_BENCH_QUANTIZE=nf4 GEN_BENCH_BATCHES=1 timeout 70 bash "$B/run.sh" benches
      r bf16 $G GEN_BENCH_BATCHES=1 timeout 80 bash "$B/run.sh" benches
      r b24 $G GEN_BENCH_BATCHES= GEN_BENCH_DEVICE_BUDGET_GIB=24 timeout 90 bash "$B/run.sh" benches
      bnb
      r bnb PY_ARGS_qlora_torch="--modes generate" GPU_ONLY=qlora_torch timeout 150 bash "$B/run.sh" benches
      ;;
    generate-nf4)
      # The batch-1 rows of quantized alone (nf4, bf16; no peer).
      # GEN_NF4_TIMELINE=1: the nf4 row writes the pool's timeline.
      TL=""
      [ "${GEN_NF4_TIMELINE:-0}" = 1 ] && TL="GEN_BENCH_TIMELINE=$OUT/res/nf4"
      r nf4 $G GEN_BENCH_QUANTIZE=nf4 GEN_BENCH_BATCHES=1 $TL timeout 70 bash "$B/run.sh" benches
      r bf16 $G GEN_BENCH_BATCHES=1 timeout 80 bash "$B/run.sh" benches
      ;;
    qlora)
      T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
      L="GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MODES=lora LORA_BENCH_TARGETS=$T7"
      r qlora-auto $L LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 timeout 80 bash "$B/run.sh" benches
      r qlora-spill $L LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_TIMELINE="$OUT/res/qlora-spill" \
        LORA_BENCH_ACTIVATIONS=spill:6GiB:40GiB timeout 100 bash "$B/run.sh" benches
      r dense $L timeout 80 bash "$B/run.sh" benches
      bnb
      r qpeer8 PY_ARGS_qlora_torch="--models 8b" GPU_ONLY=qlora_torch timeout 120 bash "$B/run.sh" benches
      ;;
    qlora-accum)
      # The 8B NF4 LoRA step in a 24 GiB cap as 1, 2, 4 and 8 micro-batches
      # one after another (LORA_BENCH_ACCUM), then the bf16 base without a cap.
      T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
      L="GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MODES=lora LORA_BENCH_TARGETS=$T7"
      for a in ${QLORA_ACCUM-1 2 4 8}; do
        r qlora-a$a $L LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_ACCUM=$a \
          timeout 90 bash "$B/run.sh" benches
      done
      r qlora-plan $L LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_PLAN=1 \
        timeout 90 bash "$B/run.sh" benches
      if [ "${QLORA_DENSE_PLAN:-1}" = 1 ]; then
        r dense-plan $L LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_PLAN=1 timeout 90 bash "$B/run.sh" benches
      fi
      for k in ${QLORA_KEEP:-}; do
        r qlora-a4-keep$k $L LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_ACCUM=4 \
          LORA_BENCH_ACTIVATIONS=keep:$k timeout 90 bash "$B/run.sh" benches
      done
      r dense $L timeout 80 bash "$B/run.sh" benches
      ;;
    qlora-timeline)
      # The LoRA plan row of qlora-accum with the pool's timeline and the
      # host's spans (scripts/timeline-summary.py reads it).
      T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
      r qlora-tl GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MODES=lora LORA_BENCH_TARGETS=$T7 \
        LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_PLAN=1 \
        LORA_BENCH_TIMELINE="$OUT/res/qlora-tl" timeout 90 bash "$B/run.sh" benches
      ;;
    qlora70)
      T7=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
      # QLORA70_PLAN=1: the LoRA plan's split and kept activations instead
      # of the default policy over the whole step.
      P70=""
      [ "${QLORA70_PLAN:-0}" = 1 ] && P70="LORA_BENCH_PLAN=1"
      r qlora70 GPU_ONLY=bench-lora LORA_BENCH=70b LORA_BENCH_MODES=lora LORA_BENCH_TARGETS=$T7 \
        LORA_BENCH_QUANTIZE=nf4 LORA_BENCH_BATCH=4 LORA_BENCH_STEPS=2 LORA_BENCH_DEVICE_CAP_GIB=24 \
        $P70 timeout 330 bash "$B/run.sh" benches
      bnb
      r qpeer70 PY_ARGS_qlora_torch="--models 70b --batch 4 --steps 2" GPU_ONLY=qlora_torch \
        timeout 240 bash "$B/run.sh" benches
      ;;
    split)
      r tests GPU_TEST_TOPICS="batch_generate pretrained" timeout 150 bash "$B/run.sh" tests
      ;;&
    generate8 | split)
      r gen8 $G GEN_BENCH_BATCHES=${GEN8_BATCHES:-1,64,256} GEN_BENCH_DEVICE_BUDGET_GIB=24 \
        GEN_BENCH_TIMELINE="$OUT/res/gen8" timeout 300 bash "$B/run.sh" benches
      r gen8k $G GEN_BENCH_BATCHES=1 GEN_BENCH_RESIDENT=24 timeout 90 bash "$B/run.sh" benches
      r torch8 PY_ARGS_generate_torch="--batches 16,64,128 --gpu-budget-gib 24.0" GPU_ONLY=generate_torch \
        timeout 240 bash "$B/run.sh" benches
      ;;
    generate24)
      r gen24 $G GEN_BENCH_BATCHES= GEN_BENCH_DEVICE_BUDGET_GIB=24 GEN_BENCH_JOB=${GEN24_JOB:-8} \
        GEN_BENCH_BUDGET_ROWS=${GEN24_ROWS:-3} \
        GEN_BENCH_TIMELINE="$OUT/res/gen24" timeout 330 bash "$B/run.sh" benches
      [ "${GEN24_PEER_BATCHES:-}" = none ] ||
        r torch24 PY_ARGS_generate_torch="--batches ${GEN24_PEER_BATCHES:-64,128} --gpu-budget-gib 24.0" GPU_ONLY=generate_torch \
          timeout 200 bash "$B/run.sh" benches
      ;;
    generate70)
      r gen70 $G GEN_BENCH=70b GEN_BENCH_QUANTIZE=nf4 GEN_BENCH_BATCHES= \
        GEN_BENCH_DEVICE_BUDGET_GIB=24 GEN_BENCH_JOB=${GEN70_JOB:-6} \
        GEN_BENCH_HOST_KV_GIB=${GEN70_HOST_KV_GIB:-0} timeout 560 bash "$B/run.sh" benches
      ;;
    setup)
      r setup GPU_ONLY=bench-setup,setup_torch SETUP_BENCH=8b SETUP_BENCH_ROUNDS=1 SETUP_BENCH_QUANTIZE=nf4 \
        timeout 400 bash "$B/run.sh" benches
      ;;
    train8b-cap24)
      r cap24 GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MICRO=4 LORA_BENCH_MODES=full LORA_BENCH_STEPS=2 \
        LORA_BENCH_OPTIMIZER=host LORA_BENCH_OPTIMIZER_STATE=bf16 LORA_BENCH_ACTIVATIONS=offload \
        LORA_BENCH_DEVICE_CAP_GIB=24 LORA_BENCH_TIMELINE="$OUT/res/cap24" timeout 300 bash "$B/run.sh" benches
      ;;
    train8b | train8b-2k)
      r full2k GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MODES=full LORA_BENCH_STEPS=3 \
        LORA_BENCH_TIMELINE="$OUT/res/full2k" timeout 250 bash "$B/run.sh" benches
      [ "$stage" = train8b-2k ] && continue
      r full8k GPU_ONLY=bench-lora LORA_BENCH=8b LORA_BENCH_MODES=full LORA_BENCH_STEPS=3 \
        LORA_BENCH_BATCH=2 LORA_BENCH_SEQ=8192 LORA_BENCH_TIMELINE="$OUT/res/full8k" \
        timeout 250 bash "$B/run.sh" benches
      ;;
    train14b | train14b-f32 | train14b-bf16)
      if [ "$stage" != train14b-bf16 ]; then
        r plan14 GPU_ONLY=bench-lora LORA_BENCH=14b LORA_BENCH_MODES=full LORA_BENCH_STEPS=2 \
          LORA_BENCH_PLAN=1 timeout 290 bash "$B/run.sh" benches
      fi
      if [ "$stage" != train14b-f32 ]; then
        r plan14b GPU_ONLY=bench-lora LORA_BENCH=14b LORA_BENCH_MODES=full LORA_BENCH_STEPS=2 \
          LORA_BENCH_PLAN=1 LORA_BENCH_OPTIMIZER_STATE=bf16 timeout 290 bash "$B/run.sh" benches
      fi
      ;;
    profile8b)
      LM_BENCH_ACTIVATIONS=recompute PROFILE_TIMEOUT=300 bash scripts/gpu-profile-lm.sh 8b 8 || fail=1
      ;;
    *)
      echo "unknown stage $stage (tests, house, quantized, qlora, qlora-accum, qlora70, split, generate24, generate8, generate70, setup, train8b[-2k|-cap24], train14b[-f32|-bf16], profile8b)" >&2
      exit 2
      ;;
  esac
done
[ -d "$OUT/res" ] && tar -C "$OUT" -rf "$OUT/all.tar" res && rm -rf "$OUT/res"
exit $fail
