// Standalone check and benchmark of the tensor-core kernels of
// kernels/src/attention.cu, without Rust or Candle: kernel time only (CUDA events),
// results against an f64 reference on the host. Build and run with
// scripts/attention-harness.sh; `KFILE` names the kernel source to test, so two
// versions of it can be compared in one device run.
//   harness 0: correctness (bf16/f16, D 64/128, odd sizes, causal offsets, GQA,
//              sliding windows (a lower bound lo), soft-capping)
//   harness 1: benchmark (bf16, B=1, H=16, N = 1k..16k, causal and not)
//   harness 3: the Hopper forward and backward (HFILE, sm_90a) against the same reference
//   harness 4: benchmark of the Hopper forward beside the portable one
//   harness 5: forward + backward, portable then Hopper
//   harness 8, 9: the sliding-window target's shapes on the Hopper kernels (8 times, 9 runs once for ncu)
//   harness 10: whether a small pageable host-to-device copy waits for the stream's earlier work
// A gradient whose reference is zero up to rounding (nk = 1, a scale of 1e-30) is
// judged by its absolute error and marked '*'.
#ifndef KFILE
#define KFILE "../src/attention.cu"
#endif
#include KFILE
#ifdef HFILE
#include HFILE
#include <cudaTypedefs.h>
#endif
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <random>
#include <cuda_runtime.h>
#include <chrono>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "cuda error %d at line %d\n", (int)e, __LINE__); exit(1);} } while (0)
template <int D> constexpr int fwd_rows() { return FwdCfg<D>::BR; }
typedef void (*FwdFn)(const void*, const void*, const void*, void*, float*, int, int, int, int, float, int, int, float,
                      const Seg*);
typedef void (*BwdFn)(const void*, const void*, const void*, const void*, const float*, const float*, float*, void*, void*, int, int, int, int, float, int, int, float,
                      const Seg*);
float tof(__half x) { return __half2float(x); }
float tof(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> T fromf_h(float x);
template <> __half fromf_h<__half>(float x) { return __float2half_rn(x); }
template <> __nv_bfloat16 fromf_h<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T, int D> struct K;
#define KDEF(T, SUF, D) template <> struct K<T, D> { \
  static FwdFn fwd(bool cap) { return cap ? (FwdFn)cqsa_fwd_mma_cap_##SUF##_d##D : (FwdFn)cqsa_fwd_mma_##SUF##_d##D; } \
  static BwdFn bwd(bool cap) { return cap ? (BwdFn)cqsa_bwd_mma_cap_##SUF##_d##D : (BwdFn)cqsa_bwd_mma_##SUF##_d##D; } \
  static int fsmem() { return FwdCfg<D>::SMEM; } static int bsmem() { return BwdCfg<D>::SMEM; } };
KDEF(__half, f16, 64) KDEF(__half, f16, 128) KDEF(__nv_bfloat16, bf16, 64) KDEF(__nv_bfloat16, bf16, 128)
// The Hopper forward (harness modes 3 and 4): Q, K, V as TMA tensor maps.
static bool g_hopper = false;
#ifdef HFILE
typedef void (*HopFn)(CUtensorMap, CUtensorMap, CUtensorMap, void*, float*, int, int, int, int, float, int, int, float,
                      const Seg*, int, int, int*);
template <typename T, int D> HopFn hopper_fwd(bool cap);
#define HDEF(T, SUF, D) template <> HopFn hopper_fwd<T, D>(bool cap) { \
  return cap ? (HopFn)cqsa_fwd_hopper_cap_##SUF##_d##D : (HopFn)cqsa_fwd_hopper_##SUF##_d##D; }
HDEF(__half, f16, 64) HDEF(__half, f16, 128) HDEF(__half, f16, 256)
HDEF(__nv_bfloat16, bf16, 64) HDEF(__nv_bfloat16, bf16, 128) HDEF(__nv_bfloat16, bf16, 256)
typedef void (*HopBwdFn)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, const float*, const float*, void*, ...);
template <typename T, int D> HopBwdFn hopper_bwd_fn(bool cap);
#define HBDEF(T, SUF, D) template <> HopBwdFn hopper_bwd_fn<T, D>(bool cap) { \
  return cap ? (HopBwdFn)cqsa_bwd_hopper_cap_##SUF##_d##D : (HopBwdFn)cqsa_bwd_hopper_##SUF##_d##D; }
HBDEF(__half, f16, 64) HBDEF(__half, f16, 128) HBDEF(__nv_bfloat16, bf16, 64) HBDEF(__nv_bfloat16, bf16, 128)
typedef CUresult (*EncodeFn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                             const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                             CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The tensor map the kernel expects: 3-D (d, n, slices), 128-byte swizzle, boxes of (64, rows, 1).
template <typename T> CUtensorMap tensor_map(const void* base, int d, int n, int slices, int rows) {
  static EncodeFn encode = nullptr;
  if (!encode) { cudaDriverEntryPointQueryResult qr;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&encode, 12000, cudaEnableDefault, &qr)); }
  CUtensorMap m;
  cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)n, (cuuint64_t)slices};
  cuuint64_t strides[2] = {(cuuint64_t)d * 2, (cuuint64_t)n * d * 2};
  cuuint32_t box[3] = {64, (cuuint32_t)rows, 1}, es[3] = {1, 1, 1};
  CUresult r = encode(&m, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                      3, (void*)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", (int)r); exit(1); }
  return m;
}
#endif
template <typename T> void* delta_fn();
template <> void* delta_fn<__half>() { return (void*)cqsa_bwd_delta_f16; }
template <> void* delta_fn<__nv_bfloat16>() { return (void*)cqsa_bwd_delta_bf16; }
template <typename T> void* conv_fn();
template <> void* conv_fn<__half>() { return (void*)cqsa_bwd_dq_convert_f16; }
template <> void* conv_fn<__nv_bfloat16>() { return (void*)cqsa_bwd_dq_convert_bf16; }

