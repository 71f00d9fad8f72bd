// Exact chunked attention (cqsa): forward and backward.
//
// Layouts: q, o, do: (b, hq, nq, d); k, v, dk, dv: (b, hkv, nk, d); lse, delta:
// (b, hq, nq) f32, natural log. Query head h reads kv head h / (hq / hkv).
// Mask (a band): key j is visible from query i iff i + lo <= j <= i + hi, with int
// lo, hi clamped by the launcher to [-(nq + BAND_PAD), nk + BAND_PAD]; the ends of
// that range mean no bound (beyond any j - i of the call, tile padding included),
// so the arithmetic needs no flag: causal is hi = nk - nq for a whole call
// (bottom-right aligned; chunks of the streamed mode use other values), a sliding
// window adds lo. The mask is applied to the (soft-capped) scores before the row
// maximum. A row that sees no key gets output 0 and lse -inf.
// Soft-capping (softcap > 0): s = softcap * tanh(scale * q.k / softcap); the
// backward multiplies dS by 1 - tanh^2. softcap == 0: none.
//
// Two families:
// - *_simple_*: one warp per query row (forward, dq) or per key row (dk/dv), f32
//   arithmetic, any head dim 1..256, any dtype. Obviously right, not fast.
// - fwd_mma_*: FlashAttention-2 style forward for f16/bf16 and head dims 64/128:
//   a block of 4 warps owns 128 query rows (32 per warp), walks 64-key tiles of K/V
//   staged in shared memory, computes S = Q K^T and O += P V with
//   mma.sync.m16n8k16 (f32 accumulate, operands by ldmatrix) and keeps the online
//   softmax in registers.
#include "attention_common.cuh"

constexpr int SIMPLE_WARPS = 4;
constexpr int MAXC = 8;  // 256 / 32 head-dim elements per lane

