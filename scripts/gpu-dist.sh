#!/usr/bin/env bash
# Runs the multi-GPU tests (tests/dist.rs: the `dist` topic of the integration
# binary) from a bundle built by scripts/gpu-test.sh, on the GPU machine:
#
#   bash scripts/gpu-dist.sh          # device tool: carry ["gpu-bundle"]
#
# NCCL is only inside the PyTorch wheels there: the library folder is found
# through python (nvidia.nccl) and put on LD_LIBRARY_PATH (run.sh does the
# same for every run; this script checks it first and says where it is).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes ask.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
nccl_lib=$(bash scripts/nccl-lib.sh || true)
if [ -z "$nccl_lib" ]; then
  echo "gpu-dist.sh: no libnccl.so.2 found (pip show nvidia-nccl-cu12 / nvidia-nccl-cu13)" >&2
  exit 1
fi
echo "gpu-dist.sh: NCCL from $nccl_lib"
export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi -L || true
GPU_TEST_TOPICS=dist GPU_ONLY=integration RUN_TAG=${RUN_TAG:-dist} bash gpu-bundle/run.sh tests
