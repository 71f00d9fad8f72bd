// Exact attention forward for Hopper (sm_90a): warpgroup MMA (wgmma) fed by the
// tensor memory accelerator (TMA), warp-specialised. Compiled only for compute
// capability 9.0 (kernels/build.rs); the mma.sync kernels of attention.cu stay the
// portable path.
//
// Same results as attention.cu's cqsa_fwd_mma_* (band (lo, hi), soft-cap, lse,
// GQA, layouts), but Q, K and V arrive as TMA tensor maps (3-D: head dim, sequence,
// batch * heads; 128-byte swizzle; boxes of 64 x rows x 1, zero-filled past the
// sequence), so the launcher builds those maps (cuTensorMapEncodeTiled).
//
// Per block: BR = 128 query rows and three warpgroups. Warpgroup 0 is the
// producer: one thread issues the TMA copies of Q and of K/V tiles of BC keys into
// rings of two stages each, handing them over through mbarriers ("full" when a
// copy has landed, "empty" when the consumers are done with a stage). Warpgroups 1
// and 2 compute 64 rows each, software-pipelined: iteration j issues
//   S_j = Q K_j^T       wgmma, Q and K from shared memory, both K-major, and
//   O += P_{j-1} V_{j-1} wgmma, P from registers (the accumulator layout is the A
//                        fragment layout), V from shared memory MN-major,
// waits for S_j only, and runs the softmax of tile j while the tensor cores run
// P_{j-1} V_{j-1}. The producer gives its registers to the consumers (setmaxnreg).
//
// Shared-memory tiles: a [rows][D] tile is D/64 column blocks of 64 elements, each
// [rows][128 B] with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)):
// what TMA writes for a box of 64 x rows and what the wgmma descriptors describe.
#include "attention_common.cuh"
#include "wgmma.cuh"
#include <cuda.h>

namespace hopper {

// Keys per K/V tile: 128 (S is m64n128, 64 f32 per thread), 64 for D = 256 so
// that O (m64n256, 128 f32 per thread) and S fit in registers.
template <int D> struct FwdCfg {
    static constexpr int BR = 128;
    static constexpr int BC = D == 256 ? 64 : 128;
    static constexpr int THREADS = 384;
    static constexpr int QBYTES = BR * D * 2;
    static constexpr int KVBYTES = BC * D * 2;
    // 1024 bytes of slack to align the tiles to the swizzle's 1024-byte period,
    // Q, two stages each of K and V, then 9 mbarriers (8 bytes each).
    static constexpr int BAR_OFF = QBYTES + 4 * KVBYTES;
    static constexpr int SMEM = 1024 + BAR_OFF + 128;
};

// Matrix descriptor of a shared-memory operand (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (16-byte units), and
// the 128-byte swizzle mode. Tiles are 1024-byte aligned, so the base offset is 0.
__device__ __forceinline__ uint64_t desc128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Keeps the compiler from moving accesses of wgmma accumulators across a wait.
template <int N> __device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// mbarriers (shared-memory addresses).
__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void bar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, int parity) {
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// One box of a 3-D tensor map into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// A [rows][D] tile at sequence position `row0` of slice `bh`: D/64 boxes.
template <int D>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int rows, int row0, int bh, uint32_t bar) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c) tma_load(dst + c * rows * 128, map, c * 64, row0, bh, bar);
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// D (m64 x N) (+)= A * B for the shapes the kernel uses.
template <typename T, int N> __device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int acc) {
    constexpr bool H = std::is_same<T, __half>::value;
    if constexpr (N == 64) { if constexpr (H) wgmma_ss_n64_f16(d, da, db, acc); else wgmma_ss_n64_bf16(d, da, db, acc); }
    else if constexpr (N == 128) { if constexpr (H) wgmma_ss_n128_f16(d, da, db, acc); else wgmma_ss_n128_bf16(d, da, db, acc); }
    else { if constexpr (H) wgmma_ss_n256_f16(d, da, db, acc); else wgmma_ss_n256_bf16(d, da, db, acc); }
}
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db) {
    constexpr bool H = std::is_same<T, __half>::value;
    if constexpr (N == 64) { if constexpr (H) wgmma_rs_n64_f16(d, a, db, 1); else wgmma_rs_n64_bf16(d, a, db, 1); }
    else if constexpr (N == 128) { if constexpr (H) wgmma_rs_n128_f16(d, a, db, 1); else wgmma_rs_n128_bf16(d, a, db, 1); }
    else { if constexpr (H) wgmma_rs_n256_f16(d, a, db, 1); else wgmma_rs_n256_bf16(d, a, db, 1); }
}

