#!/usr/bin/env bash
# The model-folder figures (LoRA against full fine-tuning, generate --model
# tokens/s) on the GPU machine, from the bundle that scripts/gpu-test.sh builds.
# In stages, each with its own time limit so a device call never runs past its
# 10 minutes:
#
#   bash scripts/gpu-models.sh lora3b     # benches/lora.rs: 3b preset, LoRA and full
#   bash scripts/gpu-models.sh lora8b     # Llama 3.1 8B shapes: LoRA (LORA8B_MODES=lora,full for both)
#   bash scripts/gpu-models.sh generate   # init_model (8B shapes, bf16), transformers' generate, then ours resident and streamed
#                                         # (GEN_RUNS=torch,resident,streamed picks which)
#   bash scripts/gpu-models.sh batch      # batched generation, 8B shapes: benches/generate_torch.py (transformers +
#                                         # accelerate under GEN_BUDGET_GIB, default 24), then benches/generate.rs
#                                         # (GEN_BENCH_BATCHES without a budget, then a row under the budget)
#
# Outputs: run.sh's summaries and logs under $OUT (RUN_TAG per stage).
set -uo pipefail
cd "$(dirname "$0")/.."
limit=${STAGE_LIMIT_S:-240}
# Result files are named after the GPU (benches/common: BENCH_DEVICE_TAG).
if [ -z "${BENCH_DEVICE_TAG:-}" ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)" in
    *H100*) BENCH_DEVICE_TAG=h100 ;;
    *) BENCH_DEVICE_TAG=h200 ;;
  esac
fi
export BENCH_DEVICE_TAG
fail=0
gen() {
  local tag=$1
  shift
  GPU_ONLY=example-generate GPU_ARGS_generate="$*" RUN_TAG=$tag \
    timeout "$limit" bash gpu-bundle/run.sh examples || fail=1
}
for stage in "$@"; do
  case "$stage" in
    lora3b)
      LORA_BENCH=3b GPU_ONLY=lora RUN_TAG=lora3b timeout "$limit" bash gpu-bundle/run.sh benches || fail=1 ;;
    lora8b)
      LORA_BENCH=8b LORA_BENCH_MODES=${LORA8B_MODES:-lora} GPU_ONLY=lora RUN_TAG=lora8b \
        timeout "$limit" bash gpu-bundle/run.sh benches || fail=1 ;;
    generate)
      dir=${MODEL_DIR:-/tmp/llama31-8b-random}
      if [ ! -f "$dir/config.json" ]; then
        GPU_ONLY=init_model RUN_TAG=init GPU_ARGS_init_model="--shape llama31-8b --dtype bf16 \
          --tokenizer tests/fixtures/hf/llama-tokenizer/tokenizer.json --out $dir" \
          timeout "$limit" bash gpu-bundle/run.sh examples || fail=1
      fi
      n=${GEN_TOKENS:-256}
      runs=" ${GEN_RUNS:-torch,resident,streamed} "
      runs=${runs//,/ }
      # transformers' figures first: ours pack benches/results into their logs.
      mkdir -p "${OUT:-gpu-out}"
      if [[ $runs == *" torch "* ]]; then
        timeout "$limit" python3 scripts/generate_torch.py --model "$dir" --max-tokens "$n" \
          >"${OUT:-gpu-out}/generate-torch.log" 2>&1 || fail=1
      fi
      [[ $runs == *" resident "* ]] && gen gen-resident --model "$dir" --max-tokens "$n" --temperature 0
      # Streamed decoding moves every layer per token (16 GB at 8B): fewer
      # tokens, as transformers' offloaded row.
      [[ $runs == *" streamed "* ]] && gen gen-streamed --model "$dir" \
        --max-tokens "${GEN_STREAMED_TOKENS:-16}" --temperature 0 --streamed ;;
    batch)
      mkdir -p "${OUT:-gpu-out}"
      timeout "$limit" python3 benches/generate_torch.py --batches "${GEN_TORCH_BATCHES:-1,16,64,128}" \
        --gpu-budget-gib "${GEN_BUDGET_GIB:-24}" --out "${OUT:-gpu-out}/generate-batch-torch-$BENCH_DEVICE_TAG.json" \
        >"${OUT:-gpu-out}/generate-batch-torch.log" 2>&1 || fail=1
      GEN_BENCH_DEVICE_BUDGET_GIB=${GEN_BUDGET_GIB:-24} GPU_ONLY=bench-generate RUN_TAG=gen \
        timeout "$limit" bash gpu-bundle/run.sh benches || fail=1 ;;
    *) echo "unknown stage $stage (lora3b, lora8b, generate, batch)" >&2; exit 2 ;;
  esac
done
exit $fail
