// Exact chunked attention (cqsa): forward and backward.
//
// Layouts: q, o, do: (b, hq, nq, d); k, v, dk, dv: (b, hkv, nk, d); lse, delta:
// (b, hq, nq) f32, natural log. Query head h reads kv head h / (hq / hkv).
// Causal: key j is visible from query i iff j <= i + off (off = nk - nq for a whole
// call, bottom-right aligned; other values for chunks of the streamed mode).
// A row that sees no key gets output 0 and lse -inf.
//
// Two families:
// - *_simple_*: one warp per query row (forward, dq) or per key row (dk/dv), f32
//   arithmetic, any head dim 1..256, any dtype. Obviously right, not fast.
// - fwd_mma_*: FlashAttention-2 style forward for f16/bf16 and head dims 64/128:
//   a block of 4 warps owns 64 query rows (16 per warp), walks 64-key tiles of K/V
//   staged in shared memory, computes S = Q K^T and O += P V with
//   mma.sync.m16n8k16 (f32 accumulate) and keeps the online softmax in registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Number of keys row i sees.
__device__ __forceinline__ int visible(int i, int nk, int causal, long long off) {
    if (!causal) return nk;
    long long v = (long long)i + off + 1;
    return (int)(v < 0 ? 0 : (v > nk ? nk : v));
}

// First query row that sees key j.
__device__ __forceinline__ int first_row(int j, int nq, int causal, long long off) {
    if (!causal) return 0;
    long long r = (long long)j - off;
    return (int)(r < 0 ? 0 : (r > nq ? nq : r));
}

constexpr int SIMPLE_WARPS = 4;
constexpr int MAXC = 8;  // 256 / 32 head-dim elements per lane

// ---------------------------------------------------------------- simple forward
template <typename T>
__device__ void fwd_simple(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           T* __restrict__ o, float* __restrict__ lse, int hq, int hkv, int nq, int nk,
                           int d, float scale, int causal, long long off) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * SIMPLE_WARPS + (threadIdx.x >> 5);
    const int h = blockIdx.y, b = blockIdx.z;
    if (row >= nq) return;
    const int kh = h / (hq / hkv);
    const size_t qrow = ((size_t)b * hq + h) * nq + row;
    const T* qr = q + qrow * d;
    const T* kb = k + ((size_t)b * hkv + kh) * nk * d;
    const T* vb = v + ((size_t)b * hkv + kh) * nk * d;
    float qv[MAXC], acc[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        qv[c] = x < d ? to_f(qr[x]) * scale : 0.f;
        acc[c] = 0.f;
    }
    const int vis = visible(row, nk, causal, off);
    float m = NEG_INF, l = 0.f;
    for (int j = 0; j < vis; ++j) {
        const T* kr = kb + (size_t)j * d;
        const T* vr = vb + (size_t)j * d;
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int x = lane + 32 * c;
            if (x < d) s += qv[c] * to_f(kr[x]);
        }
        s = warp_sum(s);
        float mn = fmaxf(m, s);
        float corr = __expf(m - mn);
        float p = __expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int x = lane + 32 * c;
            if (x < d) acc[c] = acc[c] * corr + p * to_f(vr[x]);
        }
        m = mn;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* orow = o + qrow * d;
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        if (x < d) orow[x] = from_f<T>(acc[c] * inv);
    }
    if (lane == 0) lse[qrow] = l > 0.f ? m + logf(l) : NEG_INF;
}

// ---------------------------------------------------------------- backward
// delta[row] = sum_x do[row, x] * o[row, x]
template <typename T>
__device__ void bwd_delta(const T* __restrict__ o, const T* __restrict__ g, float* __restrict__ delta,
                          long long rows, int d) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * SIMPLE_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float s = 0.f;
    for (int x = lane; x < d; x += 32) s += to_f(o[row * d + x]) * to_f(g[row * d + x]);
    s = warp_sum(s);
    if (lane == 0) delta[row] = s;
}