// ---------------------------------------------------------------- simple forward
template <typename T>
__device__ void fwd_simple(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           T* __restrict__ o, float* __restrict__ lse, int hq, int hkv, int nq, int nk,
                           int d, float scale, int lo, int hi, float cap) {
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
        qv[c] = x < d ? to_f(qr[x]) : 0.f;
        acc[c] = 0.f;
    }
    int ja, jb;
    key_range(row, nk, lo, hi, &ja, &jb);
    float m = NEG_INF, l = 0.f;
    for (int j = ja; j < jb; ++j) {
        const T* kr = kb + (size_t)j * d;
        const T* vr = vb + (size_t)j * d;
        float x = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int xi = lane + 32 * c;
            if (xi < d) x += qv[c] * to_f(kr[xi]);
        }
        float dsdx;
        const float s = score(warp_sum(x), scale, cap, &dsdx);
        float mn = fmaxf(m, s);
        float corr = __expf(m - mn);
        float p = __expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int xi = lane + 32 * c;
            if (xi < d) acc[c] = acc[c] * corr + p * to_f(vr[xi]);
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
                              int nq, int nk, int d, float scale, int lo, int hi, float cap) {
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
    int ja, jb;
    key_range(row, nk, lo, hi, &ja, &jb);
    if (li == NEG_INF) jb = ja;  // a row that saw no key: gradient 0
    for (int j = ja; j < jb; ++j) {
        const T* kr = kb + (size_t)j * d;
        const T* vr = vb + (size_t)j * d;
        float x = 0.f, dp = 0.f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int xi = lane + 32 * c;
            if (xi < d) {
                x += qv[c] * to_f(kr[xi]);
                dp += gv[c] * to_f(vr[xi]);
            }
        }
        dp = warp_sum(dp);
        float dsdx;
        const float s = score(warp_sum(x), scale, cap, &dsdx);
        const float p = __expf(s - li);
        const float ds = p * (dp - di) * dsdx;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) {
            int xi = lane + 32 * c;
            if (xi < d) acc[c] += ds * to_f(kr[xi]);
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
                                int hq, int hkv, int nq, int nk, int d, float scale, int lo,
                                int hi, float cap) {
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
    int ia, ib;
    row_range(j, nq, lo, hi, &ia, &ib);
    for (int h = kh * group; h < (kh + 1) * group; ++h) {
        const size_t base = ((size_t)b * hq + h) * nq;
        for (int i = ia; i < ib; ++i) {
            const size_t qrow = base + i;
            const float li = lse[qrow];
            if (li == NEG_INF) continue;
            const T* qr = q + qrow * d;
            const T* gr = g + qrow * d;
            float x = 0.f, dp = 0.f;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                int xi = lane + 32 * c;
                if (xi < d) {
                    x += to_f(qr[xi]) * kv[c];
                    dp += to_f(gr[xi]) * vv[c];
                }
            }
            dp = warp_sum(dp);
            float dsdx;
            const float s = score(warp_sum(x), scale, cap, &dsdx);
            const float p = __expf(s - li);
            const float ds = p * (dp - delta[qrow]) * dsdx * scale;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) {
                int xi = lane + 32 * c;
                if (xi < d) {
                    av[c] += p * to_f(gr[xi]);
                    ak[c] += ds * to_f(qr[xi]);
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

constexpr int MMA_BC = 64;    // keys per tile of the forward; keys per block of the backward
constexpr int MMA_PAD = 8;    // shared-memory row padding (elements): no bank conflicts
constexpr int MMA_THREADS = 128;
constexpr int MMA_WARPS = MMA_THREADS / 32;

// Two consecutive 16-bit elements of shared memory as one register.
template <typename T> __device__ __forceinline__ uint32_t lds2(const T* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

// B operands of two adjacent m16n8k16 tiles (n = dims dn*8..dn*8+15) from a
// row-major [k][n] tile in shared memory (rows k0..k0+15), transposed by ldmatrix.
// `base` points at element (k0, n0); `ld` is the row stride in elements.
template <typename T>
__device__ __forceinline__ void ldsm_trans_b(const T* base, int ld, int lane, uint32_t* b0, uint32_t* b1) {
    const T* p = base + (lane & 15) * ld + (lane >> 4) * 8;
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
                 : "r"(addr));
}

// A operand (16 rows x 16 k) from a row-major tile in shared memory: `base` at
// (row0, k0), rows g and g+8, columns 2t.. and 2t+8...
template <typename T>
__device__ __forceinline__ void lds_a(const T* base, int ld, int g, int t, uint32_t* a) {
    a[0] = lds2(base + g * ld + 2 * t);
    a[1] = lds2(base + (g + 8) * ld + 2 * t);
    a[2] = lds2(base + g * ld + 2 * t + 8);
    a[3] = lds2(base + (g + 8) * ld + 2 * t + 8);
}

// B operand (16 k x 8 n, "col") from a row-major [n][k] tile: `base` at (n0, k0).
template <typename T>
__device__ __forceinline__ void lds_b(const T* base, int ld, int g, int t, uint32_t* b) {
    b[0] = lds2(base + g * ld + 2 * t);
    b[1] = lds2(base + g * ld + 2 * t + 8);
}

// The A operand of the next mma from two adjacent accumulator tiles (C layout of
// m16n8 tiles 2kk and 2kk+1 is the A layout of one m16k16 tile).
template <typename T>
__device__ __forceinline__ void acc_to_a(const float* c0, const float* c1, uint32_t* a) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// ldmatrix x4 at a shared-memory address (per-lane row address, see callers).
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Lane offsets (elements) of ldmatrix x4 in a row-major tile with row stride ld:
// - A layout (also B of [k][n] with .trans): rows lane&15, columns (lane>>4)*8,
//   giving the m16k16 A fragment {a0..a3}, or B of n-tiles 0 and 1 as {r0,r1},{r2,r3};
// - B of a [n][k] tile (no .trans): rows (lane&7) + (lane>>4)*8, columns
//   ((lane>>3)&1)*8, giving B of n-tiles 0 and 1 (n0.., n0+8..) as {r0,r1},{r2,r3}.
__device__ __forceinline__ int ldsm_a_off(int lane, int ld) { return (lane & 15) * ld + (lane >> 4) * 8; }
__device__ __forceinline__ int ldsm_bn_off(int lane, int ld) {
    return ((lane & 7) + ((lane >> 4) << 3)) * ld + ((lane >> 3) & 1) * 8;
}

// Forward tiling: 4 warps, each owning MT m16 row tiles, so every K/V fragment
// read from shared memory feeds MT mmas. Dynamic shared memory: the Q tile and
// two stages of K and V tiles.
constexpr int FWD_MT = 2;
template <int D> struct FwdCfg {
    static constexpr int BR = 16 * FWD_MT * MMA_WARPS;  // query rows per block
    static constexpr int LD = D + MMA_PAD;
    static constexpr int SMEM = (BR + 2 * 2 * MMA_BC) * LD * 2;
};

// Tensor-core forward. Requires: d == D, D % 16 == 0, q/k/v 16-byte aligned
// (checked by the launcher), FwdCfg<D>::SMEM of dynamic shared memory, a grid of
// ceil(nq / FwdCfg<D>::BR) blocks in x. K/V tiles are double-buffered: the copy of
// tile i+1 (cp.async) overlaps the math on tile i.
// SOFTCAP is a template argument so that the plain instance carries none of it;
// the band (lo, hi) is tested once per tile and warp, per element only on the
// tiles it cuts. A packed call (`segs`, see Seg) runs a block per query block
// of each document, its sizes and band the document's.
template <typename T, int D, bool SOFTCAP>
__device__ void fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        T* __restrict__ o, float* __restrict__ lse, int hq, int hkv, int nq_all,
                        int nk_all, float scale, int lo_all, int hi_all, float cap, const Seg* segs) {
    using C = FwdCfg<D>;
    constexpr int MT = FWD_MT, BR = C::BR, LD = C::LD;
    constexpr int TILE = MMA_BC * LD;  // elements of one K (or V) tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)C::SMEM) __trap();  // launcher bug
    T* qs = reinterpret_cast<T*>(smem_raw);  // [BR][LD]
    T* ks = qs + BR * LD;                     // [2][MMA_BC][LD]
    T* vs = ks + 2 * TILE;                    // [2][MMA_BC][LD]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    int h, b;
    const Seg sg = block_seg(segs, nq_all, nk_all, lo_all, hi_all, true, hw_block(), &h, &b);
    const int nq = sg.nq, nk = sg.nk, lo = sg.lo, hi = sg.hi;
    const bool has_lo = lo > -(nq + BAND_PAD), has_hi = hi < nk + BAND_PAD;
    int qblk = sg.blk >= 0 ? sg.blk : (int)blockIdx.x;
    if (sg.blk < 0 && has_hi && !has_lo) {
        // Causal-like: the last query blocks see the most keys. Blocks start in launch order, so
        // hand out work heaviest first across every (batch, head), not only within
        // one head: the light blocks then fill the tail of the grid.
        const int heads = gridDim.y * gridDim.z;
        const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        qblk = gridDim.x - 1 - lin / heads;
        h = lin % heads % gridDim.y;
        b = lin % heads / gridDim.y;
    }
    const int kh = h / (hq / hkv);
    const int q0 = qblk * BR;
    const T* qb = q + (((size_t)b * hq + h) * (size_t)nq_all + sg.q_off) * D;
    const T* kb = k + (((size_t)b * hkv + kh) * (size_t)nk_all + sg.k_off) * D;
    const T* vb = v + (((size_t)b * hkv + kh) * (size_t)nk_all + sg.k_off) * D;
    const int wrow = warp * 16 * MT;  // this warp's first row in the block

    // Keys any row of this block can see: from the first row's lower bound
    // (rounded down to a tile) to the last row's upper bound. A sliding window
    // visits O(window) keys per block, not nk.
    const int kv_begin = clampi((long long)q0 + lo, nk) / MMA_BC * MMA_BC;
    const int kv_end = clampi((long long)(q0 + BR - 1) + hi + 1, nk);

    // Copies: thread tid moves 16-byte chunk (tid % CPR) of rows tid / CPR + i * RSTEP.
    constexpr int CPR = D / 8, RSTEP = MMA_THREADS / CPR;
    static_assert(MMA_THREADS % CPR == 0 && MMA_BC % RSTEP == 0 && BR % RSTEP == 0, "copy layout");
    const int cr = tid / CPR, cc = (tid % CPR) * 8;
    const uint32_t qs_u = smem_u32(qs), ks_u = smem_u32(ks), vs_u = smem_u32(vs);
    const uint32_t cp_dst = (cr * LD + cc) * 2;  // byte offset in a tile

    // Q tile (zero past nq), in the cp.async group of the first K/V tile.
#pragma unroll
    for (int i = 0; i < BR / RSTEP; ++i) {
        const int row = q0 + cr + i * RSTEP;
        const bool in = row < nq;
        cp_async16s(qs_u + cp_dst + i * RSTEP * LD * 2, qb + (size_t)(in ? row : 0) * D + cc, in ? 16 : 0);
    }
    // Stage a K/V tile (keys kv0..kv0+63, zero past nk).
    auto load_tile = [&](int kv0, int stage) {
        const uint32_t kd = ks_u + stage * TILE * 2 + cp_dst, vd = vs_u + stage * TILE * 2 + cp_dst;
#pragma unroll
        for (int i = 0; i < MMA_BC / RSTEP; ++i) {
            const int key = kv0 + cr + i * RSTEP;
            const bool in = key < nk;
            const size_t src = (size_t)(in ? key : 0) * D + cc;
            cp_async16s(kd + i * RSTEP * LD * 2, kb + src, in ? 16 : 0);
            cp_async16s(vd + i * RSTEP * LD * 2, vb + src, in ? 16 : 0);
        }
    };
    if (kv_end > kv_begin) load_tile(kv_begin, 0);
    cp_async_commit();

    // Per-lane ldmatrix addresses: Q rows of this warp (A), K (B from [key][dim]),
    // V (B from [key][dim], transposed).
    const uint32_t qa_base = qs_u + (wrow * LD + ldsm_a_off(lane, LD)) * 2;
    const uint32_t ka_base = ks_u + ldsm_bn_off(lane, LD) * 2;
    const uint32_t va_base = vs_u + ldsm_a_off(lane, LD) * 2;

    float oacc[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) oacc[mt][dn][0] = oacc[mt][dn][1] = oacc[mt][dn][2] = oacc[mt][dn][3] = 0.f;
    // Row maxima m in the units of s; l: per-thread partial row sums.
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m[mt][0] = m[mt][1] = NEG_INF, l[mt][0] = l[mt][1] = 0.f;
    // p = exp2(s * fold - max * fold). With scale > 0, s stays unscaled and the
    // scale folds into that fma; otherwise s is scaled first (keeps max = max).
    // Soft-capped scores are formed in log2 units first (fold 1).
    const float sl2 = scale * LOG2E;
    const bool prescale = SOFTCAP || !(sl2 > 0.f);
    const float fold = prescale ? 1.f : sl2;
    const float cap_in = SOFTCAP ? scale / cap : 0.f, cap_out = SOFTCAP ? cap * LOG2E : 0.f;
    // This warp's rows: wr0..wr1.
    const int wr0 = q0 + wrow, wr1 = q0 + wrow + 16 * MT - 1;

    int stage = 0;
    for (int kv0 = kv_begin; kv0 < kv_end; kv0 += MMA_BC, stage ^= 1) {
        // Prefetch the next tile into the other stage (consumed two barriers ago).
        if (kv0 + MMA_BC < kv_end) load_tile(kv0 + MMA_BC, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // every group but the newest has landed: this tile is here
        __syncthreads();
        // A tile that starts after this warp's last row's last key, or ends before
        // its first row's first key, adds nothing to it (the edge tiles of a
        // block); the warp only keeps the barriers.
        if (!(kv0 > wr1 + hi || kv0 + MMA_BC - 1 < wr0 + lo)) {
        const uint32_t kt = ka_base + stage * TILE * 2;
        const uint32_t vt = va_base + stage * TILE * 2;

        // S = Q K^T for this warp's 16*MT rows and the 64 keys of the tile.
        float s[MT][MMA_BC / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < MMA_BC / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa_base + (mt * 16 * LD + kk * 16) * 2, qa[mt]);
#pragma unroll
            for (int np = 0; np < MMA_BC / 16; ++np) {
                uint32_t kf[4];
                ldsm_x4(kt + (np * 16 * LD + kk * 16) * 2, kf);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<T>(s[mt][2 * np], qa[mt], kf);
                    mma16816<T>(s[mt][2 * np + 1], qa[mt], kf + 2);
                }
            }
        }

        if (SOFTCAP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < MMA_BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] = cap_out * tanh_acc(s[mt][nt][e] * cap_in);
        } else if (prescale) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < MMA_BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mt][nt][e] *= sl2;
        }
        // Mask keys past the end and outside the band, after soft-capping and
        // before the row maximum (warp-uniform test: the warp's first row does not
        // see the tile's last key, or its last row not the tile's first).
        if (kv0 + MMA_BC > nk || kv0 + MMA_BC - 1 > wr0 + hi || kv0 < wr1 + lo) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < MMA_BC / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = kv0 + nt * 8 + 2 * t + (e & 1);
                        const int row = q0 + wrow + mt * 16 + g + (e < 2 ? 0 : 8);
                        const bool ok = col < nk && col - row <= hi && col - row >= lo;
                        if (!ok) s[mt][nt][e] = NEG_INF;
                    }
        }

        // Online softmax: new row maxima (a quad of 4 threads shares each row).
        float corr[MT][2];
        bool rescale = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m[mt][r];
