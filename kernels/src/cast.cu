// Element-wise dtype conversions and comparisons between raw device buffers.
// Grid-stride loops so any launch size covers any length (no architecture
// constants here). The loops are memory-bound: the narrowing casts, which
// convert every streamed f32 master block, move 8 elements per thread and
// iteration (two 16-byte loads, one 16-byte store) when both buffers are
// 16-byte aligned, as the pool's slots and staging are; the rest go one at a
// time.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

// Four packed pairs of a narrow type as one 16-byte word.
template <typename P>
__device__ __forceinline__ uint4 pack4(P p0, P p1, P p2, P p3) {
  uint4 o;
  o.x = *reinterpret_cast<unsigned*>(&p0);
  o.y = *reinterpret_cast<unsigned*>(&p1);
  o.z = *reinterpret_cast<unsigned*>(&p2);
  o.w = *reinterpret_cast<unsigned*>(&p3);
  return o;
}

__device__ __forceinline__ uint4 narrow8(float4 a, float4 b, __nv_bfloat16*) {
  return pack4(__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
               __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w));
}

__device__ __forceinline__ uint4 narrow8(float4 a, float4 b, __half*) {
  return pack4(__floats2half2_rn(a.x, a.y), __floats2half2_rn(a.z, a.w),
               __floats2half2_rn(b.x, b.y), __floats2half2_rn(b.z, b.w));
}

__device__ __forceinline__ void narrow1(float x, __nv_bfloat16* d) { *d = __float2bfloat16_rn(x); }
__device__ __forceinline__ void narrow1(float x, __half* d) { *d = __float2half_rn(x); }

// f32 -> bf16/f16, round to nearest even, element i of src to element i of dst.
template <typename T>
__device__ void narrow(const float* __restrict__ src, T* __restrict__ dst, size_t n) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  const size_t n8 = aligned ? n / 8 : 0;
  const float4* s4 = reinterpret_cast<const float4*>(src);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
  GRID_STRIDE(i, n8) { d4[i] = narrow8(s4[2 * i], s4[2 * i + 1], dst); }
  GRID_STRIDE(i, n - n8 * 8) { narrow1(src[n8 * 8 + i], dst + n8 * 8 + i); }
}

extern "C" __global__ void cast_f32_bf16(const float* __restrict__ src,
                                         __nv_bfloat16* __restrict__ dst, size_t n) {
  narrow(src, dst, n);
}

extern "C" __global__ void cast_f32_f16(const float* __restrict__ src,
                                        __half* __restrict__ dst, size_t n) {
  narrow(src, dst, n);
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
