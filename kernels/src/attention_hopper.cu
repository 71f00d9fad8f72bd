// Exact attention forward and backward for Hopper (sm_90a): warpgroup MMA (wgmma)
// fed by the tensor memory accelerator (TMA), warp-specialised. Compiled only for
// compute capability 9.0 (kernels/build.rs); the mma.sync kernels of attention.cu
// stay the portable path. The backward is described at its own section below.
//
// Forward: same results as attention.cu's cqsa_fwd_mma_* (band (lo, hi), soft-cap, lse,
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
    // Q, two stages each of K and V, then 10 mbarriers (8 bytes each) and the
    // persistent block's next item (4 bytes).
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

// desc128(addr + bytes, ...) from d = desc128(addr, ...) in one add: the address
// field holds (addr & 0x3FFFF) >> 4, and shared-memory addresses plus the offsets
// used here stay below 0x40000, so the add never carries out of it.
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }

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
__device__ __forceinline__ void st_shared_u32(uint32_t addr, int x) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}
__device__ __forceinline__ int ld_shared_u32(uint32_t addr) {
    int x;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(x) : "r"(addr) : "memory");
    return x;
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
// Rows and keys are the Seg's (q_off and k_off added where they are read).
struct Work {
    int qblk, h, b, kv_begin, ntiles, q_off, k_off;
};
template <int D>
__device__ __forceinline__ Work block_work(const Seg* segs, int nq_all, int nk_all, int lo_all, int hi_all,
                                           const VBlock& vb, Seg* sg) {
    using C = FwdCfg<D>;
    Work w{vb.x, 0, 0, 0, 0, 0, 0};
    *sg = block_seg(segs, nq_all, nk_all, lo_all, hi_all, true, vb, &w.h, &w.b);
    const int nk = sg->nk, lo = sg->lo, hi = sg->hi;
    if (sg->blk >= 0) {
        w.qblk = sg->blk;
    } else if (sg->causal_like()) {
        // Causal-like: heaviest query blocks first across every (batch, head).
        const int heads = vb.gy * vb.gz;
        const long long lin = vb.lin();
        w.qblk = vb.gx - 1 - (int)(lin / heads);
        w.h = (int)(lin % heads % vb.gy);
        w.b = (int)(lin % heads / vb.gy);
    }
    w.q_off = sg->q_off;
    w.k_off = sg->k_off;
    const int q0 = w.qblk * C::BR;
    w.kv_begin = clampi((long long)q0 + lo, nk) / C::BC * C::BC;
    const int kv_end = clampi((long long)(q0 + C::BR - 1) + hi + 1, nk);
    w.ntiles = kv_end > w.kv_begin ? (kv_end - w.kv_begin + C::BC - 1) / C::BC : 0;
    return w;
}

// Where a persistent block's pipelines stand before an item: the K/V tiles of
// its earlier items, and their number (each one phase of full_q and empty_q).
// K/V tile J of the block (counting across items) goes to stage J % 2 and is
// that stage's use J / 2.
struct Ring {
    int kv, q;
};

// The producer of one item, once the consumers have released the previous
// item's Q tile: Q (the consumers' full_q phase), then K_j and V_j into their
// stage once the consumers have released its previous use (two tiles earlier).
template <int D>
__device__ void produce(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, uint32_t qs,
                        uint32_t ks, uint32_t vs, uint32_t bars, const Work& w, int hq, int hkv, Ring& r) {
    using C = FwdCfg<D>;
    const uint32_t full_q = bars, full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56;
    const int kh = w.h / (hq / hkv);
    r.q += 1;
    // An item with no key tile writes zeros: its phase of full_q carries no Q.
    if (w.ntiles == 0) {
        bar_arrive(full_q);
        return;
    }
    bar_expect_tx(full_q, C::QBYTES);
    tma_tile<D>(qs, tq, C::BR, w.q_off + w.qblk * C::BR, w.b * hq + w.h, full_q);
    for (int j = 0; j < w.ntiles; ++j) {
        const int J = r.kv + j, s = J & 1, kv0 = w.k_off + w.kv_begin + j * C::BC;
        if (J >= 2) bar_wait(empty_k + 8 * s, ((J >> 1) - 1) & 1);
        bar_expect_tx(full_k + 8 * s, C::KVBYTES);
        tma_tile<D>(ks + s * C::KVBYTES, tk, C::BC, kv0, w.b * hkv + kh, full_k + 8 * s);
        if (J >= 2) bar_wait(empty_v + 8 * s, ((J >> 1) - 1) & 1);
        bar_expect_tx(full_v + 8 * s, C::KVBYTES);
        tma_tile<D>(vs + s * C::KVBYTES, tv, C::BC, kv0, w.b * hkv + kh, full_v + 8 * s);
    }
    r.kv += w.ntiles;
}

