// Fused element-wise pieces of the decoder layer's backward, each one pass
// over its operands with f32 arithmetic (the Candle-op versions are chains of
// f32 conversions and binary kernels, one pass each):
// - swiglu_bwd: for act = silu(gate) * up, writes d_gate then d_up (one buffer
//   of 2n elements);
// - rms_dx: RMSNorm's input gradient, one block per row (two block sums);
// - rms_rinv: each row's 1 / rms (one block per row);
// - rms_dw: per block of rows, the partial sums over those rows of g x r
//   (the weight gradient is their column sum), from rms_rinv's values.
// - swiglu_fwd: act = silu(gate) * up in one pass (forward);
// - gelu_bwd: the tanh GELU's derivative times the incoming gradient;
// - add_rms: s = x + r and RMSNorm(s) w in one pass over the row (the residual
//   add fused with the norm after it; forward);
// - rms_dx with a residual: the norm's input gradient plus the residual
//   branch's gradient, one rounding (backward).
// Grid-stride and block-stride loops, so any launch size covers any length.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include "convert.cuh"

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ da, const T* __restrict__ g,
                           const T* __restrict__ u, T* __restrict__ out, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    float z = to_f(g[i]), a = to_f(da[i]), up = to_f(u[i]);
    float s = 1.f / (1.f + __expf(-z));
    out[i] = from_f<T>(a * up * s * (1.f + z * (1.f - s)));
    out[n + i] = from_f<T>(a * z * s);
  }
}

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out,
                           size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const float z = to_f(g[i]);
    out[i] = from_f<T>(z / (1.f + __expf(-z)) * to_f(u[i]));
  }
}

// dz = dh * gelu'(z) for the tanh GELU (cuBLASLt's): after a plain GEMM this
// is cheaper than the GEMM's DGELU epilogue (measured on the H200).
template <typename T>
__device__ void gelu_bwd(const T* __restrict__ dh, const T* __restrict__ z, T* __restrict__ out,
                         size_t n) {
  const float c = 0.7978845608028654f, a = 0.044715f;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const float x = to_f(z[i]), x2 = x * x;
    const float t = tanhf(c * x * (1.f + a * x2));
    const float d = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * c * (1.f + 3.f * a * x2);
    out[i] = from_f<T>(to_f(dh[i]) * d);
  }
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers of sh[0] are done
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  return sh[0];
}

// One block per row: s = x + r (rounded to T, as a separate add would), then
// h = s rinv(s) w with the statistics of the rounded s. Each thread reads back
// only the elements of s it wrote itself, so no barrier is needed between.
template <typename T>
__device__ void add_rms(const T* __restrict__ x, const T* __restrict__ r,
                        const T* __restrict__ w, T* __restrict__ s, T* __restrict__ y, int h,
                        float eps) {
  __shared__ float sh[32];
  const size_t off = (size_t)blockIdx.x * h;
  float s2 = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    const T v = from_f<T>(to_f(x[off + j]) + to_f(r[off + j]));
    s[off + j] = v;
    const float f = to_f(v);
    s2 += f * f;
  }
  s2 = block_sum(s2, sh);
  const float inv = rsqrtf(s2 / h + eps);
  for (int j = threadIdx.x; j < h; j += blockDim.x)
    y[off + j] = from_f<T>(to_f(s[off + j]) * inv * to_f(w[j]));
}

// dx = res + r (g w - x r m), r = 1 / sqrt(mean(x^2) + eps), m = r sum(g w x) / h;
// res (the residual branch's gradient) may be null.
template <typename T>
__device__ void rms_dx(const T* __restrict__ x, const T* __restrict__ w,
                       const T* __restrict__ g, const T* __restrict__ res, T* __restrict__ dx,
                       int h, float eps) {
  __shared__ float sh[32];
  const size_t off = (size_t)blockIdx.x * h;
  float s2 = 0.f, sgwx = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    float xv = to_f(x[off + j]);
    s2 += xv * xv;
    sgwx += to_f(g[off + j]) * to_f(w[j]) * xv;
  }
  s2 = block_sum(s2, sh);
  sgwx = block_sum(sgwx, sh);
  const float r = rsqrtf(s2 / h + eps);
  const float m = sgwx * r / h;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    float xv = to_f(x[off + j]);
    const float add = res ? to_f(res[off + j]) : 0.f;
    dx[off + j] = from_f<T>(add + r * (to_f(g[off + j]) * to_f(w[j]) - xv * r * m));
  }
}

// rinv[row] = 1 / sqrt(mean(x[row]^2) + eps), one block per row.
template <typename T>
__device__ void rms_rinv(const T* __restrict__ x, float* __restrict__ rinv, int h, float eps) {
  __shared__ float sh[32];
  const size_t off = (size_t)blockIdx.x * h;
  float s2 = 0.f;
  for (int j = threadIdx.x; j < h; j += blockDim.x) {
    float xv = to_f(x[off + j]);
    s2 += xv * xv;
  }
  s2 = block_sum(s2, sh);
  if (threadIdx.x == 0) rinv[blockIdx.x] = rsqrtf(s2 / h + eps);
}

