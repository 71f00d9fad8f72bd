// AdamW on the device: one pass reads a parameter, its gradient and both
// moments and writes the parameter and the moments in place.
//
// The f32 operations and their order are CpuAdamW's (which are candle-nn's
// AdamW::step), each written with an explicitly rounded intrinsic: the crate
// builds with --use_fast_math, which would otherwise approximate the square
// root and the division and contract products into FMAs. So a step here gives
// the host optimizer's bits (subnormals aside: fast math flushes them).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "convert.cuh"

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)


// Sets *flag when any element of g is NaN or infinite (by its bits: fast math
// may not keep isfinite honest).
template <typename G>
__device__ void nonfinite(const G* __restrict__ g, size_t n, unsigned* flag) {
  unsigned bad = 0;
  GRID_STRIDE(i, n) {
    bad |= (__float_as_uint(to_f(g[i])) & 0x7f800000u) == 0x7f800000u;
  }
  if (bad) atomicOr(flag, 1u);
}

#define NONFINITE(GN, G)                                                               \
  extern "C" __global__ void nonfinite_##GN(const G* g, size_t n, unsigned* flag) { \
    nonfinite<G>(g, n, flag);                                                          \
  }

NONFINITE(f32, float)
NONFINITE(bf16, __nv_bfloat16)
NONFINITE(f16, __half)

// Moments in f32, or in bf16 rounded stochastically exactly as CpuAdamW's
// bf16 state (crates/streamer-autograd/src/state.rs): 16 random bits from
// murmur3's finaliser over the element's index, mixed with a seed of the step
// and the parameter, are added below bf16's last mantissa bit before
// truncating; infinities keep their bits and NaN becomes the canonical NaN.
__device__ __forceinline__ unsigned noise_bits(unsigned seed, size_t i) {
  unsigned h = (unsigned)i * 0x9E3779B1u ^ seed;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

template <typename S> __device__ __forceinline__ S store_state(float x, unsigned noise);
template <> __device__ __forceinline__ float store_state<float>(float x, unsigned) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 store_state<__nv_bfloat16>(float x, unsigned noise) {
  const unsigned bits = __float_as_uint(x);
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  const bool nan = !finite && (bits & 0x007fffffu) != 0u;
  const unsigned add = finite ? (noise & 0xFFFFu) : 0u;
  const unsigned short r = (unsigned short)((bits + add) >> 16);
  return __ushort_as_bfloat16(nan ? (unsigned short)0x7FC0 : r);
}

// A parameter whose gradient set *skip (nonfinite above) is left as it is,
// moments included, without a round trip to the host.
template <typename P, typename G, typename S>
__device__ void adamw(P* __restrict__ p, const G* __restrict__ g, S* __restrict__ m,
                      S* __restrict__ v, size_t n, const unsigned* skip, float beta1,
                      float one_minus_beta1, float beta2, float one_minus_beta2, float scale_m,
                      float scale_v, float decay, float eps, float lr, unsigned seed) {
  if (*skip) return;
  GRID_STRIDE(i, n) {
    const float gi = to_f(g[i]);
    const float mi = __fadd_rn(__fmul_rn(to_f(m[i]), beta1), __fmul_rn(gi, one_minus_beta1));
    const float vi = __fadd_rn(__fmul_rn(to_f(v[i]), beta2),
                               __fmul_rn(__fmul_rn(gi, gi), one_minus_beta2));
    // One hash gives m and v 16 random bits each (unused for f32 state).
    const unsigned r = noise_bits(seed, i);
    m[i] = store_state<S>(mi, r);
    v[i] = store_state<S>(vi, r >> 16);
    const float m_hat = __fmul_rn(mi, scale_m);
    const float v_hat = __fmul_rn(vi, scale_v);
    const float theta = __fmul_rn(to_f(p[i]), decay);
    const float adjusted = __fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), eps));
    p[i] = from_f<P>(__fsub_rn(theta, __fmul_rn(adjusted, lr)));
  }
}

#define ADAMW(PN, P, GN, G, SN, S)                                                       \
  extern "C" __global__ void adamw_##PN##_##GN##_##SN(                                   \
      P* p, const G* g, S* m, S* v, size_t n, const unsigned* skip, float beta1,           \
      float one_minus_beta1, float beta2, float one_minus_beta2, float scale_m,            \
      float scale_v, float decay, float eps, float lr, unsigned seed) {                    \
    adamw<P, G, S>(p, g, m, v, n, skip, beta1, one_minus_beta1, beta2, one_minus_beta2,  \
                   scale_m, scale_v, decay, eps, lr, seed);                                \
  }

#define ADAMW_STATES(PN, P, GN, G)           \
  ADAMW(PN, P, GN, G, f32, float)            \
  ADAMW(PN, P, GN, G, bf16, __nv_bfloat16)

ADAMW_STATES(f32, float, f32, float)
ADAMW_STATES(f32, float, bf16, __nv_bfloat16)
ADAMW_STATES(f32, float, f16, __half)
ADAMW_STATES(bf16, __nv_bfloat16, f32, float)
ADAMW_STATES(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
ADAMW_STATES(f16, __half, f32, float)
ADAMW_STATES(f16, __half, f16, __half)