// Which query block, head and batch this block computes, and the key tiles it
// visits: [kv_begin, kv_begin + ntiles * BC), a sliding window's O(window) only.
struct Work {
    int qblk, h, b, kv_begin, ntiles;
};
template <int D>
__device__ __forceinline__ Work block_work(int nq, int nk, int lo, int hi) {
    using C = FwdCfg<D>;
    Work w{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, 0, 0};
    const bool has_lo = lo > -(nq + BAND_PAD), has_hi = hi < nk + BAND_PAD;
    if (has_hi && !has_lo) {
        // Causal-like: heaviest query blocks first across every (batch, head).
        const int heads = gridDim.y * gridDim.z;
        const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        w.qblk = gridDim.x - 1 - lin / heads;
        w.h = lin % heads % gridDim.y;
        w.b = lin % heads / gridDim.y;
    }
    const int q0 = w.qblk * C::BR;
    w.kv_begin = clampi((long long)q0 + lo, nk) / C::BC * C::BC;
    const int kv_end = clampi((long long)(q0 + C::BR - 1) + hi + 1, nk);
    w.ntiles = kv_end > w.kv_begin ? (kv_end - w.kv_begin + C::BC - 1) / C::BC : 0;
    return w;
}

// The producer: Q once, then K_j and V_j into stage j % 2 once the consumers
// have released that stage (its previous use, tile j - 2).
template <int D>
__device__ void produce(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, uint32_t qs,
                        uint32_t ks, uint32_t vs, uint32_t bars, const Work& w, int hq, int hkv) {
    using C = FwdCfg<D>;
    const uint32_t full_q = bars, full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56;
    const int kh = w.h / (hq / hkv);
    bar_expect_tx(full_q, C::QBYTES);
    tma_tile<D>(qs, tq, C::BR, w.qblk * C::BR, w.b * hq + w.h, full_q);
    for (int j = 0; j < w.ntiles; ++j) {
        const int s = j & 1, kv0 = w.kv_begin + j * C::BC;
        if (j >= 2) bar_wait(empty_k + 8 * s, ((j >> 1) - 1) & 1);
        bar_expect_tx(full_k + 8 * s, C::KVBYTES);
        tma_tile<D>(ks + s * C::KVBYTES, tk, C::BC, kv0, w.b * hkv + kh, full_k + 8 * s);
        if (j >= 2) bar_wait(empty_v + 8 * s, ((j >> 1) - 1) & 1);
        bar_expect_tx(full_v + 8 * s, C::KVBYTES);
        tma_tile<D>(vs + s * C::KVBYTES, tv, C::BC, kv0, w.b * hkv + kh, full_v + 8 * s);
    }
}