// part[block][j] = sum over this block's rows of g x rinv (h <= 32 * blockDim.x):
// one streaming pass over x and g, the rows' rinv precomputed (no per-row
// block reduction, which made this kernel ten times slower than its bytes).
template <typename T>
__device__ void rms_dw(const T* __restrict__ x, const T* __restrict__ g, float* __restrict__ part,
                       size_t rows, int h, const float* __restrict__ rinv,
                       size_t rows_per_block) {
  float acc[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) acc[k] = 0.f;
  const int cols = (h + blockDim.x - 1) / blockDim.x;
  const size_t r0 = (size_t)blockIdx.x * rows_per_block;
  const size_t r1 = min(rows, r0 + rows_per_block);
  for (size_t row = r0; row < r1; ++row) {
    const size_t off = row * h;
    const float r = rinv[row];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int j = threadIdx.x + k * blockDim.x;
      if (k < cols && j < h) acc[k] += to_f(g[off + j]) * to_f(x[off + j]) * r;
    }
  }
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    if (k < cols && j < h) part[(size_t)blockIdx.x * h + j] = acc[k];
  }
}

#define DECODER_KERNELS(T, S)                                                                  \
  extern "C" __global__ void swiglu_bwd_##S(const T* da, const T* g, const T* u, T* out,      \
                                            size_t n) {                                        \
    swiglu_bwd<T>(da, g, u, out, n);                                                           \
  }                                                                                            \
  extern "C" __global__ void rms_dx_##S(const T* x, const T* w, const T* g, const T* res,     \
                                        T* dx, int h, float eps) {                             \
    rms_dx<T>(x, w, g, res, dx, h, eps);                                                       \
  }                                                                                            \
  extern "C" __global__ void swiglu_fwd_##S(const T* g, const T* u, T* out, size_t n) {       \
    swiglu_fwd<T>(g, u, out, n);                                                               \
  }                                                                                            \
  extern "C" __global__ void gelu_bwd_##S(const T* dh, const T* z, T* out, size_t n) {         \
    gelu_bwd<T>(dh, z, out, n);                                                                \
  }                                                                                            \
  extern "C" __global__ void add_rms_##S(const T* x, const T* r, const T* w, T* s, T* y,      \
                                         int h, float eps) {                                   \
    add_rms<T>(x, r, w, s, y, h, eps);                                                         \
  }                                                                                            \
  extern "C" __global__ void rms_rinv_##S(const T* x, float* rinv, int h, float eps) {        \
    rms_rinv<T>(x, rinv, h, eps);                                                              \
  }                                                                                            \
  extern "C" __global__ void rms_dw_##S(const T* x, const T* g, float* part, size_t rows,      \
                                        int h, const float* rinv, size_t rows_per_block) {     \
    rms_dw<T>(x, g, part, rows, h, rinv, rows_per_block);                                      \
  }

DECODER_KERNELS(__nv_bfloat16, bf16)
DECODER_KERNELS(__half, f16)
DECODER_KERNELS(float, f32)

// Cross-entropy over one row of logits per block, f32 arithmetic on any input
// dtype (so the f32 logits are never materialised).
// - ce_fwd: loss[r] = logsumexp(x[r, :]) - x[r, t[r]] (NaN when t[r] >= v);
// - ce_bwd: dx[r, j] = g[r] * (softmax(x[r, :])[j] - [j == t[r]]), where the
//   log-sum-exp is loss[r] + x[r, t[r]] (aux holds loss then g, 2 rows of n).
#define CE_NEG_INF __int_as_float(0xff800000)
#define CE_NAN __int_as_float(0x7fffffff)
__device__ float block_max(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < (int)(blockDim.x >> 5) ? sh[lane] : CE_NEG_INF;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    if (lane == 0) sh[0] = t;
  }
  __syncthreads();
  return sh[0];
}

template <typename T>
__device__ void ce_fwd(const T* __restrict__ x, const uint32_t* __restrict__ t,
                       float* __restrict__ loss, int v) {
  __shared__ float sh[32];
  const T* row = x + (size_t)blockIdx.x * v;
  float m = CE_NEG_INF;
  for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, to_f(row[j]));
  m = block_max(m, sh);
  float s = 0.f;
  for (int j = threadIdx.x; j < v; j += blockDim.x) s += __expf(to_f(row[j]) - m);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const uint32_t k = t[blockIdx.x];
    loss[blockIdx.x] = k < (uint32_t)v ? logf(s) + m - to_f(row[k]) : CE_NAN;
  }
}