// One consumer warpgroup (`wg` 0 or 1: rows 64 * wg.. of the item's block).
template <typename T, int D, bool SOFTCAP>
__device__ void consume(T* __restrict__ o, float* __restrict__ lse, uint32_t qs, uint32_t ks, uint32_t vs,
                        uint32_t bars, const Work& w, int wg, int hq, int nq_all, const Seg& sg, float scale,
                        float cap, Ring& ring) {
    const int nq = sg.nq, nk = sg.nk, lo = sg.lo, hi = sg.hi;
    using C = FwdCfg<D>;
    constexpr int BR = C::BR, BC = C::BC, NS = BC / 2, NO = D / 2;
    const uint32_t full_k = bars + 8, full_v = bars + 24, empty_k = bars + 40, empty_v = bars + 56,
                   empty_q = bars + 72;
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
    // Tile j's stage and the parity of its use of the stage (ring order).
    auto stage = [&](int j) { return (ring.kv + j) & 1; };
    auto use = [&](int j) { return ((ring.kv + j) >> 1) & 1; };

    const uint64_t qd = desc128(qs + wg * 64 * 128, 16, 1024);
    auto issue_s = [&](float (&s)[NS], int j) {
        const uint64_t kd = desc128(ks + stage(j) * C::KVBYTES, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            mma_ss<T, BC>(s, desc_at(qd, (kk >> 2) * BR * 128 + (kk & 3) * 32),
                          desc_at(kd, (kk >> 2) * BC * 128 + (kk & 3) * 32), kk > 0);
    };
    // V's descriptor: 8-key groups 1024 B apart (SBO), 64-dim column blocks
    // BC * 128 B apart (LBO).
    auto issue_pv = [&](int j) {
        const uint64_t vd = desc128(vs + stage(j) * C::KVBYTES, BC * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) mma_rs<T, D>(oacc, pa[kk], desc_at(vd, kk * 16 * 128));
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
    // (The caller waited for this item's full_q phase.) Q is released after the
    // item's last S product, so that the producer loads the next item's while
    // this one finishes.
    const int n = w.ntiles;
    if (n == 0) release(empty_q);
    if (n > 0) {
        float corr[2];
        {
            bar_wait(full_k + 8 * stage(0), use(0));
            float s[NS];
            wg_fence();
            issue_s(s, 0);
            wg_commit();
            wg_wait0();
            reg_fence(s);
            release(empty_k + 8 * stage(0));
            if (n == 1) release(empty_q);
            softmax(s, 0, corr);  // O is still 0: corr unused
            pack_p(s);
        }
        for (int j = 1; j < n; ++j) {
            bar_wait(full_k + 8 * stage(j), use(j));
            bar_wait(full_v + 8 * stage(j - 1), use(j - 1));
            float s[NS];
            wg_fence();
            issue_s(s, j);
            wg_commit();
            issue_pv(j - 1);
            wg_commit();
            wg_wait1();  // S_j is done; P_{j-1} V_{j-1} may still run
            reg_fence(s);
            release(empty_k + 8 * stage(j));
            if (j == n - 1) release(empty_q);
            softmax(s, j, corr);
            wg_wait0();
            reg_fence(oacc);
            release(empty_v + 8 * stage(j - 1));
#pragma unroll
            for (int i = 0; i < NO; ++i) oacc[i] *= corr[(i >> 1) & 1];
            pack_p(s);
        }
        bar_wait(full_v + 8 * stage(n - 1), use(n - 1));
        wg_fence();
        issue_pv(n - 1);
        wg_commit();
        wg_wait0();
        reg_fence(oacc);
        release(empty_v + 8 * stage(n - 1));
        ring.kv += n;
    }
    ring.q += 1;

    // Rows of the Seg (q_off of them before it in the sequence of nq_all).
    T* ob = o + (((size_t)w.b * hq + w.h) * (size_t)nq_all + w.q_off) * D;
    float* lb = lse + ((size_t)w.b * hq + w.h) * nq_all + w.q_off;
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

// A persistent block: it works through items of the (gx, hq, nb) grid a block
// per item would need, taken in that grid's launch order (block_work puts a
// causal call's heaviest first): item blockIdx.x first, then the next not yet
// taken (gridDim.x + the count in `next`, zeroed by the launcher), so that
// blocks finishing early take more. The producer takes the item, passes it in
// shared memory with the item's full_q phase, and loads its Q and first K/V
// tiles while the consumers finish the previous one; an item past the end
// tells the consumers to stop.
template <typename T, int D, bool SOFTCAP>
__device__ void fwd(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, T* __restrict__ o,
                    float* __restrict__ lse, int hq, int hkv, int nq, int nk, float scale, int lo, int hi,
                    float cap, const Seg* segs, int gx, int nb, int* next) {
    using C = FwdCfg<D>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)C::SMEM) __trap();  // launcher bug
    const uint32_t qs = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t ks = qs + C::QBYTES, vs = ks + 2 * C::KVBYTES, bars = qs + C::BAR_OFF;
    const uint32_t full_q = bars, empty_q = bars + 72, slot = bars + 80;
    const int wg = threadIdx.x >> 7;
    if (threadIdx.x == 0) {
        // full_q; full_k[2], full_v[2] (the producer's arrival, with expect_tx
        // for the copies' bytes); empty_k[2], empty_v[2], empty_q (one arrival
        // per consumer warp).
        bar_init(bars, 1);
        for (int i = 1; i < 5; ++i) bar_init(bars + 8 * i, 1);
        for (int i = 5; i < 10; ++i) bar_init(bars + 8 * i, 8);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int items = gx * hq * nb;  // the launcher checks that it fits an int
    Ring ring{0, 0};
    if (wg == 0) {
        setmaxnreg_dec<40>();  // the item loop: 32 spill
        if (threadIdx.x != 0) return;
        for (int v = blockIdx.x;; v = gridDim.x + atomicAdd(next, 1)) {
            if (ring.q > 0) bar_wait(empty_q, (ring.q - 1) & 1);
            st_shared_u32(slot, v);
            if (v >= items) {
                bar_arrive(full_q);
                return;
            }
            Seg sg;
            const Work w = block_work<D>(segs, nq, nk, lo, hi, item_block(v, gx, hq, nb), &sg);
            produce<D>(tq, tk, tv, qs, ks, vs, bars, w, hq, hkv, ring);
        }
    } else {
        setmaxnreg_inc<232>();  // 128 x 40 + 256 x 232 <= 64K
        for (;;) {
            bar_wait(full_q, ring.q & 1);
            const int v = ld_shared_u32(slot);
            if (v >= items) return;
            Seg sg;
            const Work w = block_work<D>(segs, nq, nk, lo, hi, item_block(v, gx, hq, nb), &sg);
            consume<T, D, SOFTCAP>(o, lse, qs, ks, vs, bars, w, wg - 1, hq, nq, sg, scale, cap, ring);
        }
    }
}


// ---------------------------------------------------------------- backward
// One kernel for dK, dV and dQ (five GEMMs): per block of BR = 128 keys (64 per
// consumer warpgroup), over every query head of the GQA group and the query
// tiles of BS = 64 that see the keys:
//   S^T = K Q^T, dP^T = V dO^T      (both K-major from shared memory)
//   P, dS from S, dP and the row statistics
//   dV += P^T dO, dK += dS^T Q       (P^T, dS^T from registers)
//   dQ_tile = dS K                   (dS^T through shared memory, both MN-major)
// dQ_tile is summed into an f32 accumulator in global memory by a bulk
// reduce-add (cp.reduce.async.bulk, done in L2), which a last kernel converts.
// A writer warp in the producer warpgroup issues those reduce-adds, so that a
// consumer only stores its dQ block to shared memory (taking the reduce's
// waits off the consumers made the backward 5-7 % faster on an H200).
// At D = 128 each warpgroup computes 64 of dQ's columns; at D = 64 the
// warpgroups take turns computing the whole tile (both as m64n64).
// The row statistics (lse in log2 units, delta) come padded to tiles of 64 from
// cqsa_bwd_stats_hopper and reach shared memory with the tile (one bulk copy).
template <int D> struct BwdCfg {
    static constexpr int BR = 128, BS = 64, STAGES = 2, THREADS = 384;
    static constexpr int FBYTES = BR * D * 2, SBYTES = BS * D * 2;
    static constexpr int DS_BYTES = BR * BS * 2;   // dS^T [128 keys][64 queries], 128-byte swizzle
    static constexpr int DQ_BYTES = 64 * 64 * 4;   // a dQ block of a warpgroup, f32
    static constexpr int ST_BYTES = BS * 8;        // (lse, delta) of the tile's queries
    static constexpr int S_OFF = 2 * FBYTES;       // stages of (Q, dO)
    static constexpr int DS_OFF = S_OFF + STAGES * 2 * SBYTES;  // two dS buffers
    static constexpr int DQ_OFF = DS_OFF + 2 * DS_BYTES;        // two dQ blocks per warpgroup
    static constexpr int ST_OFF = DQ_OFF + 4 * DQ_BYTES;        // statistics per stage
    // 1 + 2 * STAGES + 8 mbarriers: full_fixed, full[STAGES], empty[STAGES], then
    // for the dQ blocks (two per warpgroup) dq_full[4] and dq_free[4].
    static constexpr int BAR_OFF = ST_OFF + STAGES * ST_BYTES;
    static constexpr int DQ_BARS = 1 + 2 * STAGES;
    static constexpr int SMEM = 1024 + BAR_OFF + 8 * (DQ_BARS + 8);
    static_assert(SMEM <= 232448, "the H100/H200 shared-memory limit per block");
};

// The two products every backward tile starts with, both over the head dim:
// x = A1 B1^T and y = A2 B2^T, where A1 and A2 are this warpgroup's 64 rows of the
// fixed tiles at a1, a2 (BR rows) and B1, B2 the streamed tiles at b1, b2 (BS rows).
template <typename T, int D>
__device__ __forceinline__ void mma_pair(float (&x)[BwdCfg<D>::BS / 2], float (&y)[BwdCfg<D>::BS / 2], uint32_t a1,
                                         uint32_t b1, uint32_t a2, uint32_t b2, int wg) {
    using C = BwdCfg<D>;
    const uint64_t xa = desc128(a1 + wg * 64 * 128, 16, 1024), xb = desc128(b1, 16, 1024);
    const uint64_t ya = desc128(a2 + wg * 64 * 128, 16, 1024), yb = desc128(b2, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t a_off = (kk >> 2) * C::BR * 128 + (kk & 3) * 32, b_off = (kk >> 2) * C::BS * 128 + (kk & 3) * 32;
        mma_ss<T, C::BS>(x, desc_at(xa, a_off), desc_at(xb, b_off), kk > 0);
        mma_ss<T, C::BS>(y, desc_at(ya, a_off), desc_at(yb, b_off), kk > 0);
    }
}

// p = exp(x - lse) and dS = p (dp - delta) (soft-cap derivative included) for one
// accumulator element whose (query, key) pair is visible when `ok`; L = lse in
// log2 units (+inf for a row past nq or one that sees no key).
template <bool SOFTCAP>
__device__ __forceinline__ float2 p_ds(float s, float dp, bool ok, float L, float dl, float sl2, float cap_in,
                                       float cap_out) {
    float x, dsx = 1.f;
    if (SOFTCAP) {
        const float th = tanh_acc(s * cap_in);
        dsx = 1.f - th * th;
        x = cap_out * th;
    } else {
        x = s * sl2;
    }
    const float p = ok ? exp2f(x - L) : 0.f;
    return make_float2(p, p * (dp - dl) * dsx);
}

// lse in log2 units as p_ds takes it.
__device__ __forceinline__ float lse_l2(float lse, bool in) {
    return (lse == NEG_INF || !in) ? POS_INF : lse * LOG2E;
}

// The key block, kv head and batch of a dK/dV block, and its query tiles: every
// query head of the group times the tiles [tile0, tile0 + ntq) of its Seg that
// see the keys.
struct KvWork {
    int kblk, kh, b, tile0, ntq, grp;
};
#ifndef HEAVY_HEADS
#define HEAVY_HEADS 16
#endif
template <int D> __device__ __forceinline__ KvWork kv_work(const Seg& sg, int kh, int b, int hq, int hkv) {
    using C = BwdCfg<D>;
    const int nq = sg.nq, nk = sg.nk, lo = sg.lo, hi = sg.hi;
    KvWork w{sg.blk >= 0 ? sg.blk : (int)blockIdx.x, kh, b, 0, 0, hq / hkv};
    if (sg.blk < 0 && sg.causal_like()) {
        // Causal-like: the first key blocks see the most queries. Heaviest first
        // across groups of HEAVY_HEADS (batch, kv head) slices, so that the
        // heaviest blocks of the last heads do not run alone at the end (causal
        // 4096 backward 15 % faster on an H200), while the blocks running at
        // once still share a few heads' dQ accumulators and queries in L2
        // (heaviest first across every head thrashed it: 8 x 2048 causal took
        // 1.27 ms against 0.93).
        const VBlock vb = hw_block();
        const int heads = vb.gy * vb.gz;
        const long long lin = vb.lin(), per_group = (long long)HEAVY_HEADS * vb.gx;
        const int grp = (int)(lin / per_group), g = min(HEAVY_HEADS, heads - grp * HEAVY_HEADS);
        const int r = (int)(lin - grp * per_group), slice = grp * HEAVY_HEADS + r % g;
        w.kblk = r / g;
        w.kh = slice % vb.gy;
        w.b = slice / vb.gy;
    }
    const int k0 = w.kblk * C::BR, k1 = min(k0 + C::BR, nk) - 1;
    const int i0 = clampi((long long)k0 - hi, nq), i1 = clampi((long long)k1 - lo + 1, nq);
    w.tile0 = i0 / C::BS;
    w.ntq = i1 > i0 ? (i1 + C::BS - 1) / C::BS - w.tile0 : 0;
    return w;
}

__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Plain bulk copy global -> shared completing on `bar` (bytes: a multiple of 16).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// dst[i] += src[i] (f32) in global memory, asynchronously; then commit the group.
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
        "cp.async.bulk.commit_group;\n" ::"l"(dst),
        "r"(src), "r"(bytes)
        : "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

template <typename T>
__device__ __forceinline__ void mma_tt64(float (&d)[32], uint64_t da, uint64_t db, int acc) {
    if constexpr (std::is_same<T, __half>::value) wgmma_tt_n64_f16(d, da, db, acc);
    else wgmma_tt_n64_bf16(d, da, db, acc);
}

// The producer: K and V once, then (Q, dO, statistics) of tile t into stage
// t % STAGES once the consumers released its previous use.
template <int D>
__device__ void produce_bwd(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                            const CUtensorMap* tg, const float2* stats, const KvWork& w, const Seg& sg, int hq,
                            int hkv, int nqp, uint32_t base) {
    using C = BwdCfg<D>;
    const uint32_t bars = base + C::BAR_OFF;
    bar_expect_tx(bars, 2 * C::FBYTES);
    const int krow = sg.k_off + w.kblk * C::BR;
    tma_tile<D>(base, tk, C::BR, krow, w.b * hkv + w.kh, bars);
    tma_tile<D>(base + C::FBYTES, tv, C::BR, krow, w.b * hkv + w.kh, bars);
    const int n = w.grp * w.ntq;
    for (int t = 0; t < n; ++t) {
        const int s = t % C::STAGES;
        const uint32_t full = bars + 8 * (1 + s), empty = bars + 8 * (1 + C::STAGES + s);
        if (t >= C::STAGES) bar_wait(empty, ((t / C::STAGES) - 1) & 1);
        // Tile (w.tile0 + t % ntq) of the Seg: rows q_off + row0.. of the sequence,
        // statistics at the Seg's own tiles (sg.tile0 on).
        const int row0 = (w.tile0 + t % w.ntq) * C::BS, slice = w.b * hq + w.kh * w.grp + t / w.ntq;
        bar_expect_tx(full, 2 * C::SBYTES + C::ST_BYTES);
        const uint32_t dst = base + C::S_OFF + s * 2 * C::SBYTES;
        tma_tile<D>(dst, tq, C::BS, sg.q_off + row0, slice, full);
        tma_tile<D>(dst + C::SBYTES, tg, C::BS, sg.q_off + row0, slice, full);
        bulk_load(base + C::ST_OFF + s * C::ST_BYTES, stats + (size_t)slice * nqp + sg.tile0 * C::BS + row0,
                  C::ST_BYTES, full);
    }
}

// P and dS of one tile from S^T and dP^T (this warpgroup's 64 keys x 64 queries):
// P^T and dS^T as A fragments (pa, da), and dS^T into shared memory at `dst`.
// EDGE: the tile has pairs outside the band or the sequences, checked per element
// (instantiated apart so that the inner tiles carry no per-element checks).
template <typename T, bool SOFTCAP, bool EDGE>
__device__ __forceinline__ void bwd_grads(const float (&st)[32], const float (&dpt)[32], uint32_t (&pa)[4][4],
                                          uint32_t (&da)[4][4], uint32_t stt, uint32_t dst, int krow0, int kr0, int q0,
                                          int nq, int nk, int lo, int hi, float sl2, float cap_in, float cap_out) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
        float4 s4;  // (L, delta) of columns 2t and 2t + 1 of this n8
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(s4.x), "=f"(s4.y), "=f"(s4.z), "=f"(s4.w)
                     : "r"(stt + (n8 * 8 + 2 * t) * 8));
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int i = 4 * n8 + 2 * rr, key = kr0 + 8 * rr, col = q0 + n8 * 8 + 2 * t;
            float2 v[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const bool ok =
                    !EDGE || (key < nk && col + c < nq && key - (col + c) <= hi && key - (col + c) >= lo);
                v[c] = p_ds<SOFTCAP>(st[i + c], dpt[i + c], ok, c ? s4.z : s4.x, c ? s4.w : s4.y, sl2, cap_in,
                                     cap_out);
            }
            const uint32_t p2 = pack2<T>(v[0].x, v[1].x), d2 = pack2<T>(v[0].y, v[1].y);
            pa[n8 >> 1][2 * (n8 & 1) + rr] = p2;
            da[n8 >> 1][2 * (n8 & 1) + rr] = d2;
            // dS^T row krow (a multiple of 8 plus g), 16-byte chunk n8 swizzled.
            const int krow = krow0 + 8 * rr;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dst + krow * 128 + ((n8 ^ (krow & 7)) << 4) + 4 * t),
                         "r"(d2)
                         : "memory");
        }
    }
}