#pragma unroll
                for (int nt = 0; nt < MMA_BC / 8; ++nt)
                    mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float ms = (mx == NEG_INF ? 0.f : mx) * fold;  // a row that saw nothing yet
                // Unchanged maximum: exactly 1 (and the O rescale can be skipped);
                // from m = -inf: 0.
                corr[mt][r] = mx == m[mt][r] ? 1.f : exp2f(fmaf(m[mt][r], fold, -ms));
                rescale |= mx != m[mt][r];
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < MMA_BC / 8; ++nt) {
                    const float p0 = exp2f(fmaf(s[mt][nt][2 * r], fold, -ms));
                    const float p1 = exp2f(fmaf(s[mt][nt][2 * r + 1], fold, -ms));
                    s[mt][nt][2 * r] = p0;
                    s[mt][nt][2 * r + 1] = p1;
                    sum += p0 + p1;
                }
                l[mt][r] = l[mt][r] * corr[mt][r] + sum;  // summed over the quad at the end
                m[mt][r] = mx;
            }
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int dn = 0; dn < D / 8; ++dn) {
                    oacc[mt][dn][0] *= corr[mt][0];
                    oacc[mt][dn][1] *= corr[mt][0];
                    oacc[mt][dn][2] *= corr[mt][1];
                    oacc[mt][dn][3] *= corr[mt][1];
                }
        }

        // O += P V: the S accumulators are laid out as the A operand of the next mma.
