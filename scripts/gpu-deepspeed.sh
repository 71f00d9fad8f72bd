#!/usr/bin/env bash
# On the GPU machine: installs the DeepSpeed wheels carried in .whl/ (made here by
# scripts/deepspeed-wheels.sh; no package index there) into a folder on
# PYTHONPATH beside the image's torch/transformers, then runs
# benches/deepspeed_zero3.py (ZeRO-3, parameters and optimizer offloaded to the
# CPU, DeepSpeedCPUAdam) with the arguments given.
#
#   bash scripts/gpu-deepspeed.sh --model 3b --batch 8 --seq 2048 --micro 1
#   (device call: carry [".whl"])
#
# The row is appended to $OUT/deepspeed-zero3-h200.json (benches/results/ when
# OUT is unset) unless the arguments name --out; the output is also appended to
# the .log beside it. Several runs in one call (say 3b, then 8b, which the host
# estimate refuses) go to the same two files. The first run JIT-builds
# DeepSpeedCPUAdam (ninja, g++: about a minute) under $TORCH_EXTENSIONS_DIR
# (/tmp/torch_extensions); later runs in the same call reuse it.
# Exit status: the bench's (3: refused by the host estimate, 4: stopped by the
# low-memory watchdog).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SITE=${DS_SITE:-/tmp/ds-site}
WHEELS="deepspeed hjson pydantic pydantic_core annotated_types typing_inspection typing_extensions"

files=()
for n in $WHEELS; do
  f=$(ls .whl/"$n"-*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "gpu-deepspeed: no .whl/$n-*.whl: run scripts/deepspeed-wheels.sh on the dev machine and carry .whl" >&2; exit 2; }
  files+=("$f")
done
if ! PYTHONPATH="$SITE" "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  t0=$(date +%s)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${files[@]}" || { echo "gpu-deepspeed: pip install failed" >&2; exit 2; }
  echo "gpu-deepspeed: installed ${files[*]##*/} into $SITE in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# ninja for the JIT build of cpu_adam lives beside the image's python3.
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
export PATH
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$PY" -c 'import deepspeed, pydantic, torch, transformers, sys; print("gpu-deepspeed: python", sys.version.split()[0], "deepspeed", deepspeed.__version__, "pydantic", pydantic.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' \
  || { echo "gpu-deepspeed: import failed" >&2; exit 2; }

dir=${OUT:-benches/results}
mkdir -p "$dir"
args=("$@")
case " $* " in
  *" --out "*|*" --out="*) ;;
  *) args+=(--out "$dir/deepspeed-zero3-h200.json") ;;
esac
"$PY" benches/deepspeed_zero3.py "${args[@]}" 2>&1 | tee -a "$dir/deepspeed-zero3-h200.log"
exit "${PIPESTATUS[0]}"
