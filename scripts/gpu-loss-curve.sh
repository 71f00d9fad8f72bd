#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with the bundle of
# scripts/gpu-test.sh: our bf16 loss curve beside transformers' from the same
# initial weights on the same batches of data/corpus.txt, with the same
# learning-rate schedule and AdamW.
#
#   # device tool: carry ["gpu-bundle"], command: bash scripts/gpu-loss-curve.sh
#
# 1. init_model writes the preset's initial weights (f32) as a Hugging Face
#    folder (the weights train_lm --preset P --seed 0 starts from);
# 2. train_lm trains them (bf16 compute, f32 host masters, AdamW f32 state);
#    and again with bf16 AdamW moments on the host (--optimizer-state bf16);
# 3. benches/loss_curve_transformers.py trains the folder with transformers,
#    bf16 autocast and f32, and compares the curves.
# Writes $OUT/loss-curve-h200.{json,svg} and $OUT/loss-curve.log.
# CURVE_PRESET (350m), CURVE_STEPS (200), CURVE_BATCH (8), CURVE_SEQ (1024),
# CURVE_LR (3e-4), CURVE_WARMUP (20) change the run.
set -euo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
preset=${CURVE_PRESET:-350m}
steps=${CURVE_STEPS:-200}
batch=${CURVE_BATCH:-8}
seq=${CURVE_SEQ:-1024}
lr=${CURVE_LR:-3e-4}
warmup=${CURVE_WARMUP:-20}
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
work=$(mktemp -d)
xz -dc gpu-bundle/bin.tar.xz | tar -C "$work" -xf - bin/example-init_model bin/example-train_lm
log=$out/loss-curve.log
exec > >(tee -a "$log") 2>&1
echo "== init: preset $preset"
"$work/bin/example-init_model" --shape "$preset" --dtype f32 --shard-size 0 --seed 0 --out "$work/init"
common=(--steps "$steps" --batch "$batch" --seq "$seq" --lr "$lr" --warmup "$warmup")
echo "== ours: train_lm ${common[*]}"
start=$(date +%s)
"$work/bin/example-train_lm" --preset "$preset" --seed 0 --corpus data/corpus.txt "${common[@]}" \
  --schedule cosine --optimizer device --sample-tokens 0 --save-every "$steps" --log-every 20 \
  --out "$work/ours"
ours_s=$(( $(date +%s) - start ))
echo "== ours with bf16 AdamW moments: train_lm --optimizer host --optimizer-state bf16"
"$work/bin/example-train_lm" --preset "$preset" --seed 0 --corpus data/corpus.txt "${common[@]}" \
  --schedule cosine --optimizer host --optimizer-state bf16 --sample-tokens 0 --save-every "$steps" \
  --log-every 20 --out "$work/ours-bf16-state"
for p in bf16 f32; do
  echo "== transformers $p"
  PYTHONUNBUFFERED=1 python3 benches/loss_curve_transformers.py train --model "$work/init" \
    --corpus data/corpus.txt "${common[@]}" --precision "$p" --out "$work/$p.json"
done
meta=$(printf '{"preset":"%s","steps":%s,"batch":%s,"seq":%s,"lr":%s,"warmup":%s,"schedule":"cosine","optimizer":"train_lm --optimizer device (DeviceAdamW, f32 moments), f32 host masters, bf16 compute","ours_wall_s":%s,"gpu":"%s"}' \
  "$preset" "$steps" "$batch" "$seq" "$lr" "$warmup" "$ours_s" "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)")
python3 benches/loss_curve_transformers.py compare --ours "$work/ours/loss.csv" \
  --ours-bf16-state "$work/ours-bf16-state/loss.csv" \
  --bf16 "$work/bf16.json" --f32 "$work/f32.json" --out "$out/loss-curve-h200" --meta "$meta"