template <typename T, int D>
struct Run {
  int b, hq, hkv, nq, nk; bool causal; long long off; float scale;
  bool has_lo = false; long long lo = 0; float cap = 0.f;  // window: key j >= i + lo; soft-cap
  T *q, *k, *v, *o, *g, *dq, *dk, *dv; float *lse, *delta, *dqa, *fqa = nullptr; float2* stats = nullptr;
  int nqp() const { return (nq + 63) / 64 * 64; }
  std::vector<T> hq_, hk_, hv_, hg_;
  void alloc(unsigned seed) {
    size_t nqe = (size_t)b * hq * nq * D, nke = (size_t)b * hkv * nk * D;
    // HARNESS_NORMAL=1: N(0, 1) inputs, as the bench's randn (tensor-core power
    // can depend on the data); otherwise uniform in [-1.5, 1.5].
    std::mt19937 rng(seed); std::uniform_real_distribution<float> U(-1.5f, 1.5f); std::normal_distribution<float> Nd(0.f, 1.f);
    const char* nenv = getenv("HARNESS_NORMAL"); const bool normal = nenv && nenv[0] == '1';
    auto draw = [&]() { return normal ? Nd(rng) : U(rng); };
    hq_.resize(nqe); hk_.resize(nke); hv_.resize(nke); hg_.resize(nqe);
    for (auto& x : hq_) x = fromf_h<T>(draw()); for (auto& x : hk_) x = fromf_h<T>(draw());
    for (auto& x : hv_) x = fromf_h<T>(draw()); for (auto& x : hg_) x = fromf_h<T>(draw());
    CK(cudaMalloc(&q, nqe * 2)); CK(cudaMalloc(&o, nqe * 2)); CK(cudaMalloc(&g, nqe * 2)); CK(cudaMalloc(&dq, nqe * 2));
    CK(cudaMalloc(&k, nke * 2)); CK(cudaMalloc(&v, nke * 2)); CK(cudaMalloc(&dk, nke * 2)); CK(cudaMalloc(&dv, nke * 2));
    CK(cudaMalloc(&lse, (size_t)b * hq * nq * 4)); CK(cudaMalloc(&delta, (size_t)b * hq * nq * 4)); CK(cudaMalloc(&dqa, nqe * 4));
#ifdef HFILE
    CK(cudaMalloc(&fqa, (size_t)b * hq * nqp() * D * 4)); CK(cudaMalloc(&stats, (size_t)b * hq * nqp() * 8));
#endif
    CK(cudaMemcpy(q, hq_.data(), nqe * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(g, hg_.data(), nqe * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k, hk_.data(), nke * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(v, hv_.data(), nke * 2, cudaMemcpyHostToDevice));
  }
  void release() { cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(g); cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(lse); cudaFree(delta); cudaFree(dqa); cudaFree(fqa); cudaFree(stats); }
  // The band as the kernels take it (see BAND_PAD).
  int klo() const { long long a = -(long long)(nq + BAND_PAD), b = nk + BAND_PAD; return has_lo ? (int)std::max(a, std::min(b, lo)) : (int)a; }
  int khi() const { long long a = -(long long)(nq + BAND_PAD), b = nk + BAND_PAD; return causal ? (int)std::max(a, std::min(b, off)) : (int)b; }
  void fwd() {
#ifdef HFILE
    if (g_hopper || D == 256) {
      using HC = hopper::FwdCfg<D>;
      HopFn f = hopper_fwd<T, D>(cap > 0.f); int sm = HC::SMEM;
      CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
      int kl = klo(), kh = khi();
      CUtensorMap tq = tensor_map<T>(q, D, nq, b * hq, HC::BR), tk = tensor_map<T>(k, D, nk, b * hkv, HC::BC),
                  tv = tensor_map<T>(v, D, nk, b * hkv, HC::BC);
      const Seg* segs = nullptr;  // a plain call
      // Persistent: at most one block per SM for the (gx, hq, b) items.
      int gx = (nq + HC::BR - 1) / HC::BR, sms = 0;
      CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      static int* next = nullptr;  // the kernel's count of items taken, zeroed per launch
      if (!next) CK(cudaMalloc(&next, sizeof(int)));
      CK(cudaMemsetAsync(next, 0, sizeof(int)));
      void* args[] = {&tq, &tk, &tv, &o, &lse, &hq, &hkv, &nq, &nk, &scale, &kl, &kh, &cap, &segs, &gx, &b, &next};
      CK(cudaLaunchKernel((const void*)f, dim3(std::min((long long)gx * hq * b, (long long)sms)), dim3(HC::THREADS), args, sm, 0));
      return;
    }
#endif
    if constexpr (D != 256) fwd_portable();
  }
  void fwd_portable() {
    FwdFn f = K<T, D>::fwd(cap > 0.f); int sm = K<T, D>::fsmem();
    CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
    dim3 grid((nq + fwd_rows<D>() - 1) / fwd_rows<D>(), hq, b);
    int kl = klo(), kh = khi();
    const Seg* segs = nullptr;  // a plain call
    void* args[] = {&q, &k, &v, &o, &lse, &hq, &hkv, &nq, &nk, &scale, &kl, &kh, &cap, &segs};
    CK(cudaLaunchKernel((const void*)f, grid, dim3(128), args, sm, 0));
  }
  void bwd() {
    if constexpr (D == 256) return; else {
    long long rows = (long long)b * hq * nq; int d = D;
    { void* args[] = {&o, &g, &delta, &rows, &d};
      CK(cudaLaunchKernel(delta_fn<T>(), dim3((rows + 3) / 4), dim3(128), args, 0, 0)); }
#ifdef HFILE
    if (g_hopper) { hopper_bwd(); return; }
#endif
    CK(cudaMemsetAsync(dqa, 0, rows * D * 4));
    BwdFn f = K<T, D>::bwd(cap > 0.f); int sm = K<T, D>::bsmem();
    CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
    int kl = klo(), kh = khi();
    const Seg* segs = nullptr;  // a plain call
    { void* args[] = {&q, &k, &v, &g, &lse, &delta, &dqa, &dk, &dv, &hq, &hkv, &nq, &nk, &scale, &kl, &kh, &cap, &segs};
      const int bc = BwdCfg<D>::BC, bt = BwdCfg<D>::THREADS;
      CK(cudaLaunchKernel((const void*)f, dim3((nk + bc - 1) / bc, hkv, b), dim3(bt), args, sm, 0)); }
    long long n = rows * D;
    { void* args[] = {&dqa, &dq, &n, &scale};
      long long gx = (n + 255) / 256; if (gx > 65536) gx = 65536;
      CK(cudaLaunchKernel(conv_fn<T>(), dim3(gx), dim3(256), args, 0, 0)); }
    }
  }
#ifdef HFILE
  // The Hopper backward after the delta kernel: statistics, dK/dV with dQ summed
  // into fqa, dq.
  void hopper_bwd() {
    if constexpr (D != 256) {
      using FC = hopper::BwdCfg<D>;
      HopBwdFn f = hopper_bwd_fn<T, D>(cap > 0.f);
      int sm = FC::SMEM, kl = klo(), kh = khi(), np = nqp(), nqt = np / 64, d = D;
      const Seg* segs = nullptr;  // a plain call: no Segs, no tile table
      const int2* tiles = nullptr;
      long long slices = (long long)b * hq;
      CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, sm));
      { void* args[] = {&lse, &delta, &stats, &slices, &nq, &nqt, &tiles};
        CK(cudaLaunchKernel((const void*)cqsa_bwd_stats_hopper, dim3((slices * np + 255) / 256), dim3(256), args, 0, 0)); }
      CK(cudaMemsetAsync(fqa, 0, (size_t)slices * np * D * 4));
      { CUtensorMap tq = tensor_map<T>(q, D, nq, b * hq, FC::BS), tg = tensor_map<T>(g, D, nq, b * hq, FC::BS),
                    tk = tensor_map<T>(k, D, nk, b * hkv, FC::BR), tv = tensor_map<T>(v, D, nk, b * hkv, FC::BR);
        void* args[] = {&tq, &tk, &tv, &tg, &stats, &fqa, &dk, &dv, &hq, &hkv, &nq, &nk, &scale, &kl, &kh, &cap, &segs, &nqt};
        CK(cudaLaunchKernel((const void*)f, dim3((nk + FC::BR - 1) / FC::BR, hkv, b), dim3(FC::THREADS), args, sm, 0)); }
      { void* args[] = {&fqa, &dq, &slices, &nq, &nqt, &d, &scale, &tiles};
        const void* cf = std::is_same<T, __half>::value ? (const void*)cqsa_bwd_dq_convert_hopper_f16 : (const void*)cqsa_bwd_dq_convert_hopper_bf16;
        CK(cudaLaunchKernel(cf, dim3((slices * np * D / 2 + 255) / 256), dim3(256), args, 0, 0)); }
    }
  }
#endif
  // Returns max rel err of o, lse (abs), and grads when check_bwd.
  void check(bool check_bwd, int row_stride) {
    fwd(); if (check_bwd) bwd(); CK(cudaDeviceSynchronize());
    size_t nqe = (size_t)b * hq * nq * D, nke = (size_t)b * hkv * nk * D;
    std::vector<T> ho(nqe), hdq(nqe), hdk(nke), hdv(nke); std::vector<float> hl((size_t)b * hq * nq);
    CK(cudaMemcpy(ho.data(), o, nqe * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hl.data(), lse, hl.size() * 4, cudaMemcpyDeviceToHost));
    if (check_bwd) { CK(cudaMemcpy(hdq.data(), dq, nqe * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hdk.data(), dk, nke * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(hdv.data(), dv, nke * 2, cudaMemcpyDeviceToHost)); }
    double eo = 0, mo = 0, el = 0; int badl = 0;
    std::vector<double> rdq(nqe, 0), rdk(nke, 0), rdv(nke, 0);
    for (int bb = 0; bb < b; ++bb) for (int h = 0; h < hq; ++h) {
      int kh = h / (hq / hkv);
      for (int i = 0; i < nq; i += (check_bwd ? 1 : row_stride)) {
        const T* qr = &hq_[(((size_t)bb * hq + h) * nq + i) * D];
        long long je = causal ? std::max(0LL, std::min((long long)nk, i + off + 1)) : nk;
        long long j0 = has_lo ? std::max(0LL, std::min((long long)nk, i + lo)) : 0;
        je = std::max(je, j0);
        const long long vis = je - j0;
        std::vector<double> s(nk), dsx(nk, 1.0); double mx = -INFINITY;
        for (long long j = j0; j < je; ++j) { const T* kr = &hk_[(((size_t)bb * hkv + kh) * nk + j) * D];
          double a = 0; for (int x = 0; x < D; ++x) a += (double)tof(qr[x]) * tof(kr[x]); s[j] = a * scale;
          if (cap > 0.f) { double th = tanh(s[j] / cap); s[j] = cap * th; dsx[j] = 1 - th * th; }
          mx = std::max(mx, s[j]); }
        double l = 0; for (long long j = j0; j < je; ++j) { s[j] = exp(s[j] - mx); l += s[j]; }
        double lref = vis ? mx + log(l) : -INFINITY;
        float lg = hl[((size_t)bb * hq + h) * nq + i];
        if (vis == 0) { if (!(lg == -INFINITY)) badl++; } else el = std::max(el, fabs(lg - lref));
        std::vector<double> orow(D, 0);
        for (long long j = j0; j < je; ++j) { const T* vr = &hv_[(((size_t)bb * hkv + kh) * nk + j) * D];
          for (int x = 0; x < D; ++x) orow[x] += s[j] / l * tof(vr[x]); }
        for (int x = 0; x < D; ++x) { double gv = tof(ho[(((size_t)bb * hq + h) * nq + i) * D + x]); eo = std::max(eo, fabs(gv - orow[x])); mo = std::max(mo, fabs(orow[x])); }
        if (check_bwd && vis) {
          const T* gr = &hg_[(((size_t)bb * hq + h) * nq + i) * D];
          double dl = 0; for (int x = 0; x < D; ++x) dl += orow[x] * tof(gr[x]);
          for (long long j = j0; j < je; ++j) { size_t kb_ = ((size_t)bb * hkv + kh) * nk + j;
            const T* kr = &hk_[kb_ * D]; const T* vr = &hv_[kb_ * D];
            double p = s[j] / l, dp = 0; for (int x = 0; x < D; ++x) dp += tof(gr[x]) * tof(vr[x]);
            double ds = p * (dp - dl) * dsx[j];
            for (int x = 0; x < D; ++x) { rdv[kb_ * D + x] += p * tof(gr[x]); rdk[kb_ * D + x] += ds * scale * tof(qr[x]);
              rdq[(((size_t)bb * hq + h) * nq + i) * D + x] += ds * scale * tof(kr[x]); } }
        }
      }
    }
    // Gradient error relative to the reference's largest value; a reference that is
    // zero up to rounding (nk = 1, a tiny scale) is judged by the absolute error
    // instead (inputs are O(1)), and marked with '*'.
    auto rel = [](const std::vector<T>& a, const std::vector<double>& r, bool& zero) { double m = 0, e = 0;
      for (size_t i = 0; i < r.size(); ++i) { m = std::max(m, fabs(r[i])); e = std::max(e, fabs(tof(a[i]) - r[i])); }
      zero = m < 1e-6; return zero ? e : e / m; };
    double tol = 2e-2;
    bool ok = eo / std::max(mo, 1e-30) < tol && el < 1e-2 && badl == 0;
    double edq = 0, edk = 0, edv = 0;
    bool zq = false, zk = false, zv = false;
    if (check_bwd) { edq = rel(hdq, rdq, zq); edk = rel(hdk, rdk, zk); edv = rel(hdv, rdv, zv); ok = ok && edq < 3e-2 && edk < 3e-2 && edv < 3e-2; }
    printf("%s %s D=%d b=%d hq=%d hkv=%d nq=%d nk=%d causal=%d off=%lld lo=%s%lld cap=%g scale=%.3g: o %.2e lse %.2e badl %d dq %.2e%s dk %.2e%s dv %.2e%s\n",
           ok ? "OK  " : "FAIL", sizeof(T) == 2 && std::is_same<T, __half>::value ? "f16" : "bf16", D, b, hq, hkv, nq, nk, (int)causal, off,
           has_lo ? "" : "none:", lo, cap, scale, eo / std::max(mo, 1e-30), el, badl,
           edq, zq ? "*" : "", edk, zk ? "*" : "", edv, zv ? "*" : "");
  }
  // Forward + backward back to back for `secs` seconds (nothing timed).
  void warm(double secs) {
    cudaEvent_t a, z; cudaEventCreate(&a); cudaEventCreate(&z); float ms = 0.f;
    cudaEventRecord(a);
    while (ms < secs * 1e3) { fwd(); bwd(); cudaEventRecord(z); CK(cudaEventSynchronize(z)); cudaEventElapsedTime(&ms, a, z); }
    cudaEventDestroy(a); cudaEventDestroy(z);
  }
  void bench() {
    fwd(); bwd(); CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1, e2; cudaEventCreate(&e0); cudaEventCreate(&e1); cudaEventCreate(&e2);
    int it = nq >= 8192 ? 5 : 20; float tf = 0, tb = 0;
    for (int r = 0; r < it; ++r) { cudaEventRecord(e0); fwd(); cudaEventRecord(e1); bwd(); cudaEventRecord(e2); cudaEventSynchronize(e2);
      float a, c; cudaEventElapsedTime(&a, e0, e1); cudaEventElapsedTime(&c, e1, e2); tf += a; tb += c; }
    tf /= it; tb /= it;
    double fl = 4.0 * b * hq * (double)nq * nk * D * (causal ? 0.5 : 1.0);
    if (has_lo) {  // a window: 4 D per visible (query, key) pair
      double pairs = 0;
      for (long long i = 0; i < nq; ++i) {
        const long long j0 = std::max(0LL, i + lo), j1 = causal ? std::min((long long)nk, i + off + 1) : nk;
        pairs += (double)std::max(0LL, j1 - j0);
      }
      fl = 4.0 * b * hq * pairs * D;
    }
    printf("BENCH D=%d N=%d causal=%d: fwd %.3f ms %.1f TF/s | bwd %.3f ms %.1f TF/s | fwd+bwd %.1f TF/s\n", D, nq, (int)causal, tf,
           fl / tf * 1e-9, tb, 2.5 * fl / tb * 1e-9, 3.5 * fl / (tf + tb) * 1e-9);
  }
};

// Forward time of the portable kernel and of the Hopper one on the same inputs.
template <int D> void bench_hopper(int n, bool causal) {
  Run<__nv_bfloat16, D> r{1, 16, 16, n, n, causal, 0, (float)(1.0 / sqrt((double)D))}; r.alloc(1);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  double fl = 4.0 * 16 * (double)n * n * D * (causal ? 0.5 : 1.0);
  float ms[2] = {0.f, 0.f};
  for (int hop = 0; hop < 2; ++hop) {
    if (D == 256 && hop == 0) continue;
    g_hopper = hop; r.fwd(); CK(cudaDeviceSynchronize());
    int it = n >= 8192 ? 10 : 30;
    cudaEventRecord(e0); for (int i = 0; i < it; ++i) r.fwd(); cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms[hop], e0, e1); ms[hop] /= it;
  }
  g_hopper = false;
  printf("HBENCH D=%d N=%d causal=%d: portable %.3f ms %.1f TF/s | hopper %.3f ms %.1f TF/s\n", D, n, (int)causal,
         ms[0], ms[0] > 0 ? fl / ms[0] * 1e-9 : 0.0, ms[1], fl / ms[1] * 1e-9);
  r.release();
}
template <typename T, int D> void test(int b, int hq, int hkv, int nq, int nk, bool causal, long long off, bool bwd, float scale = 0.f, int stride = 1) {
  Run<T, D> r{b, hq, hkv, nq, nk, causal, off, scale == 0.f ? (float)(1.0 / sqrt((double)D)) : scale};
  r.alloc(nq * 7 + nk + D); r.check(bwd, stride); r.release();
}
// A sliding window (key j >= i + lo, and j <= i + off when causal) and/or a soft-cap.
template <typename T, int D> void test_mask(int hq, int hkv, int nq, int nk, bool causal, long long off, bool has_lo, long long lo, float cap, bool bwd = true) {
  Run<T, D> r{1, hq, hkv, nq, nk, causal, off, (float)(1.0 / sqrt((double)D))};
  r.has_lo = has_lo; r.lo = lo; r.cap = cap;
  r.alloc(nq * 5 + nk + D + (int)lo); r.check(bwd, 1); r.release();
}
// Spins for about `ns` nanoseconds (harness mode 10).
__global__ void spin(long long ns) {
  long long t0; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (long long t = t0; t - t0 < ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}
// Whether a small copy from pageable host memory waits for the stream's earlier
// work (as cqsa's packed calls upload their block tables that way): host time
// of cudaMemcpyAsync of `bytes` queued behind a 20 ms kernel.
static void pageable_copy_wait(size_t bytes) {
  std::vector<char> host(bytes, 1); void* dev; CK(cudaMalloc(&dev, bytes));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int rep = 0; rep < 3; ++rep) {
    spin<<<1, 1, 0, st>>>(20000000LL);
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaMemcpyAsync(dev, host.data(), bytes, cudaMemcpyHostToDevice, st));
    auto t1 = std::chrono::steady_clock::now();
    CK(cudaStreamSynchronize(st));
    auto t2 = std::chrono::steady_clock::now();
    printf("PAGEABLE %zu bytes behind a 20 ms kernel: cudaMemcpyAsync returned after %.3f ms, stream done after %.3f ms\n",
           bytes, std::chrono::duration<double, std::milli>(t1 - t0).count(),
           std::chrono::duration<double, std::milli>(t2 - t0).count());
  }
  CK(cudaStreamDestroy(st)); CK(cudaFree(dev));
}
int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IONBF, 0); fprintf(stderr, "start\n");
  int mode = argc > 1 ? atoi(argv[1]) : 0;
  if (mode == 0 || mode == 2) {
    // correctness
    int sizes[][2] = {{1, 1}, {37, 100}, {200, 77}, {128, 128}, {129, 300}, {300, 129}, {64, 64}, {257, 257}};
    for (auto& s : sizes) for (int c = 0; c < 2; ++c) {
      long long off = c ? (long long)s[1] - s[0] : 0;
      test<__nv_bfloat16, 128>(1, 4, 2, s[0], s[1], c, off, true);
      test<__half, 64>(2, 2, 1, s[0], s[1], c, off, true);
      test<__half, 128>(1, 2, 2, s[0], s[1], c, off, true);
      test<__nv_bfloat16, 64>(1, 2, 2, s[0], s[1], c, off, true);
    }
    test<__nv_bfloat16, 128>(1, 2, 1, 300, 200, true, -150, true);   // rows that see nothing
    test<__nv_bfloat16, 64>(1, 2, 1, 150, 400, true, 333, true);
    test<__nv_bfloat16, 128>(1, 2, 2, 200, 300, false, 0, true, -0.3f);  // negative scale
    test<__half, 64>(1, 2, 2, 200, 300, true, 100, true, 0.f + 1e-30f);   // tiny scale
    for (int c = 0; c < 2; ++c) {  // GQA group 4, longer, nq != nk, all dtypes / dims with bwd
      test<__nv_bfloat16, 128>(1, 4, 1, 700, 1100, c, c ? 400 : 0, true);
      test<__half, 128>(2, 4, 2, 1100, 700, c, c ? -400 : 0, true);
      test<__nv_bfloat16, 64>(1, 4, 1, 700, 1100, c, c ? 400 : 0, true);
      test<__half, 64>(1, 8, 2, 513, 513, c, 0, true);
      test<__nv_bfloat16, 128>(1, 2, 2, 1, 300, c, c ? 299 : 0, true);
      test<__half, 128>(1, 2, 1, 300, 1, c, c ? -299 : 0, true);
    }
    // Windows of 1, 17 and >= N (offsets as cqsa passes them: lo = nk - nq - w),
    // causal or with a right window, GQA; soft-cap alone and with a window.
    for (int w : {0, 16, 100, 400})
      for (int c = 0; c < 2; ++c) {
        test_mask<__nv_bfloat16, 128>(4, 2, 300, 300, c, c ? 0 : 0, true, -w, 0.f);
        test_mask<__half, 64>(2, 1, 200, 333, c, 133, true, 133 - w, 0.f);
        test_mask<__half, 128>(2, 2, 333, 200, c, -133, true, -133 - w, 0.f);
        test_mask<__nv_bfloat16, 64>(4, 1, 257, 257, c, 0, true, -w, 0.f);
      }
    test_mask<__nv_bfloat16, 128>(2, 1, 300, 300, false, 0, true, -1000, 0.f);  // window >= N
    test_mask<__half, 64>(2, 2, 300, 300, true, 0, true, 5, 0.f);  // lo > hi: no row sees a key
    for (float cap : {5.f, 30.f}) {
      test_mask<__nv_bfloat16, 128>(2, 1, 200, 300, false, 0, false, 0, cap);
      test_mask<__half, 64>(2, 2, 200, 300, true, 100, false, 0, cap);
      test_mask<__half, 128>(4, 2, 257, 257, true, 0, true, -17, cap);
      test_mask<__nv_bfloat16, 64>(2, 1, 300, 200, false, 0, true, -150, cap);
    }
    test<__nv_bfloat16, 128>(1, 2, 1, 2000, 2000, false, 0, false, 0.f, 7);
    test<__nv_bfloat16, 128>(1, 2, 1, 2000, 2000, true, 0, false, 0.f, 7);
  }
  if (mode == 1 || mode == 2) {
    for (int c = 0; c < 2; ++c) for (int n : {1024, 2048, 4096, 8192, 16384}) {
      Run<__nv_bfloat16, 128> r{1, 16, 16, n, n, (bool)c, 0, 0.0883883f}; r.alloc(1); r.bench(); r.release(); }
    for (int c = 0; c < 2; ++c) for (int n : {1024, 4096, 16384}) { Run<__nv_bfloat16, 64> r{1, 16, 16, n, n, (bool)c, 0, 0.125f}; r.alloc(1); r.bench(); r.release(); }
  }