// Named barriers between the consumer warpgroups (0 is __syncthreads):
// READY(w, b): warpgroup w's half of dS^T is in buffer b (w arrives, the other
// waits); FREE(u, b): warpgroup u's dQ product has read buffer b (u arrives, the
// other waits before writing b again); OWN(w): warpgroup w's own 128 threads.
__device__ __forceinline__ int bar_ready(int w, int b) { return 1 + 2 * w + b; }
__device__ __forceinline__ int bar_free(int u, int b) { return 5 + 2 * u + b; }
__device__ __forceinline__ int bar_own(int w) { return 9 + w; }
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Whether warpgroup u computes (columns of) dQ of tile j: both at D = 128 (64
// columns each), in turns at D = 64.
template <int D> __device__ __forceinline__ bool dq_mine(int u, int j) { return D == 128 || (j & 1) == u; }

// Issues dQ_tile block `cb` (64 columns) = dS K of tile j: dS^T [128 keys][64
// queries] in buffer j & 1 and K [128 keys][D], both MN-major for this product,
// once the other warpgroup's half of dS^T is there (its own half is: bar_own).
template <typename T, int D>
__device__ __forceinline__ void bwd_dq_issue(float (&dqa)[32], uint32_t base, int j, int wg) {
    using C = BwdCfg<D>;
    const uint32_t dst = base + C::DS_OFF + (j & 1) * C::DS_BYTES, kb = base + (D == 128 ? wg : 0) * C::BR * 128;
    named_sync(bar_ready(1 - wg, j & 1), 256);
    wg_fence();
    const uint64_t sa = desc128(dst, C::DS_BYTES, 1024), kd = desc128(kb, C::BR * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < C::BR / 16; ++kk) mma_tt64<T>(dqa, desc_at(sa, kk * 16 * 128), desc_at(kd, kk * 16 * 128), kk > 0);
    wg_commit();
}

// The dQ blocks: warpgroup w's store number m (its m-th dQ tile) goes through
// shared block 2 w + (m & 1); dq_full says the block is written (one arrival
// per consumer warp), dq_free that the writer warp's reduce has read it.
template <int D> __device__ __forceinline__ uint32_t dq_block(uint32_t base, int w, int m) {
    return base + BwdCfg<D>::DQ_OFF + (2 * w + (m & 1)) * BwdCfg<D>::DQ_BYTES;
}
template <int D> __device__ __forceinline__ uint32_t dq_full(uint32_t base, int w, int m) {
    return base + BwdCfg<D>::BAR_OFF + 8 * (BwdCfg<D>::DQ_BARS + 2 * w + (m & 1));
}
template <int D> __device__ __forceinline__ uint32_t dq_free(uint32_t base, int w, int m) {
    return dq_full<D>(base, w, m) + 8 * 4;
}
// Store number m of a warpgroup for tile j: every tile at D = 128, every other
// tile at D = 64.
template <int D> __device__ __forceinline__ int dq_store_no(int j) { return D == 128 ? j : j >> 1; }

// After dQ of tile j completed: tells the other warpgroup that dS^T buffer
// j & 1 is read (when it will write it again, tile j + 2), then, once the
// writer warp has read this dQ block's previous contents, writes the block
// (layout: [chunk of 4][thread][4]). bwd_dq_hand gives it to the writer warp,
// which sums it into the f32 accumulator: the consumers never wait for L2.
template <int D>
__device__ __forceinline__ void bwd_dq_write(const float (&dqa)[32], uint32_t base, int j, int n, int wg) {
    const int tid = threadIdx.x & 127, m = dq_store_no<D>(j);
    const uint32_t dqs = dq_block<D>(base, wg, m);
    if (j + 2 < n) named_arrive(bar_free(wg, j & 1), 256);
    if (m >= 2) bar_wait(dq_free<D>(base, wg, m), ((m >> 1) - 1) & 1);
#pragma unroll
    for (int c4 = 0; c4 < 8; ++c4)
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(dqs + (c4 * 128 + tid) * 16),
                     "f"(dqa[4 * c4]), "f"(dqa[4 * c4 + 1]), "f"(dqa[4 * c4 + 2]), "f"(dqa[4 * c4 + 3])
                     : "memory");
}