#pragma unroll
        for (int kk = 0; kk < MMA_BC / 16; ++kk) {
            uint32_t pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) acc_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], pa[mt]);
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                // Keys kk*16 + (0..15), dims dp*16 + (0..15), transposed by ldmatrix.
                uint32_t vf[4];
                ldsm_x4_trans(vt + (kk * 16 * LD + dp * 16) * 2, vf);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<T>(oacc[mt][2 * dp], pa[mt], vf);
                    mma16816<T>(oacc[mt][2 * dp + 1], pa[mt], vf + 2);
                }
            }
        }
        }  // tile not entirely masked for this warp
        __syncthreads();  // every warp is done with this stage before it is refilled
    }
    cp_async_wait<0>();  // no copy may be in flight when the block exits

    // Normalise and write O and the log-sum-exp.
    T* ob = o + (((size_t)b * hq + h) * (size_t)nq_all + sg.q_off) * D;
    float* lb = lse + ((size_t)b * hq + h) * (size_t)nq_all + sg.q_off;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float lt = l[mt][r];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const float inv = lt > 0.f ? 1.f / lt : 0.f;
            const int row = q0 + wrow + mt * 16 + g + 8 * r;
            if (row < nq) {
#pragma unroll
                for (int dn = 0; dn < D / 8; ++dn) {
                    *reinterpret_cast<uint32_t*>(ob + (size_t)row * D + dn * 8 + 2 * t) =
                        pack2<T>(oacc[mt][dn][2 * r] * inv, oacc[mt][dn][2 * r + 1] * inv);
                }
                if (t == 0) lb[row] = lt > 0.f ? (m[mt][r] * fold + log2f(lt)) * 0.6931471805599453f : NEG_INF;
            }
        }
}