// One consumer warpgroup (`wg` 0 or 1: rows 64 * wg.. of the block).
template <typename T, int D, bool SOFTCAP>
__device__ void consume(T* __restrict__ o, float* __restrict__ lse, uint32_t qs, uint32_t ks, uint32_t vs,
                        uint32_t bars, const Work& w, int wg, int hq, int nq, int nk, float scale, int lo,
                        int hi, float cap) {
    using C = FwdCfg<D>;
    constexpr int BR = C::BR, BC = C::BC, NS = BC / 2, NO = D / 2;
    const uint32_t full_q = bars, full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = w.qblk * BR;
    float oacc[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) oacc[i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const float sl2 = scale * LOG2E;
    const bool prescale = SOFTCAP || !(sl2 > 0.f);
    const float fold = prescale ? 1.f : sl2;
    const float cap_in = SOFTCAP ? scale / cap : 0.f, cap_out = SOFTCAP ? cap * LOG2E : 0.f;
    // This warpgroup's rows wr0..wr1; this thread's rows r0 and r0 + 8.
    const int wr0 = q0 + 64 * wg, wr1 = wr0 + 63;
    const int r0 = wr0 + 16 * warp + g;
    uint32_t pa[BC / 16][4];

    auto issue_s = [&](float (&s)[NS], int j) {
        const uint32_t kt = ks + (j & 1) * C::KVBYTES;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const uint64_t da = desc128(qs + (kk >> 2) * BR * 128 + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
            const uint64_t db = desc128(kt + (kk >> 2) * BC * 128 + (kk & 3) * 32, 16, 1024);
            mma_ss<T, BC>(s, da, db, kk > 0);
        }
    };
    // V's descriptor: 8-key groups 1024 B apart (SBO), 64-dim column blocks
    // BC * 128 B apart (LBO).
    auto issue_pv = [&](int j) {
        const uint32_t vt = vs + (j & 1) * C::KVBYTES;
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) mma_rs<T, D>(oacc, pa[kk], desc128(vt + kk * 16 * 128, BC * 128, 1024));
    };
    // One elected lane per warp releases a stage (the barriers count 8 arrivals).
    auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0) bar_arrive(bar);
    };
    // Scores of tile j -> probabilities (in s), running max and sum; corr rescales O.
    auto softmax = [&](float (&s)[NS], int j, float (&corr)[2]) {
        const int kv0 = w.kv_begin + j * BC;
        if (SOFTCAP) {
#pragma unroll
            for (int i = 0; i < NS; ++i) s[i] = cap_out * tanh_acc(s[i] * cap_in);
        } else if (prescale) {
#pragma unroll
            for (int i = 0; i < NS; ++i) s[i] *= sl2;
        }
        // Mask keys past the end and outside the band (only on tiles that cut them).
        if (kv0 + BC > nk || kv0 + BC - 1 > wr0 + hi || kv0 < wr1 + lo) {
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int col = kv0 + (i >> 2) * 8 + 2 * t + (i & 1);
                const int row = r0 + ((i & 2) ? 8 : 0);
                if (!(col < nk && col - row <= hi && col - row >= lo)) s[i] = NEG_INF;
            }
        }
        // A quad of 4 threads shares each row.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int n8 = 0; n8 < BC / 8; ++n8) mx = fmaxf(mx, fmaxf(s[4 * n8 + 2 * r], s[4 * n8 + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float ms = (mx == NEG_INF ? 0.f : mx) * fold;
            corr[r] = mx == m[r] ? 1.f : exp2f(fmaf(m[r], fold, -ms));
            float sum = 0.f;
#pragma unroll
            for (int n8 = 0; n8 < BC / 8; ++n8) {
                const float p0 = exp2f(fmaf(s[4 * n8 + 2 * r], fold, -ms));
                const float p1 = exp2f(fmaf(s[4 * n8 + 2 * r + 1], fold, -ms));
                s[4 * n8 + 2 * r] = p0;
                s[4 * n8 + 2 * r + 1] = p1;
                sum += p0 + p1;
            }
            l[r] = l[r] * corr[r] + sum;
            m[r] = mx;
        }
    };
    auto pack_p = [&](const float (&s)[NS]) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    const int n = w.ntiles;
    if (n > 0) {
        bar_wait(full_q, 0);
        float corr[2];
        {
            bar_wait(full_k, 0);
            float s[NS];
            wg_fence();
            issue_s(s, 0);
            wg_commit();
            wg_wait0();
            reg_fence(s);
            release(empty_k);
            softmax(s, 0, corr);  // O is still 0: corr unused
            pack_p(s);
        }
        for (int j = 1; j < n; ++j) {
            bar_wait(full_k + 8 * (j & 1), (j >> 1) & 1);
            bar_wait(full_v + 8 * ((j - 1) & 1), ((j - 1) >> 1) & 1);
            float s[NS];
            wg_fence();
            issue_s(s, j);
            wg_commit();
            issue_pv(j - 1);
            wg_commit();
            wg_wait1();  // S_j is done; P_{j-1} V_{j-1} may still run
            reg_fence(s);
            release(empty_k + 8 * (j & 1));
            softmax(s, j, corr);
            wg_wait0();
            reg_fence(oacc);
            release(empty_v + 8 * ((j - 1) & 1));
#pragma unroll
            for (int i = 0; i < NO; ++i) oacc[i] *= corr[(i >> 1) & 1];
            pack_p(s);
        }
        bar_wait(full_v + 8 * ((n - 1) & 1), ((n - 1) >> 1) & 1);
        wg_fence();
        issue_pv(n - 1);
        wg_commit();
        wg_wait0();
        reg_fence(oacc);
    }

    T* ob = o + ((size_t)w.b * hq + w.h) * (size_t)nq * D;
    float* lb = lse + ((size_t)w.b * hq + w.h) * nq;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const int row = r0 + 8 * r;
        if (row < nq) {
#pragma unroll
            for (int n8 = 0; n8 < D / 8; ++n8)
                *reinterpret_cast<uint32_t*>(ob + (size_t)row * D + n8 * 8 + 2 * t) =
                    pack2<T>(oacc[4 * n8 + 2 * r] * inv, oacc[4 * n8 + 2 * r + 1] * inv);
            if (t == 0) lb[row] = lt > 0.f ? (m[r] * fold + log2f(lt)) * 0.6931471805599453f : NEG_INF;
        }
    }
}