// Hands dQ block of tile j (written by bwd_dq_write) to the writer warp. Issued
// after the next tile's S^T/dP^T products, so that the fence's wait for the
// stores overlaps them.
template <int D> __device__ __forceinline__ void bwd_dq_hand(uint32_t base, int j, int wg) {
    fence_async_smem();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) bar_arrive(dq_full<D>(base, wg, dq_store_no<D>(j)));
}

// The f32 dQ accumulator's slice of query tile `qtile` (from w.tile0) of head
// `h` of the group: nqt tiles per head, the Seg's from sg.tile0.
template <int D>
__device__ __forceinline__ float* dq_tile(float* dqacc, const KvWork& w, const Seg& sg, int hq, int nqt, int h,
                                          int qtile) {
    return dqacc + (((size_t)w.b * hq + w.kh * w.grp + h) * nqt + sg.tile0 + w.tile0 + qtile) * BwdCfg<D>::BS * D;
}

// The writer warp (warp 1 of the producer warpgroup): in tile order, each
// consumer warpgroup's dQ block summed into the accumulator (a bulk
// reduce-add in L2), then released to its warpgroup once read.
template <int D>
__device__ void write_dq(uint32_t base, float* dqacc, const KvWork& w, const Seg& sg, int hq, int nqt) {
    using C = BwdCfg<D>;
    const int n = w.grp * w.ntq, lane = threadIdx.x & 31;
    int jq = 0, jh = 0;
    for (int j = 0; j < n; ++j) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (!dq_mine<D>(u, j)) continue;
            const int m = dq_store_no<D>(j);
            bar_wait(dq_full<D>(base, u, m), (m >> 1) & 1);
            float* dst = dq_tile<D>(dqacc, w, sg, hq, nqt, jh, jq) + (D == 128 ? u : 0) * 64 * 64;
            if (lane == 0) {
                bulk_reduce_add(dst, dq_block<D>(base, u, m), C::DQ_BYTES);
                bulk_wait_read();
                bar_arrive(dq_free<D>(base, u, m));
            }
            __syncwarp();
        }
        if (++jq == w.ntq) jq = 0, ++jh;
    }
    if (lane == 0) bulk_wait_all();
}

