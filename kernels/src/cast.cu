// Element-wise dtype conversions and comparisons between raw device buffers.
// Grid-stride loops so any launch size covers any length (no architecture
// constants here); one element per thread per iteration keeps it simple, and
// the loop is memory-bound, so 2-byte vs 4-byte access width dominates cost.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

extern "C" __global__ void cast_f32_bf16(const float* __restrict__ src,
                                         __nv_bfloat16* __restrict__ dst, size_t n) {
  GRID_STRIDE(i, n) { dst[i] = __float2bfloat16_rn(src[i]); }
}

extern "C" __global__ void cast_f32_f16(const float* __restrict__ src,
                                        __half* __restrict__ dst, size_t n) {
  GRID_STRIDE(i, n) { dst[i] = __float2half_rn(src[i]); }
}

extern "C" __global__ void cast_bf16_f32(const __nv_bfloat16* __restrict__ src,
                                         float* __restrict__ dst, size_t n) {
  GRID_STRIDE(i, n) { dst[i] = __bfloat162float(src[i]); }
}

extern "C" __global__ void cast_f16_f32(const __half* __restrict__ src,
                                        float* __restrict__ dst, size_t n) {
  GRID_STRIDE(i, n) { dst[i] = __half2float(src[i]); }
}

// Sets *flag to 1 when the n bytes at a and b differ anywhere (the pool's check
// that a block kept on the device still equals its host masters). a and b are
// 16-byte aligned (slot, staging and scratch offsets are 256-byte aligned).
extern "C" __global__ void bytes_differ(const uint8_t* __restrict__ a,
                                        const uint8_t* __restrict__ b, size_t n,
                                        unsigned* __restrict__ flag) {
  const size_t words = n / 16;
  const uint4* a4 = reinterpret_cast<const uint4*>(a);
  const uint4* b4 = reinterpret_cast<const uint4*>(b);
  bool diff = false;
  GRID_STRIDE(i, words) {
    const uint4 x = a4[i], y = b4[i];
    diff |= (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
  }
  GRID_STRIDE(i, n - words * 16) { diff |= a[words * 16 + i] != b[words * 16 + i]; }
  if (diff) atomicOr(flag, 1u);
}