// ---------------------------------------------------------------- tensor-core backward
// FlashAttention-2 style, one block per BC = 16 * WARPS keys of one (batch, kv head):
// K and V of the block stay in shared memory and dK, dV in registers (warp w owns
// keys 16w..16w+15) while the block walks every query head of the group and every
// query tile of BQ rows that can see its keys. Per tile, with P recomputed from the
// saved log-sum-exp:
//   S^T = K Q^T, P^T = exp(S^T * scale - lse), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q,
//   dQ += dS K (dS through shared memory, added to an f32 buffer with atomics).
// dK and dQ are multiplied by `scale` at the end (dQ by the conversion kernel).
// Q, dO, lse and delta of a tile are double-buffered: the copy of the next tile
// (cp.async) overlaps the math on this one.
template <int D> struct BwdCfg {
    static constexpr int WARPS = D <= 64 ? 4 : 8;  // BWD_BOUNDS_##D must match THREADS
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int BC = 16 * WARPS;         // keys per block
    static constexpr int BQ = D <= 64 ? 64 : 32;  // query rows per tile (register budget)
    static constexpr int LD = D + MMA_PAD;
    static constexpr int LDS = BC + MMA_PAD;
    // K, V (BC rows), two stages of Q, dO (BQ rows), dS (BQ x BC), two stages of
    // lse and delta (BQ).
    static constexpr int SMEM = (2 * BC * LD + 4 * BQ * LD + BQ * LDS) * 2 + 4 * BQ * 4;
};

// 4-byte global -> shared copy; `bytes` 0 fills zeros.
__device__ __forceinline__ void cp_async4s(uint32_t smem, const void* gmem, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}

// dst[0..1] += (a, b) in global memory (one vector reduction where the GPU has it).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

// BANDED (any mask: causal, window) is a template argument so that the unmasked
// instance carries none of the band's bookkeeping (the entry point picks one;
// measured 5 % faster), and SOFTCAP so that the plain entry points carry none of
// the soft-capping (its own entry points, `cqsa_bwd_mma_cap_*`).
template <typename T, int D, bool BANDED, bool SOFTCAP>
__device__ void bwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                        const T* __restrict__ g, const float* __restrict__ lse,
                        const float* __restrict__ delta, float* __restrict__ dq_acc, T* __restrict__ dk,
                        T* __restrict__ dv, int hq, int hkv, int nq_all, int nk_all, float scale,
                        int lo_all, int hi_all, float cap, const Seg* segs) {
    constexpr bool banded = BANDED;
    using C = BwdCfg<D>;
    constexpr int BQ = C::BQ, LD = C::LD, LDS = C::LDS, BC = C::BC, WARPS = C::WARPS;
    constexpr int THREADS = C::THREADS;
    constexpr int RG = BQ / 16;     // row groups of the dQ step
    constexpr int DG = WARPS / RG;  // dim groups of the dQ step
    constexpr int DW = D / DG;      // dims per warp in the dQ step
    static_assert(WARPS % RG == 0 && DW % 16 == 0, "dQ step layout");
    static_assert(2 * BQ <= THREADS, "lse/delta copy layout");
    constexpr int QTILE = BQ * LD;  // elements of one Q (or dO) stage

    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)C::SMEM) __trap();  // launcher bug
    T* ks = reinterpret_cast<T*>(smem_raw);  // [BC][LD]
    T* vs = ks + BC * LD;                     // [BC][LD]
    T* qs = vs + BC * LD;                     // [2][BQ][LD]
    T* gs = qs + 2 * QTILE;                   // [2][BQ][LD]
    T* dss = gs + 2 * QTILE;                  // [BQ][LDS]: dS, query-major
    float* ls = reinterpret_cast<float*>(dss + BQ * LDS);  // [2][BQ] lse as stored
    float* dls = ls + 2 * BQ;                              // [2][BQ] delta

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, t = lane & 3;
    int kh, b;
    const Seg sg = block_seg(segs, nq_all, nk_all, lo_all, hi_all, false, hw_block(), &kh, &b);
    const int nq = sg.nq, nk = sg.nk, lo = sg.lo, hi = sg.hi;
    int kblk = sg.blk >= 0 ? sg.blk : (int)blockIdx.x;
    if (banded && sg.blk < 0) {
        // Causal: the first key blocks are seen by the most query rows: heaviest first
        // across every (batch, kv head), as in the forward.
        const int heads = gridDim.y * gridDim.z;
        const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        kblk = lin / heads;
        kh = lin % heads % gridDim.y;
        b = lin % heads / gridDim.y;
    }
    const int j0 = kblk * BC;
    const int group = hq / hkv;
    const size_t kvbase = ((size_t)b * hkv + kh) * (size_t)nk_all + sg.k_off;
    const T* kb = k + kvbase * D;
    const T* vb = v + kvbase * D;

    // Copies: thread tid moves 16-byte chunk (tid % CPR) of rows tid / CPR + i * RSTEP.
    constexpr int CPR = D / 8, RSTEP = THREADS / CPR;
    static_assert(THREADS % CPR == 0 && BC % RSTEP == 0 && BQ % RSTEP == 0, "copy layout");
    const int cr = tid / CPR, cc = (tid % CPR) * 8;
    const uint32_t cp_dst = (cr * LD + cc) * 2;  // byte offset in a tile
    const uint32_t ks_u = smem_u32(ks), vs_u = smem_u32(vs), qs_u = smem_u32(qs), gs_u = smem_u32(gs);
    const uint32_t ls_u = smem_u32(ls), dls_u = smem_u32(dls);