// One consumer warpgroup, per tile j: first dQ of tile j - 1 and its store
// (deferred by a tile, so that the other warpgroup has had a whole tile to write
// its half of dS^T and the two never wait for each other in lockstep), then S^T
// and dP^T of tile j (the dQ block handed over while they run), the element-wise
// work, and dV/dK of tile j.
template <typename T, int D, bool SOFTCAP>
__device__ void bwd_consume(uint32_t base, T* __restrict__ dk, T* __restrict__ dv, const KvWork& w, const Seg& sg,
                            int wg, int hkv, int nk_all, float scale, float cap) {
    using C = BwdCfg<D>;
    const int nq = sg.nq, nk = sg.nk, lo = sg.lo, hi = sg.hi;
    constexpr int BS = C::BS, NS = BS / 2, NO = D / 2;
    const uint32_t ks = base, vs = base + C::FBYTES, bars = base + C::BAR_OFF;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2;
    const int krow0 = 64 * wg + 16 * warp + g, k0 = w.kblk * C::BR + 64 * wg, kr0 = w.kblk * C::BR + krow0;
    const float sl2 = scale * LOG2E, cap_in = SOFTCAP ? scale / cap : 0.f, cap_out = SOFTCAP ? cap * LOG2E : 0.f;
    int jq = 0;  // tile j's query tile; tile j is (j % ntq, j / ntq), counted along
    float dka[NO], dva[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) dka[i] = dva[i] = 0.f;
    const int n = w.grp * w.ntq;
    bar_wait(bars, 0);
    for (int j = 0; j < n; ++j) {
        const int s = j % C::STAGES, q0 = (w.tile0 + jq) * BS;
        const uint32_t qt = base + C::S_OFF + s * 2 * C::SBYTES, gt = qt + C::SBYTES;
        if (j > 0 && dq_mine<D>(wg, j - 1)) {
            float dqa[32];
            bwd_dq_issue<T, D>(dqa, base, j - 1, wg);
            wg_wait0();
            reg_fence(dqa);
            bwd_dq_write<D>(dqa, base, j - 1, n, wg);
        }
        bar_wait(bars + 8 * (1 + s), (j / C::STAGES) & 1);
        float st[NS], dpt[NS];
        wg_fence();
        mma_pair<T, D>(st, dpt, ks, qt, vs, gt, wg);
        wg_commit();
        if (j > 0 && dq_mine<D>(wg, j - 1)) bwd_dq_hand<D>(base, j - 1, wg);
        wg_wait0();
        reg_fence(st);
        reg_fence(dpt);
        // The other warpgroup's dQ of tile j - 2 has read the buffer.
        if (j >= 2 && dq_mine<D>(1 - wg, j - 2)) named_sync(bar_free(1 - wg, j & 1), 256);
        const bool edge = k0 + 63 >= nk || q0 + BS > nq || k0 + 63 - q0 > hi || k0 - (q0 + BS - 1) < lo;
        uint32_t pa[BS / 16][4], da[BS / 16][4];
        const uint32_t stt = base + C::ST_OFF + s * C::ST_BYTES, dst = base + C::DS_OFF + (j & 1) * C::DS_BYTES;
        if (edge)
            bwd_grads<T, SOFTCAP, true>(st, dpt, pa, da, stt, dst, krow0, kr0, q0, nq, nk, lo, hi, sl2, cap_in, cap_out);
        else
            bwd_grads<T, SOFTCAP, false>(st, dpt, pa, da, stt, dst, krow0, kr0, q0, nq, nk, lo, hi, sl2, cap_in, cap_out);
        fence_async_smem();
        if (dq_mine<D>(1 - wg, j)) named_arrive(bar_ready(wg, j & 1), 256);
        named_sync(bar_own(wg), 128);
        const uint64_t gd = desc128(gt, BS * 128, 1024), qd = desc128(qt, BS * 128, 1024);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BS / 16; ++kk) {
            mma_rs<T, D>(dva, pa[kk], desc_at(gd, kk * 16 * 128));
            mma_rs<T, D>(dka, da[kk], desc_at(qd, kk * 16 * 128));
        }
        wg_commit();
        wg_wait0();
        reg_fence(dka);
        reg_fence(dva);
        __syncwarp();
        if (lane == 0) bar_arrive(bars + 8 * (1 + C::STAGES + s));
        if (++jq == w.ntq) jq = 0;
    }
    if (n > 0 && dq_mine<D>(wg, n - 1)) {
        float dqa[32];
        bwd_dq_issue<T, D>(dqa, base, n - 1, wg);
        wg_wait0();
        reg_fence(dqa);
        bwd_dq_write<D>(dqa, base, n - 1, n, wg);
        bwd_dq_hand<D>(base, n - 1, wg);
    }
    const size_t kbase = ((size_t)w.b * hkv + w.kh) * nk_all + sg.k_off;
    const int t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kr0 + 8 * r;
        if (key < nk) {
#pragma unroll
            for (int n8 = 0; n8 < D / 8; ++n8) {
                const size_t at = (kbase + key) * D + n8 * 8 + 2 * t;
                *reinterpret_cast<uint32_t*>(dk + at) = pack2<T>(dka[4 * n8 + 2 * r] * scale, dka[4 * n8 + 2 * r + 1] * scale);
                *reinterpret_cast<uint32_t*>(dv + at) = pack2<T>(dva[4 * n8 + 2 * r], dva[4 * n8 + 2 * r + 1]);
            }
        }
    }
}