// dq: one warp per query row.
template <typename T>
__device__ void bwd_dq_simple(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                              const T* __restrict__ g, const float* __restrict__ lse,
                              const float* __restrict__ delta, T* __restrict__ dq, int hq, int hkv,
                              int nq, int nk, int d, float scale, int causal, long long off) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * SIMPLE_WARPS + (threadIdx.x >> 5);
    const int h = blockIdx.y, b = blockIdx.z;
    if (row >= nq) return;
    const int kh = h / (hq / hkv);
    const size_t qrow = ((size_t)b * hq + h) * nq + row;
    const T* kb = k + ((size_t)b * hkv + kh) * nk * d;
    const T* vb = v + ((size_t)b * hkv + kh) * nk * d;
    float qv[MAXC], gv[MAXC], acc[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        qv[c] = x < d ? to_f(q[qrow * d + x]) : 0.f;
        gv[c] = x < d ? to_f(g[qrow * d + x]) : 0.f;
        acc[c] = 0.f;
    }
    const float li = lse[qrow], di = delta[qrow];
    const int vis = li == NEG_INF ? 0 : visible(row, nk, causal, off);
    for (int j = 0; j < vis; ++j) {
        const T* kr = kb + (size_t)j * d;
        const T* vr = vb + (size_t)j * d;
        float s = 0.f, dp = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int x = lane + 32 * c;
            if (x < d) {
                s += qv[c] * to_f(kr[x]);
                dp += gv[c] * to_f(vr[x]);
            }
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        const float p = __expf(s * scale - li);
        const float ds = p * (dp - di);
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int x = lane + 32 * c;
            if (x < d) acc[c] += ds * to_f(kr[x]);
        }
    }
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        if (x < d) dq[qrow * d + x] = from_f<T>(acc[c] * scale);
    }
}

// dk, dv: one warp per key row, summing over the query heads of its group.
template <typename T>
__device__ void bwd_dkdv_simple(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                const T* __restrict__ g, const float* __restrict__ lse,
                                const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                                int hq, int hkv, int nq, int nk, int d, float scale, int causal,
                                long long off) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * SIMPLE_WARPS + (threadIdx.x >> 5);
    const int kh = blockIdx.y, b = blockIdx.z;
    if (j >= nk) return;
    const int group = hq / hkv;
    const size_t krow = ((size_t)b * hkv + kh) * nk + j;
    float kv[MAXC], vv[MAXC], ak[MAXC], av[MAXC];
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        kv[c] = x < d ? to_f(k[krow * d + x]) : 0.f;
        vv[c] = x < d ? to_f(v[krow * d + x]) : 0.f;
        ak[c] = 0.f;
        av[c] = 0.f;
    }
    const int i0 = first_row(j, nq, causal, off);
    for (int h = kh * group; h < (kh + 1) * group; ++h) {
        const size_t base = ((size_t)b * hq + h) * nq;
        for (int i = i0; i < nq; ++i) {
            const size_t qrow = base + i;
            const float li = lse[qrow];
            if (li == NEG_INF) continue;
            const T* qr = q + qrow * d;
            const T* gr = g + qrow * d;
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                int x = lane + 32 * c;
                if (x < d) {
                    s += to_f(qr[x]) * kv[c];
                    dp += to_f(gr[x]) * vv[c];
                }
            }
            s = warp_sum(s);
            dp = warp_sum(dp);
            const float p = __expf(s * scale - li);
            const float ds = p * (dp - delta[qrow]) * scale;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                int x = lane + 32 * c;
                if (x < d) {
                    av[c] += p * to_f(gr[x]);
                    ak[c] += ds * to_f(qr[x]);
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
        int x = lane + 32 * c;
        if (x < d) {
            dk[krow * d + x] = from_f<T>(ak[c]);
            dv[krow * d + x] = from_f<T>(av[c]);
        }
    }
}

// ---------------------------------------------------------------- tensor-core forward
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

