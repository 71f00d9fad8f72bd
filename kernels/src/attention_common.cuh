// Helpers shared by the attention kernels: attention.cu (portable, mma.sync and
// simple) and attention_hopper.cu (wgmma, sm_90a). The band and soft-cap
// conventions they implement are described at the top of attention.cu.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include "convert.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))


__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// A missing band bound (see the top): lo = -(nq + BAND_PAD), hi = nk + BAND_PAD.
#define BAND_PAD 256

__device__ __forceinline__ int clampi(long long x, int n) { return (int)(x < 0 ? 0 : (x > n ? n : x)); }

// Keys [*j0, *j1) that row i sees (*j0 == *j1: none).
__device__ __forceinline__ void key_range(int i, int nk, int lo, int hi, int* j0, int* j1) {
    const int a = clampi((long long)i + lo, nk);
    const int b = clampi((long long)i + hi + 1, nk);
    *j0 = a;
    *j1 = b < a ? a : b;
}

// Query rows [*i0, *i1) that see key j (*i0 == *i1: none).
__device__ __forceinline__ void row_range(int j, int nq, int lo, int hi, int* i0, int* i1) {
    const int a = clampi((long long)j - hi, nq);
    const int b = clampi((long long)j - lo + 1, nq);
    *i0 = a;
    *i1 = b < a ? a : b;
}

// tanh to a few ulp whatever --use_fast_math does to tanhf (tanh.approx has
// 2^-11 relative error): expm1 keeps small arguments exact, |x| >= 9 is +-1 in f32.
__device__ __forceinline__ float tanh_acc(float x) {
    const float a = fminf(fabsf(x), 9.f);
    const float e = expm1f(2.f * a);
    return copysignf(e / (e + 2.f), x);
}

// The score of a raw dot product x = q.k: scale * x, soft-capped when cap > 0;
// *dsdx gets d s / d (scale x) (1 - tanh^2, or 1).
__device__ __forceinline__ float score(float x, float scale, float cap, float* dsdx) {
    const float s = x * scale;
    if (cap > 0.f) {
        const float t = tanh_acc(s / cap);
        *dsdx = 1.f - t * t;
        return cap * t;
    }
    *dsdx = 1.f;
    return s;
}

// Two floats rounded to one register of two 16-bit elements (low: a).
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

constexpr float LOG2E = 1.4426950408889634f;
#define POS_INF (__int_as_float(0x7f800000))

// 16-byte global -> shared copy that bypasses registers; `bytes` 0 fills zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async16s(uint32_t smem, const void* gmem, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Bytes of dynamic shared memory the kernel was launched with.
__device__ __forceinline__ uint32_t dynamic_smem_size() {
    uint32_t x;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(x));
    return x;
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// The part of a call one block works on (the tensor-core kernels, Hopper and
// portable): a document of a packed (varlen) call, or the whole call. Its query
// rows are q_off.. (nq of them) and its keys k_off.. (nk), with its own band
// (lo, hi) relative to them; `blk` is the block's query block (forward) or key
// block (backward) in it, and `tile0` (Hopper backward) its first tile of 64
// queries in the statistics and the dq accumulator. The launcher of a packed
// call passes one Seg per block (the forward's heaviest first, the backward's
// document by document); a plain call passes none. Sizes and bands in a
// kernel are the Seg's; the sequence lengths of the whole call only stride.
struct Seg {
    int q_off, nq, k_off, nk, lo, hi, blk, tile0;
    // A band with an upper bound and no lower one (causal): the first key
    // blocks and the last query blocks carry the most work.
    __device__ __forceinline__ bool causal_like() const { return hi < nk + BAND_PAD && lo <= -(nq + BAND_PAD); }
};

// A block's place in a launch grid (x fastest, as the hardware launches): the
// block itself, or the item a persistent block works on in the grid it stands
// in for.
struct VBlock {
    int x, y, z, gx, gy, gz;
    // The linear index, x fastest.
    __device__ __forceinline__ long long lin() const { return x + (long long)gx * (y + (long long)gy * z); }
};
__device__ __forceinline__ VBlock hw_block() {
    return {(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.x, (int)gridDim.y, (int)gridDim.z};
}
// Item `v` (the linear index) of a (gx, gy, gz) grid.
__device__ __forceinline__ VBlock item_block(long long v, int gx, int gy, int gz) {
    return {(int)(v % gx), (int)(v / gx % gy), (int)(v / gx / gy), gx, gy, gz};
}

// This block's Seg and its (head, batch): from `segs` or the whole call
// (vb.x the block, -1 in blk: block_work and kv_work decide). `spread`
// (the forward): Seg vb.x... in the order of one linear block index over
// every (batch, head) first, so that the heaviest Segs (first) start everywhere
// before the rest; else (the backward) Seg vb.x of head vb.y, so that
// the blocks running at once share a document's queries in L2, as a plain call's.
__device__ __forceinline__ Seg block_seg(const Seg* segs, int nq, int nk, int lo, int hi, bool spread,
                                         const VBlock& vb, int* h, int* b) {
    if (segs == nullptr || !spread) {
        *h = vb.y;
        *b = vb.z;
        return segs == nullptr ? Seg{0, nq, 0, nk, lo, hi, -1, 0} : segs[vb.x];
    }
    const int heads = vb.gy * vb.gz;
    const long long lin = vb.lin();
    *h = (int)(lin % heads % vb.gy);
    *b = (int)(lin % heads / vb.gy);
    return segs[lin / heads];
}