#pragma unroll
    for (int i = 0; i < BC / RSTEP; ++i) {
        const int key = j0 + cr + i * RSTEP;
        const bool in = key < nk;
        const size_t src = (size_t)(in ? key : 0) * D + cc;
        cp_async16s(ks_u + cp_dst + i * RSTEP * LD * 2, kb + src, in ? 16 : 0);
        cp_async16s(vs_u + cp_dst + i * RSTEP * LD * 2, vb + src, in ? 16 : 0);
    }

    // Query rows that can see a key of this block: from the first row that sees
    // key j0 (rounded down to a tile) to the last row that sees key j0 + BC - 1.
    // A sliding window visits O(window) rows per block, not nq.
    int istart = 0, iend = nq;
    if (banded) {
        istart = clampi((long long)j0 - hi, nq) / BQ * BQ;
        iend = clampi((long long)j0 + BC - lo, nq);
    }
    // Tiles: every head of the group, and in each the query tiles istart..iend.
    const int tiles_h = iend > istart ? (iend - istart + BQ - 1) / BQ : 0;
    const int ntiles = tiles_h * group;

    // Stage tile `tau` (Q, dO zero past nq; lse, delta as stored).
    auto load_tile = [&](int tau, int stage) {
        const int hh = kh * group + tau / tiles_h;
        const int i0 = istart + (tau % tiles_h) * BQ;
        const size_t rowbase = ((size_t)b * hq + hh) * (size_t)nq_all + sg.q_off;
        const T* qb = q + rowbase * D;
        const T* gb = g + rowbase * D;
#pragma unroll
        for (int i = 0; i < BQ / RSTEP; ++i) {
            const int row = i0 + cr + i * RSTEP;
            const bool in = row < nq;
            const size_t src = (size_t)(in ? row : 0) * D + cc;
            const uint32_t dst = stage * QTILE * 2 + cp_dst + i * RSTEP * LD * 2;
            cp_async16s(qs_u + dst, qb + src, in ? 16 : 0);
            cp_async16s(gs_u + dst, gb + src, in ? 16 : 0);
        }
        if (tid < 2 * BQ) {
            const int r = tid % BQ;
            const int row = i0 + r;
            const bool in = row < nq;
            const float* src = (tid < BQ ? lse : delta) + rowbase + (in ? row : 0);
            cp_async4s((tid < BQ ? ls_u : dls_u) + (stage * BQ + r) * 4, src, in ? 4 : 0);
        }
    };
    if (ntiles > 0) load_tile(0, 0);
    cp_async_commit();

    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) dka[dn][e] = dva[dn][e] = 0.f;

    const int kw0 = j0 + warp * 16;       // this warp's first key
    const int kr0 = kw0 + g8;             // this thread's key rows (C layout rows g, g+8)
    const T* kw = ks + warp * 16 * LD;    // this warp's 16 keys
    const T* vw = vs + warp * 16 * LD;
    const float sl2 = scale * LOG2E;
    const float cap_in = SOFTCAP ? scale / cap : 0.f, cap_out = SOFTCAP ? cap * LOG2E : 0.f;

    for (int tau = 0; tau < ntiles; ++tau) {
        const int stage = tau & 1;
        cp_async_wait<0>();  // this tile (and at first K/V) has landed
        // This tile is visible, and every warp is done with the previous one (its
        // stage, which the prefetch below refills, and the dS tile).
        __syncthreads();
        if (tau + 1 < ntiles) load_tile(tau + 1, stage ^ 1);
        cp_async_commit();

        const int h = kh * group + tau / tiles_h;
        const int i0 = istart + (tau % tiles_h) * BQ;
        const size_t rowbase = ((size_t)b * hq + h) * (size_t)nq_all + sg.q_off;
        const T* qt = qs + stage * QTILE;
        const T* gt = gs + stage * QTILE;
        const float* lt = ls + stage * BQ;
        const float* dlt = dls + stage * BQ;

        // S^T = K Q^T: this warp's 16 keys x BQ queries.
        float st[BQ / 8][4];
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4(smem_u32(kw + kk * 16 + ldsm_a_off(lane, LD)), a);
#pragma unroll
            for (int np = 0; np < BQ / 16; ++np) {
                uint32_t bf[4];
                ldsm_x4(smem_u32(qt + (np * 16) * LD + kk * 16 + ldsm_bn_off(lane, LD)), bf);
                mma16816<T>(st[2 * np], a, bf);
                mma16816<T>(st[2 * np + 1], a, bf + 2);
            }
        }

        // P^T = exp(S^T * scale - lse), soft-capped first when SOFTCAP (keeping
        // 1 - tanh^2 for dS), masked (keys past nk, outside the band; warp-uniform
        // test). A row past nq or one that sees no key (lse = -inf) gets p = 0.
        const bool need_mask = kw0 + 16 > nk || (banded && (kw0 + 15 > i0 + hi || kw0 < i0 + BQ - 1 + lo));
        float dsx[SOFTCAP ? BQ / 8 : 1][4];
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + (e & 1);  // query within the tile
                float x;
                if (SOFTCAP) {
                    const float th = tanh_acc(st[nt][e] * cap_in);
                    dsx[SOFTCAP ? nt : 0][e] = 1.f - th * th;
                    x = cap_out * th;
                } else {
                    x = st[nt][e] * sl2;
                }
                if (need_mask) {
                    const int key = kr0 + (e < 2 ? 0 : 8);
                    const int rel = key - (i0 + col);  // j - i
                    const bool ok = key < nk && (!banded || (rel <= hi && rel >= lo));
                    x = ok ? x : NEG_INF;
                }
                const float li = lt[col];
                const float L = (li == NEG_INF || i0 + col >= nq) ? POS_INF : li * LOG2E;
                st[nt][e] = exp2f(x - L);
            }
        }

        // dV += P^T dO (A = P^T from the accumulators, B = dO rows transposed).
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            uint32_t a[4];
            acc_to_a<T>(st[2 * kk], st[2 * kk + 1], a);
#pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                uint32_t b0[2], b1[2];
                ldsm_trans_b(gt + (kk * 16) * LD + dn * 8, LD, lane, b0, b1);
                mma16816<T>(dva[dn], a, b0);
                mma16816<T>(dva[dn + 1], a, b1);
            }
        }

        // dP^T = V dO^T.
        float dpt[BQ / 8][4];
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) dpt[nt][0] = dpt[nt][1] = dpt[nt][2] = dpt[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4(smem_u32(vw + kk * 16 + ldsm_a_off(lane, LD)), a);
#pragma unroll
            for (int np = 0; np < BQ / 16; ++np) {
                uint32_t bf[4];
                ldsm_x4(smem_u32(gt + (np * 16) * LD + kk * 16 + ldsm_bn_off(lane, LD)), bf);
                mma16816<T>(dpt[2 * np], a, bf);
                mma16816<T>(dpt[2 * np + 1], a, bf + 2);
            }
        }

        // dS^T = P^T (dP^T - delta); also stored query-major for the dQ step.
#pragma unroll
        for (int nt = 0; nt < BQ / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + (e & 1);
                float ds = st[nt][e] * (dpt[nt][e] - dlt[col]);
                if (SOFTCAP) ds *= dsx[SOFTCAP ? nt : 0][e];
                dpt[nt][e] = ds;
                dss[col * LDS + warp * 16 + g8 + (e < 2 ? 0 : 8)] = from_f<T>(ds);
            }
        }

        // dK += dS^T Q.
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            uint32_t a[4];
            acc_to_a<T>(dpt[2 * kk], dpt[2 * kk + 1], a);
#pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                uint32_t b0[2], b1[2];
                ldsm_trans_b(qt + (kk * 16) * LD + dn * 8, LD, lane, b0, b1);
                mma16816<T>(dka[dn], a, b0);
                mma16816<T>(dka[dn + 1], a, b1);
            }
        }
        __syncthreads();  // dS of every warp is in shared memory

        // dQ[tile] += dS K: warp (rg, dg) owns rows 16rg.. and dims DW*dg.. of the tile.
        {
            const int rg = warp % RG, dg = warp / RG;
            float dqa[DW / 8][4];
#pragma unroll
            for (int dn = 0; dn < DW / 8; ++dn) dqa[dn][0] = dqa[dn][1] = dqa[dn][2] = dqa[dn][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                uint32_t a[4];
                lds_a(dss + (rg * 16) * LDS + kk * 16, LDS, g8, t, a);
#pragma unroll
                for (int dn = 0; dn < DW / 8; dn += 2) {
                    uint32_t b0[2], b1[2];
                    ldsm_trans_b(ks + (kk * 16) * LD + dg * DW + dn * 8, LD, lane, b0, b1);
                    mma16816<T>(dqa[dn], a, b0);
                    mma16816<T>(dqa[dn + 1], a, b1);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = i0 + rg * 16 + g8 + 8 * r;
                if (row < nq) {
                    float* dst = dq_acc + (rowbase + row) * D + dg * DW + 2 * t;
#pragma unroll
                    for (int dn = 0; dn < DW / 8; ++dn) red_add2(dst + dn * 8, dqa[dn][2 * r], dqa[dn][2 * r + 1]);
                }
            }
        }
    }
    cp_async_wait<0>();  // no copy may be in flight when the block exits (ntiles == 0)

    // dK (times scale) and dV of this warp's keys.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kr0 + 8 * r;
        if (key < nk) {
            T* dkr = dk + (kvbase + key) * D + 2 * t;
            T* dvr = dv + (kvbase + key) * D + 2 * t;
#pragma unroll
            for (int dn = 0; dn < D / 8; ++dn) {
                *reinterpret_cast<uint32_t*>(dkr + dn * 8) =
                    pack2<T>(dka[dn][2 * r] * scale, dka[dn][2 * r + 1] * scale);
                *reinterpret_cast<uint32_t*>(dvr + dn * 8) = pack2<T>(dva[dn][2 * r], dva[dn][2 * r + 1]);
            }
        }
    }
}

// dq = dq_acc * scale, narrowed to T.
template <typename T>
__device__ void bwd_dq_convert(const float* __restrict__ acc, T* __restrict__ dq, long long n, float scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dq[i] = from_f<T>(acc[i] * scale);
}

