// Dequantization of the frozen-weight formats of crate `streamer-quant` into
// bf16, on the GPU, in bitsandbytes' order of operations so the result equals
// its kernels bit for bit: one f32 product (no fused multiply-add: __fmul_rn
// and __fadd_rn keep --use_fast_math from contracting), one rounding to bf16.
// Grid-stride loops; memory-bound (a 4-bit weight reads half a byte and
// writes two).
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

// bitsandbytes' NF4 and FP4 code values, by 4-bit index.
__constant__ float NF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
__constant__ float FP4[16] = {
    0.0f, 0.0625f / 12.0f, 8.0f / 12.0f, 1.0f, 4.0f / 12.0f, 6.0f / 12.0f, 2.0f / 12.0f, 3.0f / 12.0f,
    -0.0f, -0.0625f / 12.0f, -8.0f / 12.0f, -1.0f, -4.0f / 12.0f, -6.0f / 12.0f, -2.0f / 12.0f,
    -3.0f / 12.0f};

// Double-quantized absmax: absmax[b] = map[codes[b]] * scales[b / per_scale] + *offset
// (the offset read on the device: a packed buffer holds it beside the scales).
extern "C" __global__ void dequant_absmax(const uint8_t* __restrict__ codes,
                                          const float* __restrict__ map,
                                          const float* __restrict__ scales,
                                          const float* __restrict__ offset,
                                          float* __restrict__ absmax, size_t blocks,
                                          unsigned per_scale) {
  const float off = *offset;
  GRID_STRIDE(b, blocks) {
    absmax[b] = __fadd_rn(__fmul_rn(map[codes[b]], scales[b / per_scale]), off);
  }
}

// Sixteen outputs a thread where the pointers and sizes allow (one 8-byte load,
// two 16-byte stores: the byte-a-thread form left the GPU's store bandwidth
// idle); the code book sits in shared memory, where threads reading different
// entries do not serialise as they do on __constant__ memory.
#define VEC 16

// Stores 16 bf16 values (8 pairs) with two 16-byte stores.
__device__ __forceinline__ void store16(__nv_bfloat16* out, const __nv_bfloat162 (&r)[8]) {
  const uint4* v = reinterpret_cast<const uint4*>(r);
  reinterpret_cast<uint4*>(out)[0] = v[0];
  reinterpret_cast<uint4*>(out)[1] = v[1];
}

// Whether a kernel may take its 16-wide path: whole vectors, aligned pointers,
// and no vector crossing a scale boundary (`unit` elements per scale).
__device__ __forceinline__ bool vector_ok(const void* in, unsigned in_align,
                                          const __nv_bfloat16* out, size_t n, size_t unit) {
  return n % VEC == 0 && unit % VEC == 0 && (uintptr_t)in % in_align == 0 &&
         (uintptr_t)out % 16 == 0;
}

// Two elements a byte (the first in the high nibble): out[i] = code[q] * absmax[i / blocksize].
extern "C" __global__ void dequant_4bit_bf16(const uint8_t* __restrict__ packed,
                                             const float* __restrict__ absmax, int fp4,
                                             __nv_bfloat16* __restrict__ out, size_t n,
                                             unsigned blocksize) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = fp4 ? FP4[threadIdx.x] : NF4[threadIdx.x];
  __syncthreads();
  if (vector_ok(packed, 8, out, n, blocksize)) {
    GRID_STRIDE(v, n / VEC) {
      const uint2 p = reinterpret_cast<const uint2*>(packed)[v];
      const float s = absmax[v * VEC / blocksize];
      __nv_bfloat162 r[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint8_t b = ((k < 4 ? p.x : p.y) >> (8 * (k & 3))) & 0xff;
        r[k] = __floats2bfloat162_rn(__fmul_rn(code[b >> 4], s), __fmul_rn(code[b & 15], s));
      }
      store16(out + v * VEC, r);
    }
    return;
  }
  GRID_STRIDE(j, (n + 1) / 2) {
    const uint8_t b = packed[j];
    const size_t i = 2 * j;
    // blocksize is even: both elements of a byte share a block.
    const float s = absmax[i / blocksize];
    out[i] = __float2bfloat16_rn(__fmul_rn(code[b >> 4], s));
    if (i + 1 < n) out[i + 1] = __float2bfloat16_rn(__fmul_rn(code[b & 15], s));
  }
}

// int8 rows: out = (q * scb[row]) * (1/127), as bitsandbytes' int8_vectorwise_dequant.
__device__ __forceinline__ float int8_value(int8_t q, float scb) {
  return __fmul_rn(__fmul_rn((float)q, scb), 7.874015718698502e-3f);
}

extern "C" __global__ void dequant_int8_bf16(const int8_t* __restrict__ q,
                                             const float* __restrict__ scb,
                                             __nv_bfloat16* __restrict__ out, size_t n,
                                             size_t cols) {
  if (vector_ok(q, 16, out, n, cols)) {
    GRID_STRIDE(v, n / VEC) {
      const uint4 p = reinterpret_cast<const uint4*>(q)[v];
      const int8_t* b = reinterpret_cast<const int8_t*>(&p);
      const float s = scb[v * VEC / cols];
      __nv_bfloat162 r[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        r[k] = __floats2bfloat162_rn(int8_value(b[2 * k], s), int8_value(b[2 * k + 1], s));
      store16(out + v * VEC, r);
    }
    return;
  }
  GRID_STRIDE(i, n) { out[i] = __float2bfloat16_rn(int8_value(q[i], scb[i / cols])); }
}

// fp8 e4m3 with one scale per row (per_row) or per tensor: out = e4m3 * scale.
__device__ __forceinline__ float fp8_value(uint8_t q, float s) {
  __nv_fp8_e4m3 f;
  f.__x = q;
  return __fmul_rn((float)f, s);
}

extern "C" __global__ void dequant_fp8_bf16(const uint8_t* __restrict__ q,
                                            const float* __restrict__ scale, int per_row,
                                            __nv_bfloat16* __restrict__ out, size_t n,
                                            size_t cols) {
  if (vector_ok(q, 16, out, n, cols)) {
    GRID_STRIDE(v, n / VEC) {
      const uint4 p = reinterpret_cast<const uint4*>(q)[v];
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&p);
      const float s = scale[per_row ? v * VEC / cols : 0];
      __nv_bfloat162 r[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        r[k] = __floats2bfloat162_rn(fp8_value(b[2 * k], s), fp8_value(b[2 * k + 1], s));
      store16(out + v * VEC, r);
    }
    return;
  }
  GRID_STRIDE(i, n) { out[i] = __float2bfloat16_rn(fp8_value(q[i], scale[per_row ? i / cols : 0])); }
}