template <typename T, int D, bool SOFTCAP>
__device__ void bwd(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv, const CUtensorMap* tg,
                          const float2* stats, float* dqacc, T* dk, T* dv, int hq, int hkv, int nq, int nk,
                          float scale, int lo, int hi, float cap, const Seg* segs, int nqt) {
    using C = BwdCfg<D>;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    if (dynamic_smem_size() < (uint32_t)C::SMEM) __trap();  // launcher bug
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u, bars = base + C::BAR_OFF;
    if (threadIdx.x == 0) {
        bar_init(bars, 1);
        for (int s = 0; s < C::STAGES; ++s) {
            bar_init(bars + 8 * (1 + s), 1);
            bar_init(bars + 8 * (1 + C::STAGES + s), 8);  // one arrival per consumer warp
        }
        for (int i = 0; i < 4; ++i) {
            bar_init(bars + 8 * (C::DQ_BARS + i), 4);      // dq_full: the warpgroup's four warps
            bar_init(bars + 8 * (C::DQ_BARS + 4 + i), 1);  // dq_free: the writer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    int kh, b;
    const Seg sg = block_seg(segs, nq, nk, lo, hi, false, hw_block(), &kh, &b);
    const KvWork w = kv_work<D>(sg, kh, b, hq, hkv);
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) produce_bwd<D>(tq, tk, tv, tg, stats, w, sg, hq, hkv, nqt * C::BS, base);
        else if (threadIdx.x >> 5 == 1) write_dq<D>(base, dqacc, w, sg, hq, nqt);
    } else {
        setmaxnreg_inc<240>();
        bwd_consume<T, D, SOFTCAP>(base, dk, dv, w, sg, wg - 1, hkv, nk, scale, cap);
    }
}

