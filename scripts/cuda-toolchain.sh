#!/usr/bin/env bash
# Installs a CUDA 13.0 toolkit from PyPI wheels into a project-local, git-ignored
# folder (.cuda/ by default) so that `--features cuda` builds on machines with no
# CUDA install and no GPU. Idempotent: a second run only prints the environment.
#
#   eval "$(scripts/cuda-toolchain.sh)"      # installs if needed, then exports
#
# A user with a real CUDA toolkit never needs this: set CUDA_PATH / PATH instead.
# Versions are pinned together: nvvm must match nvcc (13.0), otherwise the PTX it
# emits is newer than the 13.0 ptxas and the GPU machine's driver accept.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${CUDA_TOOLCHAIN_DIR:-$root/.cuda}
cu=$dir/nvidia/cu13
stub=$dir/stub

log() { echo "cuda-toolchain: $*" >&2; }

if [ ! -x "$cu/bin/nvcc" ]; then
  # Never upgrade into an existing target (pip replaces nvidia/ wholesale and
  # nvcc disappears): install into a fresh folder and move it into place.
  tmp=$dir.partial
  rm -rf "$tmp"
  log "installing CUDA 13.0 wheels into $dir (about 1.2 GB)"
  python3 -m pip install --quiet --disable-pip-version-check --target "$tmp" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 \
    nvidia-cuda-nvrtc==13.0.88 'nvidia-cuda-cccl==13.0.*' 'nvidia-cuda-crt==13.0.*' >&2
  rm -rf "$dir"
  mv "$tmp" "$dir"
fi

# The wheels ship versioned libraries only; the linker wants the plain names.
for lib in cublas cublasLt cudart curand nvrtc; do
  if [ ! -e "$cu/lib/lib$lib.so" ]; then
    real=$(ls "$cu/lib/lib$lib.so."* 2>/dev/null | sort | head -n 1 || true)
    [ -n "$real" ] && ln -sf "$(basename "$real")" "$cu/lib/lib$lib.so"
  fi
done

# A link-time stand-in for the driver library (libcuda.so.1). At run time the
# GPU machine's real driver library is loaded instead.
if [ ! -e "$stub/libcuda.so" ]; then
  log "generating the link-time libcuda.so stand-in"
  mkdir -p "$stub"
  gcc -E -P -I"$cu/include" "$cu/include/cuda.h" \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' | sed -E 's/\s*\($//' | sort -u \
    | awk '{ printf "void %s(void) {}\n", $1 }' >"$stub/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/libcuda_stub.c"
  ln -sf libcuda.so "$stub/libcuda.so.1"
fi

# A link-time stand-in for NCCL (libnccl.so.2; streamer-dist's cuda feature),
# exporting every function of cudarc's NCCL bindings. At run time the real
# library is loaded (on the GPU machine: from the PyTorch wheels, see
# scripts/gpu-dist.sh). Built from cudarc's sources (fetched if needed).
if [ ! -e "$stub/libnccl.so" ]; then
  # `|| true`: on a fresh machine nothing matches yet, which must not end the script (pipefail).
  find_nccl_sys() { ls "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/nccl/sys/mod.rs 2>/dev/null | sort | tail -n 1 || true; }
  sys=$(find_nccl_sys)
  if [ -z "$sys" ]; then
    (cd "$root" && cargo fetch --quiet >&2) || true
    sys=$(find_nccl_sys)
  fi
  if [ -n "$sys" ]; then
    log "generating the link-time libnccl.so stand-in from $sys"
    mkdir -p "$stub"
    grep -oE 'fn nccl[A-Za-z0-9_]*\(' "$sys" | sed -E 's/^fn //; s/\($//' | sort -u \
      | awk '{ printf "void %s(void) {}\n", $1 }' >"$stub/libnccl_stub.c"
    gcc -shared -fPIC -Wl,-soname,libnccl.so.2 -o "$stub/libnccl.so" "$stub/libnccl_stub.c"
  else
    log "cudarc's sources not found: no libnccl.so stand-in (linking --features cuda will fail)"
  fi
fi

# Idempotent: evaluating it twice (a shell that already has it, then
# scripts/gpu-test.sh) must give the same RUSTFLAGS, or cargo rebuilds every
# crate, candle's CUDA kernels included (15+ minutes on 2 cores).
cat <<ENV
case ":\$PATH:" in *":$cu/bin:"*) ;; *) export PATH="$cu/bin:\$PATH" ;; esac
export CUDA_PATH="$cu"
export CUDA_ROOT="$cu"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
case ":\${LIBRARY_PATH:-}:" in *":$cu/lib:"*) ;; *) export LIBRARY_PATH="$cu/lib:$stub\${LIBRARY_PATH:+:\$LIBRARY_PATH}" ;; esac
case " \${RUSTFLAGS:-} " in *" -L $cu/lib "*) ;; *) export RUSTFLAGS="-L $cu/lib -L $stub\${RUSTFLAGS:+ \$RUSTFLAGS}" ;; esac
ENV