// c += a * b for one m16n8k16 tile, f32 accumulators.
template <typename T> __device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b);
template <> __device__ __forceinline__ void mma16816<__half>(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

constexpr int MMA_BR = 64;    // query rows per block (16 per warp)
constexpr int MMA_BC = 64;    // keys per tile
constexpr int MMA_PAD = 8;    // shared-memory row padding (elements): no bank conflicts
constexpr int MMA_THREADS = 128;

template <typename T>
__device__ __forceinline__ uint32_t load2(const T* p, int row, int n, int col, int d) {
    if (row >= n) return 0u;
    return *reinterpret_cast<const uint32_t*>(p + (size_t)row * d + col);
}

// Requires: d == D, D % 16 == 0, q/k/v/o 16-byte aligned (checked by the launcher).
template <typename T, int D>
__device__ void fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ o, float* __restrict__ lse, int hq, int hkv, int nq, int nk,
                        float scale, int causal, long long off) {
    constexpr int LD = D + MMA_PAD;
    __shared__ __align__(16) T ks[MMA_BC * LD];
    __shared__ __align__(16) T vs[MMA_BC * LD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    const int kh = h / (hq / hkv);
    const int q0 = blockIdx.x * MMA_BR;
    const T* qb = q + ((size_t)b * hq + h) * nq * D;
    const T* kb = k + ((size_t)b * hkv + kh) * (size_t)nk * D;
    const T* vb = v + ((size_t)b * hkv + kh) * (size_t)nk * D;
    const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;

    // Q fragments (A operand), kept in registers for the whole block.
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][0] = load2(qb, row0, nq, kk * 16 + 2 * t, D);
        qf[kk][1] = load2(qb, row1, nq, kk * 16 + 2 * t, D);
        qf[kk][2] = load2(qb, row0, nq, kk * 16 + 2 * t + 8, D);
        qf[kk][3] = load2(qb, row1, nq, kk * 16 + 2 * t + 8, D);
    }

    float oacc[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) oacc[dn][0] = oacc[dn][1] = oacc[dn][2] = oacc[dn][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const float scale_log2 = scale * 1.4426950408889634f;

    // Keys any row of this block can see.
    int kv_end = nk;
    if (causal) {
        long long e = (long long)(q0 + MMA_BR - 1) + off + 1;
        kv_end = (int)(e < 0 ? 0 : (e > nk ? nk : e));
    }

    for (int kv0 = 0; kv0 < kv_end; kv0 += MMA_BC) {
        __syncthreads();  // the previous tile has been consumed by every warp
        for (int idx = tid; idx < MMA_BC * (D / 8); idx += MMA_THREADS) {
            const int r = idx / (D / 8), c8 = idx % (D / 8);
            const int key = kv0 + r;
            uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
            if (key < nk) {
                kx = *reinterpret_cast<const uint4*>(kb + (size_t)key * D + c8 * 8);
                vx = *reinterpret_cast<const uint4*>(vb + (size_t)key * D + c8 * 8);
            }
            *reinterpret_cast<uint4*>(&ks[r * LD + c8 * 8]) = kx;
            *reinterpret_cast<uint4*>(&vs[r * LD + c8 * 8]) = vx;
        }
        __syncthreads();

        // S = Q K^T for this warp's 16 rows and the 64 keys of the tile.
        float s[MMA_BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < MMA_BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t bf[2];
                const T* kr = &ks[(nt * 8 + g) * LD + kk * 16 + 2 * t];
                bf[0] = *reinterpret_cast<const uint32_t*>(kr);
                bf[1] = *reinterpret_cast<const uint32_t*>(kr + 8);
                mma16816<T>(s[nt], qf[kk], bf);
            }
        }

        // Scale to log2 units and mask (past the end of the keys, or causal).
        const bool need_mask =
            kv0 + MMA_BC > nk || (causal && (long long)(kv0 + MMA_BC - 1) > (long long)q0 + off);
#pragma unroll
        for (int nt = 0; nt < MMA_BC / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[nt][e] * scale_log2;
                if (need_mask) {
                    const int col = kv0 + nt * 8 + 2 * t + (e & 1);
                    const int row = e < 2 ? row0 : row1;
                    const bool ok = col < nk && (!causal || (long long)col <= (long long)row + off);
                    x = ok ? x : NEG_INF;
                }
                s[nt][e] = x;
            }
        }

        // Online softmax: new row maxima (a quad of 4 threads shares each row).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int nt = 0; nt < MMA_BC / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_use = mx == NEG_INF ? 0.f : mx;  // a row that saw nothing yet
            const float corr = exp2f(m[r] - m_use);         // 0 when m[r] is -inf
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < MMA_BC / 8; ++nt) {
                const float p0 = exp2f(s[nt][2 * r] - m_use);
                const float p1 = exp2f(s[nt][2 * r + 1] - m_use);
                s[nt][2 * r] = p0;
                s[nt][2 * r + 1] = p1;
                sum += p0 + p1;
            }
            l[r] = l[r] * corr + sum;  // per-thread partial; summed over the quad at the end
            m[r] = mx;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                oacc[dn][2 * r] *= corr;
                oacc[dn][2 * r + 1] *= corr;
            }
        }

        // O += P V: the S accumulators are laid out as the A operand of the next mma.