#ifdef HFILE
  if (mode == 3) {
    // The Hopper forward against the f64 reference: odd sizes, causal offsets, GQA,
    // rows that see nothing, windows, soft-capping, head dims 64, 128 and 256.
    g_hopper = true;
    int sizes[][2] = {{1, 1}, {37, 100}, {200, 77}, {128, 128}, {129, 300}, {300, 129}, {64, 64}, {257, 257}, {700, 1100}};
    for (auto& s : sizes) for (int c = 0; c < 2; ++c) {
      long long off = c ? (long long)s[1] - s[0] : 0;
      test<__nv_bfloat16, 128>(1, 4, 2, s[0], s[1], c, off, true);
      test<__half, 64>(2, 2, 1, s[0], s[1], c, off, true);
      test<__half, 128>(1, 2, 2, s[0], s[1], c, off, true);
      test<__nv_bfloat16, 64>(1, 2, 2, s[0], s[1], c, off, true);
      test<__nv_bfloat16, 256>(1, 2, 1, s[0], s[1], c, off, false);
      test<__half, 256>(1, 2, 2, s[0], s[1], c, off, false);
    }
    test<__nv_bfloat16, 128>(1, 2, 1, 300, 200, true, -150, true);   // rows that see nothing
    test<__nv_bfloat16, 128>(1, 2, 2, 200, 300, false, 0, true, -0.3f);  // negative scale
    test<__half, 64>(1, 2, 2, 200, 300, true, 100, true, 0.f + 1e-30f);   // tiny scale
    for (int w : {0, 16, 100, 400}) for (int c = 0; c < 2; ++c) {
      test_mask<__nv_bfloat16, 128>(4, 2, 300, 300, c, 0, true, -w, 0.f, true);
      test_mask<__half, 64>(2, 1, 200, 333, c, 133, true, 133 - w, 0.f, true);
      test_mask<__nv_bfloat16, 256>(2, 1, 333, 200, c, -133, true, -133 - w, 0.f, false);
    }
    for (float cap : {5.f, 30.f}) {
      test_mask<__nv_bfloat16, 128>(2, 1, 200, 300, false, 0, false, 0, cap, true);
      test_mask<__half, 64>(2, 2, 200, 300, true, 100, false, 0, cap, true);
      test_mask<__half, 256>(2, 2, 257, 257, true, 0, true, -17, cap, false);
    }
    test<__nv_bfloat16, 128>(2, 8, 2, 2000, 2000, true, 0, false, 0.f, 7);
    test<__nv_bfloat16, 128>(1, 4, 1, 700, 1100, true, 400, true);  // GQA 4, longer, with gradients
    test<__nv_bfloat16, 64>(1, 4, 4, 4100, 4100, false, 0, false, 0.f, 13);
  }
  if (mode == 5) {
    // Forward + backward, portable then Hopper (the bench() of modes 1).
    for (int hop = 0; hop < 2; ++hop) {
      g_hopper = hop; printf("== %s\n", hop ? "hopper" : "portable");
      for (int c = 0; c < 2; ++c) for (int n : {4096, 8192, 16384}) {
        Run<__nv_bfloat16, 128> r{1, 16, 16, n, n, (bool)c, 0, 0.0883883f}; r.alloc(1); r.bench(); r.release(); }
      for (int c = 0; c < 2; ++c) { Run<__nv_bfloat16, 64> r{1, 16, 16, 8192, 8192, (bool)c, 0, 0.125f}; r.alloc(1); r.bench(); r.release(); }
    }
    g_hopper = false;
  }
  if (mode == 6 || mode == 7) {
    // The Hopper kernels alone at the issue's sizes (D = 128 and 64, 8k and 16k).
    // Mode 7 times each after a second of back-to-back calls, at the clock a
    // power-capped GPU keeps under sustained load (as the attention bench sees).
    g_hopper = true;
    const double sustain = mode == 7 ? 1.0 : 0.0;
    for (int c = 0; c < 2; ++c) for (int n : {8192, 16384}) {
      { Run<__nv_bfloat16, 128> r{1, 16, 16, n, n, (bool)c, 0, 0.0883883f}; r.alloc(1); r.warm(sustain); r.bench(); r.release(); }
      { Run<__nv_bfloat16, 64> r{1, 16, 16, n, n, (bool)c, 0, 0.125f}; r.alloc(1); r.warm(sustain); r.bench(); r.release(); } }
    g_hopper = false;
  }
  if (mode == 10) for (size_t bytes : {256, 4096, 65536, 1 << 20}) pageable_copy_wait(bytes);
  if (mode == 11) {
    // Short sequences, where a block's start and end weigh most (bf16, H = 16):
    // D = 128 at B x N = 8 x 2048 and 1 x 4096, causal and not, and D = 256's
    // forward.
    g_hopper = true;
    struct Case { int b, n; bool causal; } cases[] = {{8, 2048, true}, {8, 2048, false}, {1, 4096, true}, {1, 4096, false}};
    for (auto& c : cases) {
      Run<__nv_bfloat16, 128> r{c.b, 16, 16, c.n, c.n, c.causal, 0, 0.0883883f}; r.alloc(1);
      printf("== B=%d\n", c.b); r.bench(); r.release();
    }
    g_hopper = false;
    for (int c = 0; c < 2; ++c) for (int n : {4096, 16384}) bench_hopper<256>(n, c);
  }
  if (mode == 8 || mode == 9) {
    // The sliding-window target's shapes on the Hopper kernels (bf16, D = 128,
    // H = 16): a window of 4096 at N = 32768 (causal), a dense causal call of
    // 4096 and a non-causal one of 8192. Mode 8 times each (bench); mode 9 runs
    // each forward and backward once, for a profiler (ncu --kernel-name
    // regex:'cqsa_(fwd|bwd)_hopper').
    g_hopper = true;
    struct Case { int n; bool causal; long long lo; } cases[] = {{32768, true, -4096}, {4096, true, 0}, {8192, false, 0}};
    for (auto& c : cases) {
      Run<__nv_bfloat16, 128> r{1, 16, 16, c.n, c.n, c.causal, 0, 0.0883883f};
      r.has_lo = c.lo != 0; r.lo = c.lo; r.alloc(1);
      printf("== N=%d causal=%d window=%lld\n", c.n, (int)c.causal, -c.lo);
      if (mode == 8) r.bench(); else { r.fwd(); r.bwd(); CK(cudaDeviceSynchronize()); }
      r.release();
    }
    g_hopper = false;
  }
  if (mode == 4) {
    for (int c = 0; c < 2; ++c) for (int n : {1024, 4096, 8192, 16384}) bench_hopper<128>(n, c);
    for (int c = 0; c < 2; ++c) for (int n : {4096, 16384}) { bench_hopper<64>(n, c); bench_hopper<256>(n, c); }
  }
#endif
  return 0;
}