template <typename T, int D, bool SOFTCAP>
__device__ void fwd(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, T* __restrict__ o,
                    float* __restrict__ lse, int hq, int hkv, int nq, int nk, float scale, int lo, int hi,
                    float cap) {
    using C = FwdCfg<D>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)C::SMEM) __trap();  // launcher bug
    const uint32_t qs = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t ks = qs + C::QBYTES, vs = ks + 2 * C::KVBYTES, bars = qs + C::BAR_OFF;
    const int wg = threadIdx.x >> 7;
    const Work w = block_work<D>(nq, nk, lo, hi);
    if (threadIdx.x == 0) {
        // full_q; full_k[2], full_v[2] (the producer's expect_tx arrival plus the
        // copies' bytes); empty_k[2], empty_v[2] (one arrival per consumer warp).
        bar_init(bars, 1);
        for (int i = 1; i < 5; ++i) bar_init(bars + 8 * i, 1);
        for (int i = 5; i < 9; ++i) bar_init(bars + 8 * i, 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) produce<D>(tq, tk, tv, qs, ks, vs, bars, w, hq, hkv);
    } else {
        setmaxnreg_inc<240>();
        consume<T, D, SOFTCAP>(o, lse, qs, ks, vs, bars, w, wg - 1, hq, nq, nk, scale, lo, hi, cap);
    }
}

}  // namespace hopper

// Entries: cqsa_fwd_hopper_{,cap_}{f16,bf16}_d{64,128,256}, launched with
// hopper::FwdCfg<D>::THREADS threads, SMEM bytes and ceil(nq / BR) blocks in x.
// The tensor maps: 3-D (D, n, b * heads) over q, k, v, 128-byte swizzle, boxes
// of (64, BR or BC, 1), zero fill.
#define HOPPER_ENTRY(T, SUF, D, CAPNAME, CAP)                                                            \
    extern "C" __global__ void __launch_bounds__(384, 1) cqsa_fwd_hopper_##CAPNAME##SUF##_d##D(          \
        const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                 \
        const __grid_constant__ CUtensorMap tv, T* o, float* lse, int hq, int hkv, int nq, int nk,      \
        float scale, int lo, int hi, float cap) {                                                       \
        hopper::fwd<T, D, CAP>(&tq, &tk, &tv, o, lse, hq, hkv, nq, nk, scale, lo, hi, cap);             \
    }
#define HOPPER_ENTRIES(T, SUF, D) HOPPER_ENTRY(T, SUF, D, , false) HOPPER_ENTRY(T, SUF, D, cap_, true)
HOPPER_ENTRIES(__half, f16, 64)
HOPPER_ENTRIES(__half, f16, 128)
HOPPER_ENTRIES(__half, f16, 256)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 64)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 128)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 256)