#pragma unroll
        for (int kk = 0; kk < MMA_BC / 16; ++kk) {
            uint32_t a[4];
            a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                // Four 8x8 transposed tiles of V: keys kk*16 + (0..15), dims dn*8 + (0..15).
                const T* p = &vs[(kk * 16 + (lane & 15)) * LD + dn * 8 + (lane >> 4) * 8];
                const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
                uint32_t b0[2], b1[2];
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
                             : "r"(addr));
                mma16816<T>(oacc[dn], a, b0);
                mma16816<T>(oacc[dn + 1], a, b1);
            }
        }
    }

    // Normalise and write O and the log-sum-exp.
    T* ob = o + ((size_t)b * hq + h) * nq * D;
    float* lb = lse + ((size_t)b * hq + h) * nq;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const int row = r == 0 ? row0 : row1;
        if (row < nq) {
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                *reinterpret_cast<uint32_t*>(ob + (size_t)row * D + dn * 8 + 2 * t) =
                    pack2<T>(oacc[dn][2 * r] * inv, oacc[dn][2 * r + 1] * inv);
            }
            if (t == 0) lb[row] = lt > 0.f ? (m[r] + log2f(lt)) * 0.6931471805599453f : NEG_INF;
        }
    }
}

// ---------------------------------------------------------------- entry points
#define SIMPLE_ENTRIES(T, SUF)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS)                                   \
        cqsa_fwd_simple_##SUF(const T* q, const T* k, const T* v, T* o, float* lse, int hq, int hkv, \
                              int nq, int nk, int d, float scale, int causal, long long off) {        \
        fwd_simple<T>(q, k, v, o, lse, hq, hkv, nq, nk, d, scale, causal, off);                       \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS)                                   \
        cqsa_bwd_delta_##SUF(const T* o, const T* g, float* delta, long long rows, int d) {          \
        bwd_delta<T>(o, g, delta, rows, d);                                                           \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS) cqsa_bwd_dq_simple_##SUF(        \
        const T* q, const T* k, const T* v, const T* g, const float* lse, const float* delta, T* dq,  \
        int hq, int hkv, int nq, int nk, int d, float scale, int causal, long long off) {             \
        bwd_dq_simple<T>(q, k, v, g, lse, delta, dq, hq, hkv, nq, nk, d, scale, causal, off);         \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS) cqsa_bwd_dkdv_simple_##SUF(      \
        const T* q, const T* k, const T* v, const T* g, const float* lse, const float* delta, T* dk,  \
        T* dv, int hq, int hkv, int nq, int nk, int d, float scale, int causal, long long off) {      \
        bwd_dkdv_simple<T>(q, k, v, g, lse, delta, dk, dv, hq, hkv, nq, nk, d, scale, causal, off);   \
    }

SIMPLE_ENTRIES(float, f32)
SIMPLE_ENTRIES(__half, f16)
SIMPLE_ENTRIES(__nv_bfloat16, bf16)

#define MMA_ENTRY(T, SUF, D)                                                                         \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS)                                       \
        cqsa_fwd_mma_##SUF##_d##D(const T* q, const T* k, const T* v, T* o, float* lse, int hq,      \
                                  int hkv, int nq, int nk, float scale, int causal, long long off) { \
        fwd_mma<T, D>(q, k, v, o, lse, hq, hkv, nq, nk, scale, causal, off);                        \
    }

MMA_ENTRY(__half, f16, 64)
MMA_ENTRY(__half, f16, 128)
MMA_ENTRY(__nv_bfloat16, bf16, 64)
MMA_ENTRY(__nv_bfloat16, bf16, 128)