// Tile `tile` of 64 queries of the statistics and the dq accumulator: its first
// row in the sequence and how many of its rows are real. A packed call's tiles
// (`tiles`, one int2 each) pad each document apart; a plain call's are the
// sequence cut every 64 rows.
__device__ __forceinline__ int2 tile_rows(const int2* tiles, int tile, int nq) {
    if (tiles != nullptr) return tiles[tile];
    return make_int2(tile * 64, min(64, nq - tile * 64));
}

// (lse in log2 units, delta) per query row, padded with (+inf, 0) to tiles of
// 64 (nqt per (batch, head) slice).
__device__ void bwd_stats(const float* lse, const float* delta, float2* stats, long long slices, int nq, int nqt,
                          const int2* tiles) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, nqp = 64ll * nqt;
    if (i >= slices * nqp) return;
    const long long bh = i / nqp;
    const int r = (int)(i % nqp), rl = r % 64;
    const int2 tr = tile_rows(tiles, r / 64, nq);
    const bool in = rl < tr.y;
    const long long at = bh * nq + (in ? tr.x + rl : 0);
    stats[i] = make_float2(lse_l2(lse[at], in), in ? delta[at] : 0.f);
}

// dq = acc * scale in the dtype, from the fused kernel's accumulator: tiles of
// 64 rows x d (nqt per slice), blocks of 64 columns, each [chunk][thread][4] in
// the wgmma accumulator order (thread = 32 warp + 4 g + t; element i of a thread
// is row 16 warp + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1)).
// One thread per pair of columns of a padded row; padding rows write nothing.
template <typename T>
__device__ void bwd_dq_convert(const float* acc, T* dq, long long slices, int nq, int nqt, int d, float scale,
                               const int2* tiles) {
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x, half = d / 2, nqp = 64ll * nqt;
    if (p >= slices * nqp * half) return;
    const long long prow = p / half, bh = prow / nqp;
    const int col = 2 * (int)(p % half), r = (int)(prow % nqp), tile = r / 64, rl = r % 64;
    const int2 tr = tile_rows(tiles, tile, nq);
    if (rl >= tr.y) return;
    const int cb = col / 64, cc = col % 64;
    const int tid = (rl / 16) * 32 + (rl % 8) * 4 + (cc % 8) / 2, i = 4 * (cc / 8) + 2 * ((rl % 16) / 8);
    const float2 a = *reinterpret_cast<const float2*>(
        acc + ((bh * nqt + tile) * 64 * d) + cb * 4096 + (i / 4) * 512 + tid * 4 + (i % 4));
    *reinterpret_cast<uint32_t*>(dq + (bh * nq + tr.x + rl) * d + col) = pack2<T>(a.x * scale, a.y * scale);
}

}  // namespace hopper