template <typename T>
__device__ void ce_bwd(const T* __restrict__ x, const uint32_t* __restrict__ t,
                       const float* __restrict__ aux, T* __restrict__ dx, int v, int n) {
  const size_t off = (size_t)blockIdx.x * v;
  const uint32_t k = t[blockIdx.x];
  const float g = aux[n + blockIdx.x];
  const float lse = k < (uint32_t)v ? aux[blockIdx.x] + to_f(x[off + k]) : CE_NAN;
  for (int j = threadIdx.x; j < v; j += blockDim.x) {
    const float p = __expf(to_f(x[off + j]) - lse);
    dx[off + j] = from_f<T>(g * (p - (j == (int)k ? 1.f : 0.f)));
  }
}

#define CE(T, S)                                                                          \
  extern "C" __global__ void ce_fwd_##S(const T* x, const uint32_t* t, float* loss,      \
                                        int v) {                                         \
    ce_fwd<T>(x, t, loss, v);                                                            \
  }                                                                                      \
  extern "C" __global__ void ce_bwd_##S(const T* x, const uint32_t* t, const float* aux, \
                                        T* dx, int v, int n) {                           \
    ce_bwd<T>(x, t, aux, dx, v, n);                                                      \
  }
CE(__nv_bfloat16, bf16)
CE(__half, f16)
CE(float, f32)

// Embedding backward: acc[ids[t], :] += g[t, :] in f32 with atomics, one
// block per token (rows of a small vocabulary collide, and f32 atomics in L2
// take that far better than a loop over tokens per column). ids >= v skip.
template <typename T>
__device__ void embed_bwd(const uint32_t* __restrict__ ids, const T* __restrict__ g,
                          float* __restrict__ acc, int h, int v) {
  const uint32_t id = ids[blockIdx.x];
  if (id >= (uint32_t)v) return;
  const T* row = g + (size_t)blockIdx.x * h;
  float* dst = acc + (size_t)id * h;
  for (int j = threadIdx.x; j < h; j += blockDim.x) atomicAdd(dst + j, to_f(row[j]));
}

#define EMBED(T, S)                                                                       \
  extern "C" __global__ void embed_bwd_##S(const uint32_t* ids, const T* g, float* acc,  \
                                           int h, int v) {                               \
    embed_bwd<T>(ids, g, acc, h, v);                                                     \
  }
EMBED(__nv_bfloat16, bf16)
EMBED(__half, f16)
EMBED(float, f32)

// RoPE fused with the layout change around attention, so neither direction
// needs its own transpose copy: rope_to_heads reads a projection in rows
// (b * n, heads * d) and writes it rotated in cqsa's head-major (b, heads,
// n, d); rope_to_rows reads a head-major gradient and writes it rotated back
// (sign -1: the inverse rotation) in rows. The rotation is candle's `rope`
// (halves, not interleaved): (x1, x2) -> (x1 c - x2 s, x1 s + x2 c), with
// cos/sin of shape (n, d / 2); the arithmetic is f32.
template <typename T, bool TO_HEADS>
__device__ void rope_move(const T* __restrict__ src, const T* __restrict__ cos,
                          const T* __restrict__ sin, T* __restrict__ dst, int b, int n,
                          int heads, int d, float sign) {
  const int half = d / 2;
  const size_t total = (size_t)b * heads * n * half;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (size_t)blockDim.x * gridDim.x) {
    const int i = (int)(idx % half);
    size_t r = idx / half;
    const int t = (int)(r % n);
    r /= n;
    const int h = (int)(r % heads);
    const int bb = (int)(r / heads);
    const size_t rows = ((size_t)bb * n + t) * ((size_t)heads * d) + (size_t)h * d;
    const size_t head_major = (((size_t)bb * heads + h) * n + t) * d;
    const size_t in = TO_HEADS ? rows : head_major;
    const size_t out = TO_HEADS ? head_major : rows;
    const float x1 = to_f(src[in + i]), x2 = to_f(src[in + i + half]);
    const float c = to_f(cos[(size_t)t * half + i]);
    const float s = sign * to_f(sin[(size_t)t * half + i]);
    dst[out + i] = from_f<T>(x1 * c - x2 * s);
    dst[out + i + half] = from_f<T>(x1 * s + x2 * c);
  }
}

#define ROPE_MOVE(T, S)                                                                     \
  extern "C" __global__ void rope_to_heads_##S(const T* x, const T* cos, const T* sin,     \
                                               T* out, int b, int n, int h, int d,         \
                                               float sign) {                               \
    rope_move<T, true>(x, cos, sin, out, b, n, h, d, sign);                               \
  }                                                                                         \
  extern "C" __global__ void rope_to_rows_##S(const T* g, const T* cos, const T* sin,      \
                                              T* out, int b, int n, int h, int d,          \
                                              float sign) {                                \
    rope_move<T, false>(g, cos, sin, out, b, n, h, d, sign);                              \
  }
ROPE_MOVE(__nv_bfloat16, bf16)
ROPE_MOVE(__half, f16)
ROPE_MOVE(float, f32)