// ---------------------------------------------------------------- entry points
// Every attention entry ends with (scale, lo, hi, cap): the band and soft-cap of
// the top of this file (lo/hi at -(nq + BAND_PAD) / nk + BAND_PAD when absent,
// cap 0 when none).
#define SIMPLE_ENTRIES(T, SUF)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS)                                   \
        cqsa_fwd_simple_##SUF(const T* q, const T* k, const T* v, T* o, float* lse, int hq, int hkv, \
                              int nq, int nk, int d, float scale, int lo, int hi,         \
                              float cap) {                                                            \
        fwd_simple<T>(q, k, v, o, lse, hq, hkv, nq, nk, d, scale, lo, hi, cap);                       \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS)                                   \
        cqsa_bwd_delta_##SUF(const T* o, const T* g, float* delta, long long rows, int d) {          \
        bwd_delta<T>(o, g, delta, rows, d);                                                           \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS) cqsa_bwd_dq_simple_##SUF(        \
        const T* q, const T* k, const T* v, const T* g, const float* lse, const float* delta, T* dq,  \
        int hq, int hkv, int nq, int nk, int d, float scale, int lo, int hi, float cap) { \
        bwd_dq_simple<T>(q, k, v, g, lse, delta, dq, hq, hkv, nq, nk, d, scale, lo, hi, cap);         \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * SIMPLE_WARPS) cqsa_bwd_dkdv_simple_##SUF(      \
        const T* q, const T* k, const T* v, const T* g, const float* lse, const float* delta, T* dk,  \
        T* dv, int hq, int hkv, int nq, int nk, int d, float scale, int lo, int hi,       \
        float cap) {                                                                                  \
        bwd_dkdv_simple<T>(q, k, v, g, lse, delta, dk, dv, hq, hkv, nq, nk, d, scale, lo, hi, cap);   \
    }

SIMPLE_ENTRIES(float, f32)
SIMPLE_ENTRIES(__half, f16)
SIMPLE_ENTRIES(__nv_bfloat16, bf16)


// Launch bounds of the backward: BwdCfg<D>::THREADS threads; for D = 64 at most
// 168 registers so that three blocks share an SM.
#define BWD_BOUNDS_64 __launch_bounds__(128, 3)
#define BWD_BOUNDS_128 __launch_bounds__(256)

// Tensor-core entries: cqsa_{fwd,bwd}_mma_* without soft-capping (the band at
// run time in the forward; banded or not picked here in the backward), and
// cqsa_{fwd,bwd}_mma_cap_* with it, so the plain kernels are not slowed by it.
#define MMA_ENTRY(T, SUF, D, CAPNAME, CAP)                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_THREADS, 2)                                     \
        cqsa_fwd_mma_##CAPNAME##SUF##_d##D(const T* q, const T* k, const T* v, T* o, float* lse,      \
                                           int hq, int hkv, int nq, int nk, float scale, int lo,     \
                                           int hi, float cap, const Seg* segs) {                     \
        fwd_mma<T, D, CAP>(q, k, v, o, lse, hq, hkv, nq, nk, scale, lo, hi, cap, segs);              \
    }                                                                                                \
    extern "C" __global__ void BWD_BOUNDS_##D cqsa_bwd_mma_##CAPNAME##SUF##_d##D(                    \
        const T* q, const T* k, const T* v, const T* g, const float* lse, const float* delta,        \
        float* dq_acc, T* dk, T* dv, int hq, int hkv, int nq, int nk, float scale, int lo, int hi,    \
        float cap, const Seg* segs) {                                                                \
        if (segs != nullptr || lo > -(nq + BAND_PAD) || hi < nk + BAND_PAD)                          \
            bwd_mma<T, D, true, CAP>(q, k, v, g, lse, delta, dq_acc, dk, dv, hq, hkv, nq, nk, scale, \
                                     lo, hi, cap, segs);                                             \
        else                                                                                         \
            bwd_mma<T, D, false, CAP>(q, k, v, g, lse, delta, dq_acc, dk, dv, hq, hkv, nq, nk,       \
                                      scale, lo, hi, cap, segs);                                     \
    }

MMA_ENTRY(__half, f16, 64, , false)
MMA_ENTRY(__half, f16, 128, , false)
MMA_ENTRY(__nv_bfloat16, bf16, 64, , false)
MMA_ENTRY(__nv_bfloat16, bf16, 128, , false)
MMA_ENTRY(__half, f16, 64, cap_, true)
MMA_ENTRY(__half, f16, 128, cap_, true)
MMA_ENTRY(__nv_bfloat16, bf16, 64, cap_, true)
MMA_ENTRY(__nv_bfloat16, bf16, 128, cap_, true)

#define CONVERT_ENTRY(T, SUF)                                                                          \
    extern "C" __global__ void cqsa_bwd_dq_convert_##SUF(const float* acc, T* dq, long long n,        \
                                                         float scale) {                               \
        bwd_dq_convert<T>(acc, dq, n, scale);                                                         \
    }

CONVERT_ENTRY(float, f32)
CONVERT_ENTRY(__half, f16)
CONVERT_ENTRY(__nv_bfloat16, bf16)