// Entries: cqsa_fwd_hopper_{,cap_}{f16,bf16}_d{64,128,256}, launched with
// hopper::FwdCfg<D>::THREADS threads, SMEM bytes and at most one block per SM
// in x (persistent), for the work of a (gx, hq, nb) grid: gx = ceil(nq / BR)
// blocks of queries, or for a packed call one per Seg of `segs` (null: a plain
// call), for each head and batch; `next` points to an int set to 0.
// The tensor maps: 3-D (D, n, b * heads) over q, k, v, 128-byte swizzle, boxes
// of (64, BR or BC, 1), zero fill.
#define HOPPER_ENTRY(T, SUF, D, CAPNAME, CAP)                                                            \
    extern "C" __global__ void __launch_bounds__(384, 1) cqsa_fwd_hopper_##CAPNAME##SUF##_d##D(          \
        const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                 \
        const __grid_constant__ CUtensorMap tv, T* o, float* lse, int hq, int hkv, int nq, int nk,      \
        float scale, int lo, int hi, float cap, const Seg* segs, int gx, int nb, int* next) {   \
        hopper::fwd<T, D, CAP>(&tq, &tk, &tv, o, lse, hq, hkv, nq, nk, scale, lo, hi, cap, segs, gx, nb, next); \
    }
#define HOPPER_ENTRIES(T, SUF, D) HOPPER_ENTRY(T, SUF, D, , false) HOPPER_ENTRY(T, SUF, D, cap_, true)
HOPPER_ENTRIES(__half, f16, 64)
HOPPER_ENTRIES(__half, f16, 128)
HOPPER_ENTRIES(__half, f16, 256)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 64)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 128)
HOPPER_ENTRIES(__nv_bfloat16, bf16, 256)

// Backward entries: cqsa_bwd_hopper_{,cap_}{f16,bf16}_d{64,128}, launched with
// hopper::BwdCfg<D>::THREADS threads and SMEM bytes, ceil(nk / BR) x hkv x b
// blocks (a packed call: one block in x per Seg of `segs`), after
// cqsa_bwd_delta_* and cqsa_bwd_stats_hopper, onto a zeroed f32 dq accumulator
// of nqt tiles of 64 x d per query head. Maps as the forward's: q and do with
// boxes of BS rows, k and v of BR rows.
#define HOPPER_BWD_ENTRY(T, SUF, D, CAPNAME, CAP)                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1) cqsa_bwd_hopper_##CAPNAME##SUF##_d##D(    \
        const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,                 \
        const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tg, const float2* stats, \
        float* dqacc, T* dk, T* dv, int hq, int hkv, int nq, int nk, float scale, int lo, int hi, float cap, \
        const Seg* segs, int nqt) {                                                             \
        hopper::bwd<T, D, CAP>(&tq, &tk, &tv, &tg, stats, dqacc, dk, dv, hq, hkv, nq, nk, scale, lo, hi, cap, \
                               segs, nqt);                                                              \
    }
#define HOPPER_BWD_ENTRIES(T, SUF, D) HOPPER_BWD_ENTRY(T, SUF, D, , false) HOPPER_BWD_ENTRY(T, SUF, D, cap_, true)
HOPPER_BWD_ENTRIES(__half, f16, 64)
HOPPER_BWD_ENTRIES(__half, f16, 128)
HOPPER_BWD_ENTRIES(__nv_bfloat16, bf16, 64)
HOPPER_BWD_ENTRIES(__nv_bfloat16, bf16, 128)

// Before and after the backward kernel: cqsa_bwd_stats_hopper (one thread per padded
// row, after cqsa_bwd_delta_*) and cqsa_bwd_dq_convert_hopper_{f16,bf16} (one
// thread per pair of columns of a padded row); `tiles`: a packed call's tiles
// (hopper::tile_rows), null for a plain call.
extern "C" __global__ void cqsa_bwd_stats_hopper(const float* lse, const float* delta, float2* stats,
                                                 long long slices, int nq, int nqt, const int2* tiles) {
    hopper::bwd_stats(lse, delta, stats, slices, nq, nqt, tiles);
}
extern "C" __global__ void cqsa_bwd_dq_convert_hopper_f16(const float* acc, __half* dq, long long slices, int nq,
                                                          int nqt, int d, float scale, const int2* tiles) {
    hopper::bwd_dq_convert<__half>(acc, dq, slices, nq, nqt, d, scale, tiles);
}
extern "C" __global__ void cqsa_bwd_dq_convert_hopper_bf16(const float* acc, __nv_bfloat16* dq, long long slices,
                                                           int nq, int nqt, int d, float scale, const int2* tiles) {
    hopper::bwd_dq_convert<__nv_bfloat16>(acc, dq, slices, nq, nqt, d, scale, tiles);
}
