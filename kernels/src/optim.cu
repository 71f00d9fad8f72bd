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

#define GRID_STRIDE(i, n) \
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (size_t)blockDim.x * gridDim.x)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// Sets *flag when any element of g is NaN or infinite (by its bits: fast math
// may not keep isfinite honest).
template <typename G>
__device__ void nonfinite(const G* __restrict__ g, size_t n, unsigned* flag) {
  unsigned bad = 0;
  GRID_STRIDE(i, n) {
    bad |= (__float_as_uint(to_f32(g[i])) & 0x7f800000u) == 0x7f800000u;
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

// A parameter whose gradient set *skip (nonfinite above) is left as it is,
// moments included, without a round trip to the host.
template <typename P, typename G>
__device__ void adamw(P* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                      float* __restrict__ v, size_t n, const unsigned* skip, float beta1,
                      float one_minus_beta1, float beta2, float one_minus_beta2, float scale_m,
                      float scale_v, float decay, float eps, float lr) {
  if (*skip) return;
  GRID_STRIDE(i, n) {
    const float gi = to_f32(g[i]);
    const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(gi, one_minus_beta1));
    const float vi =
        __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(gi, gi), one_minus_beta2));
    m[i] = mi;
    v[i] = vi;
    const float m_hat = __fmul_rn(mi, scale_m);
    const float v_hat = __fmul_rn(vi, scale_v);
    const float theta = __fmul_rn(to_f32(p[i]), decay);
    const float adjusted = __fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), eps));
    p[i] = from_f32<P>(__fsub_rn(theta, __fmul_rn(adjusted, lr)));
  }
}

#define ADAMW(PN, P, GN, G)                                                              \
  extern "C" __global__ void adamw_##PN##_##GN(                                          \
      P* p, const G* g, float* m, float* v, size_t n, const unsigned* skip, float beta1,   \
      float one_minus_beta1, float beta2, float one_minus_beta2, float scale_m,            \
      float scale_v, float decay, float eps, float lr) {                                   \
    adamw<P, G>(p, g, m, v, n, skip, beta1, one_minus_beta1, beta2, one_minus_beta2,     \
                scale_m, scale_v, decay, eps, lr);                                         \
  }

ADAMW(f32, float, f32, float)
ADAMW(f32, float, bf16, __nv_bfloat16)
ADAMW(f32, float, f16, __half)
ADAMW(bf16, __nv_bfloat16, f32, float)
ADAMW(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
ADAMW(f16, __half, f32, float)
ADAMW(f16, __half, f16, __half)
