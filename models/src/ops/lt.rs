//! cuBLASLt GEMMs with the epilogues training needs (CUDA, bf16/f16).
//!
//! cudarc's safe `Matmul` knows only bias and activation. Training also wants
//! the pre-activation kept (`GELU_AUX_BIAS`), the GELU derivative applied to a
//! GEMM's output with the bias gradient reduced in the same pass
//! (`DGELU_BGRAD`), and a weight-gradient GEMM that also sums the bias
//! gradient (`BGRADB`). These three row-major helpers are all the fused
//! linear layers need:
//!
//! - [`linear`]: `epilogue(x W^T + b)`, optionally keeping `z = x W^T + b`;
//! - [`weight_grad`]: `g^T a`, optionally with `sum_rows(g)`;
//! - [`input_grad`]: `g W`, optionally times `gelu'(z)` with that product's row sum.
//!
//! All operands are contiguous row-major 2-D tensors of one dtype on one CUDA
//! device; callers check that. A cuBLASLt build that lacks an epilogue for a
//! shape falls back to the plain GEMM plus Candle ops, counted by
//! [`epilogue_fallbacks`] so a bench can show it.
use super::launch::{alloc, device_ptr_mut, View};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Result, Storage, Tensor};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

static FALLBACKS: AtomicUsize = AtomicUsize::new(0);

/// How many fused GEMMs ran as a plain GEMM plus separate ops because cuBLASLt
/// offered no kernel for the epilogue (0 on the H200 with CUDA 13).
pub fn epilogue_fallbacks() -> usize {
    FALLBACKS.load(Ordering::Relaxed)
}

/// A cuBLASLt handle and its workspace, bound to one stream.
struct Handle {
    raw: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

// SAFETY: a cuBLASLt handle may be used from any thread; calls on it are
// serialised by the stream they are enqueued on (every call takes &self and
// enqueues on `stream`, which orders them).
unsafe impl Send for Handle {}
// SAFETY: as above; the handle holds no thread-affine state.
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by create_handle and destroyed once, here.
        // A failure here cannot be returned; the handle is gone either way.
        let _ = unsafe { result::destroy_handle(self.raw) };
    }
}

impl Handle {
    /// Whether only this handle still holds its stream (itself and its
    /// workspace): every device and tensor of that stream is gone, so nothing
    /// can ask for the handle again. A call in flight holds a tensor of the
    /// stream, so a handle in use is never idle.
    fn is_idle(&self) -> bool {
        Arc::strong_count(&self.stream) <= 2
    }
}

/// Handles by stream. The key is the raw context and stream pointers (a
/// default stream is null in every context); the entry holds an `Arc` of that
/// stream, so neither pointer can be reused by another while the entry exists. Entries whose stream nobody else holds are dropped
/// (the handle destroyed, the workspace freed) on the next lookup.
static HANDLES: OnceLock<Mutex<HandleMap>> = OnceLock::new();

/// (context, stream) pointers -> that stream's handle.
type HandleMap = HashMap<(usize, usize), Arc<Handle>>;

fn handles() -> Result<std::sync::MutexGuard<'static, HandleMap>> {
    HANDLES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt handle cache poisoned".into()))
}

/// cuBLASLt handles cached now: one per live compute stream that ran a fused
/// GEMM (after dropping those whose stream is gone). For tests.
#[doc(hidden)]
pub fn cached_handles() -> Result<usize> {
    let mut map = handles()?;
    map.retain(|_, h| !h.is_idle());
    Ok(map.len())
}

/// A weak reference to the handle of `dev`'s stream (made if missing): it
/// stops upgrading once the handle is freed. For tests.
#[doc(hidden)]
pub fn handle_probe(dev: &CudaDevice) -> Result<std::sync::Weak<dyn std::any::Any + Send + Sync>> {
    let h: Arc<dyn std::any::Any + Send + Sync> = handle(dev)?;
    Ok(Arc::downgrade(&h))
}

/// The handle for `dev`'s stream, made on first use (one per compute stream:
/// cuBLASLt enqueues on the stream the outputs were allocated on).
fn handle(dev: &CudaDevice) -> Result<Arc<Handle>> {
    let stream = dev.cuda_stream();
    let key = (
        stream.context().cu_ctx() as usize,
        stream.cu_stream() as usize,
    );
    let mut map = handles()?;
    // `stream` is held here, so this stream's own entry is not idle.
    map.retain(|_, h| !h.is_idle());
    if let Some(h) = map.get(&key) {
        return Ok(h.clone());
    }
    let raw = result::create_handle().map_err(candle_core::Error::wrap)?;
    // 32 MiB: NVIDIA's recommendation for Hopper (and enough for older GPUs).
    // SAFETY: the workspace is scratch for cuBLASLt; it is never read by us.
    let workspace = unsafe { stream.alloc::<u8>(32 << 20) }.map_err(candle_core::Error::wrap)?;
    let h = Arc::new(Handle {
        raw,
        workspace,
        stream,
    });
    map.insert(key, h.clone());
    Ok(h)
}

/// A column-major GEMM `D (m x n) = op(A) (m x k) * op(B) (k x n)`.
#[derive(Clone, Copy, Debug)]
struct Gemm {
    transa: bool,
    transb: bool,
    m: u64,
    n: u64,
    k: u64,
    lda: i64,
    ldb: i64,
    ldd: i64,
}

/// What the epilogue does, with its extra device buffers.
#[derive(Clone, Copy, Debug)]
enum Ep {
    None,
    /// `D += bias` (length m), then GELU if `gelu`; writes the pre-activation
    /// to `aux` (m x n, ld m) when given.
    Bias {
        bias: CUdeviceptr,
        gelu: bool,
        aux: Option<CUdeviceptr>,
    },
    /// Writes `sum over k of B` (length n) to `bgrad`.
    BgradB {
        bgrad: CUdeviceptr,
    },
    /// `D = D * gelu'(aux)` (aux m x n, ld m), and its sum over n (length m) to `bgrad`.
    DGeluBgrad {
        aux: CUdeviceptr,
        bgrad: CUdeviceptr,
    },
}

fn data_type(dt: DType) -> Result<sys::cudaDataType> {
    match dt {
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        dt => candle_core::bail!("cuBLASLt fused GEMM takes bf16 or f16, got {dt:?}"),
    }
}

/// Owns the cuBLASLt descriptors of one call and destroys them on drop.
struct Descs {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
    pref: sys::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by `descs` and is freed once.
        unsafe {
            for l in &self.layouts {
                let _ = result::destroy_matrix_layout(*l);
            }
            let _ = result::destroy_matmul_desc(self.desc);
            let _ = result::destroy_matmul_pref(self.pref);
        }
    }
}

/// # Safety
/// `value` must point to a live `T` of the size the attribute expects.
unsafe fn set_attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe {
        result::set_matmul_desc_attribute(
            desc,
            a,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .map_err(candle_core::Error::wrap)
}

fn descs(g: &Gemm, dt: sys::cudaDataType, ep: &Ep, workspace: usize) -> Result<Descs> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let err = candle_core::Error::wrap;
    let desc = result::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType_t::CUDA_R_32F,
    )
    .map_err(err)?;
    let pref = result::create_matmul_pref().map_err(err)?;
    let mut d = Descs {
        desc,
        layouts: Vec::new(),
        pref,
    };
    let (ar, ac) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (br, bc) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    for (r, c, ld) in [(ar, ac, g.lda), (br, bc, g.ldb), (g.m, g.n, g.ldd)] {
        d.layouts
            .push(result::create_matrix_layout(dt, r, c, ld).map_err(err)?);
    }
    let (ta, tb) = (g.transa as i32, g.transb as i32);
    let (epi, bias, aux) = match *ep {
        Ep::None => (
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            None,
            None,
        ),
        Ep::Bias { bias, gelu, aux } => {
            use sys::cublasLtEpilogue_t as E;
            let e = match (gelu, aux.is_some()) {
                (false, _) => E::CUBLASLT_EPILOGUE_BIAS,
                (true, false) => E::CUBLASLT_EPILOGUE_GELU_BIAS,
                (true, true) => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            };
            (e, Some(bias), aux)
        }
        Ep::BgradB { bgrad } => (
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADB,
            Some(bgrad),
            None,
        ),
        Ep::DGeluBgrad { aux, bgrad } => (
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            Some(bgrad),
            Some(aux),
        ),
    };
    // SAFETY: each value is a live local of the type the attribute expects.
    unsafe {
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
        set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
        if let Some(b) = bias {
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b)?;
        }
        if let Some(a) = aux {
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &a)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.ldd)?;
        }
        result::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &workspace as *const usize as *const c_void,
            std::mem::size_of::<usize>(),
        )
        .map_err(err)?;
    }
    Ok(d)
}

/// Runs one GEMM; `Ok(false)` when cuBLASLt has no kernel for this epilogue
/// (nothing was launched then).
///
/// # Safety
/// `a`, `b` and `d` (and the epilogue's buffers) must be live device buffers of
/// `dt` on `h`'s stream, large enough for the sizes and leading dimensions in `g`,
/// and stay alive until the GEMM has run on that stream.
unsafe fn gemm(
    h: &Handle,
    dt: DType,
    g: Gemm,
    a: CUdeviceptr,
    b: CUdeviceptr,
    d: CUdeviceptr,
    ep: Ep,
) -> Result<bool> {
    let ds = descs(&g, data_type(dt)?, &ep, h.workspace.len())?;
    let (la, lb, ld) = (ds.layouts[0], ds.layouts[1], ds.layouts[2]);
    // SAFETY: the descriptors are live (owned by `ds`).
    let heur =
        unsafe { result::get_matmul_algo_heuristic(h.raw, ds.desc, la, lb, ld, ld, ds.pref) };
    let heur = match heur {
        Ok(x) => x,
        Err(e)
            if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                && !matches!(ep, Ep::None) =>
        {
            return Ok(false)
        }
        Err(e) => return Err(candle_core::Error::wrap(e)),
    };
    let (alpha, beta) = (1f32, 0f32);
    let (w, _w) = h.workspace.device_ptr(&h.stream);
    // SAFETY: the caller guarantees the buffers; beta = 0 so D is write-only and
    // the C operand (given as D) is never read.
    unsafe {
        result::matmul(
            h.raw,
            ds.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            a as *const c_void,
            la,
            b as *const c_void,
            lb,
            d as *const c_void,
            ld,
            d as *mut c_void,
            ld,
            &heur.algo,
            w as *mut c_void,
            h.workspace.len(),
            h.stream.cu_stream() as *mut _,
        )
    }
    .map_err(candle_core::Error::wrap)?;
    Ok(true)
}

/// Device pointers of CUDA operands of dtype `dt` (each a storage and the
/// element offset where the operand starts) and fresh outputs of the given
/// lengths; runs `f` on them while every borrow is alive, returns the outputs.
fn with_buffers<F>(
    dev: &CudaDevice,
    dt: DType,
    ins: &[(&CudaStorage, usize)],
    outs: &[usize],
    f: F,
) -> Result<Vec<CudaStorage>>
where
    F: FnOnce(&Arc<Handle>, &[CUdeviceptr], &[CUdeviceptr]) -> Result<()>,
{
    let h = handle(dev)?;
    let stream = dev.cuda_stream();
    let views = ins
        .iter()
        .map(|(cs, offset)| View::of(cs, *offset, dt))
        .collect::<Result<Vec<_>>>()?;
    let in_ptrs: Vec<_> = views.iter().map(|v| v.device_ptr(&stream)).collect();
    let mut out = Vec::with_capacity(outs.len());
    for &n in outs {
        // SAFETY: every output is written in full by the GEMM or its epilogue
        // before anything reads it (the callers' contracts).
        out.push(unsafe { alloc(dev, dt, n) }?);
    }
    {
        let out_ptrs = out
            .iter_mut()
            .map(|o| device_ptr_mut(o, &stream))
            .collect::<Result<Vec<_>>>()?;
        let a: Vec<CUdeviceptr> = in_ptrs.iter().map(|p| p.0).collect();
        let b: Vec<CUdeviceptr> = out_ptrs.iter().map(|p| p.0).collect();
        f(&h, &a, &b)?;
    }
    drop(in_ptrs);
    Ok(out)
}

type EpFn<'a> =
    &'a dyn Fn(&[CUdeviceptr], &[CUdeviceptr]) -> (CUdeviceptr, CUdeviceptr, CUdeviceptr, Ep);

/// Runs `gemm` over the operands into fresh outputs of `lens` elements;
/// `Ok(None)` when cuBLASLt had no kernel for the epilogue.
fn call_raw(
    dev: &CudaDevice,
    dt: DType,
    ins: &[(&CudaStorage, usize)],
    lens: &[usize],
    g: Gemm,
    ep: EpFn<'_>,
) -> Result<Option<Vec<CudaStorage>>> {
    data_type(dt)?;
    let mut ran = false;
    let storages = with_buffers(dev, dt, ins, lens, |h, i, o| {
        let (a, b, d, e) = ep(i, o);
        // SAFETY: the callers size every buffer for `g` (checked shapes,
        // contiguous operands), and `with_buffers` keeps them alive.
        ran = unsafe { gemm(h, dt, g, a, b, d, e) }?;
        Ok(())
    })?;
    if !ran {
        FALLBACKS.fetch_add(1, Ordering::Relaxed);
        return Ok(None);
    }
    Ok(Some(storages))
}

/// [`call_raw`] over tensors (contiguous, one dtype, one CUDA device), with the
/// outputs as tensors of the given shapes.
fn call(
    ins: &[&Tensor],
    outs: &[(Vec<usize>, usize)],
    g: Gemm,
    ep: EpFn<'_>,
) -> Result<Option<Vec<Tensor>>> {
    let dev = match ins[0].device() {
        candle_core::Device::Cuda(d) => d.clone(),
        d => candle_core::bail!(
            "cuBLASLt fused GEMM needs a CUDA device, got {:?}",
            d.location()
        ),
    };
    let guards: Vec<_> = ins.iter().map(|t| t.storage_and_layout()).collect();
    let mut ops = Vec::with_capacity(ins.len());
    for (st, l) in &guards {
        let Storage::Cuda(cs) = &**st else {
            candle_core::bail!("cuBLASLt fused GEMM: every operand must be on the GPU");
        };
        ops.push((cs, l.start_offset()));
    }
    let lens: Vec<usize> = outs.iter().map(|o| o.1).collect();
    let Some(storages) = call_raw(&dev, ins[0].dtype(), &ops, &lens, g, ep)? else {
        return Ok(None);
    };
    drop(guards);
    let ts = storages
        .into_iter()
        .zip(outs)
        .map(|(s, (shape, _))| {
            Tensor::from_storage(Storage::Cuda(s), shape.clone(), BackpropOp::none(), false)
        })
        .collect();
    Ok(Some(ts))
}

/// The forward GEMM on raw operands, for custom ops: `epilogue(x W^T + b)` with
/// `x (n, k)`, `w (m, k)`, `b (m,)` as (storage, offset); with `keep_z` (GELU
/// only) also the pre-activation. Falls back to a second GEMM for `z` when the
/// aux epilogue is missing.
#[allow(clippy::too_many_arguments)] // the GEMM's operands, shape and epilogue flags
pub(crate) fn linear_raw(
    dev: &CudaDevice,
    dt: DType,
    x: (&CudaStorage, usize),
    w: (&CudaStorage, usize),
    b: (&CudaStorage, usize),
    (n, m, k): (usize, usize, usize),
    gelu: bool,
    keep_z: bool,
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let g = forward_gemm(n, m, k);
    let keep = gelu && keep_z;
    let lens: &[usize] = if keep { &[n * m, n * m] } else { &[n * m] };
    // Operands [x, w, b], outputs [y] or [y, z].
    let bias_ep = |gelu: bool, keep: bool| {
        move |i: &[CUdeviceptr], o: &[CUdeviceptr]| {
            let aux = keep.then(|| o[1]);
            (
                i[1],
                i[0],
                o[0],
                Ep::Bias {
                    bias: i[2],
                    gelu,
                    aux,
                },
            )
        }
    };
    if let Some(mut s) = call_raw(dev, dt, &[x, w, b], lens, g, &bias_ep(gelu, keep))? {
        let z = keep.then(|| s.swap_remove(1));
        return Ok((s.swap_remove(0), z));
    }
    let run = |gelu| -> Result<CudaStorage> {
        let s = call_raw(dev, dt, &[x, w, b], &[n * m], g, &bias_ep(gelu, false))?;
        s.map(|mut s| s.swap_remove(0)).ok_or_else(|| {
            candle_core::Error::Msg("cuBLASLt has no bias epilogue for this GEMM".into())
        })
    };
    Ok((run(true)?, Some(run(false)?)))
}

/// Column-major: D (m x n) = W (stored k x m, transposed) * X^T (stored k x n).
fn forward_gemm(n: usize, m: usize, k: usize) -> Gemm {
    Gemm {
        transa: true,
        transb: false,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        lda: k as i64,
        ldb: k as i64,
        ldd: m as i64,
    }
}

fn dims2(t: &Tensor, what: &str) -> Result<(usize, usize)> {
    if !t.is_contiguous() {
        candle_core::bail!(
            "cuBLASLt fused GEMM: {what} {:?} must be contiguous",
            t.dims()
        );
    }
    t.dims2()
}

/// `g^T a` for `g (n, m)`, `a (n, k)`: the weight gradient `(m, k)` of a linear
/// layer with input `a` and output gradient `g`; with `bias`, also `sum_rows(g)`.
pub fn weight_grad(g: &Tensor, a: &Tensor, bias: bool) -> Result<(Tensor, Option<Tensor>)> {
    let (n, m) = dims2(g, "output gradient")?;
    let (_, k) = dims2(a, "layer input")?;
    // Column-major: dW^T (k x m) = A (stored k x n) * G (stored m x n, transposed).
    let gm = Gemm {
        transa: false,
        transb: true,
        m: k as u64,
        n: m as u64,
        k: n as u64,
        lda: k as i64,
        ldb: m as i64,
        ldd: k as i64,
    };
    let mut outs = vec![(vec![m, k], m * k)];
    if bias {
        outs.push((vec![m], m));
    }
    let ep = |i: &[CUdeviceptr], o: &[CUdeviceptr]| {
        let e = if bias {
            Ep::BgradB { bgrad: o[1] }
        } else {
            Ep::None
        };
        (i[1], i[0], o[0], e)
    };
    if let Some(mut t) = call(&[g, a], &outs, gm, &ep)? {
        let db = bias.then(|| t.swap_remove(1));
        return Ok((t.swap_remove(0), db));
    }
    let dw = call(&[g, a], &outs[..1], gm, &|i, o| {
        (i[1], i[0], o[0], Ep::None)
    })?
    .expect("plain GEMMs always run")
    .swap_remove(0);
    Ok((
        dw,
        Some(g.to_dtype(DType::F32)?.sum(0)?.to_dtype(g.dtype())?),
    ))
}

/// `g W` for `g (n, m)`, `w (m, k)`: the input gradient `(n, k)` of a linear
/// layer. With `gelu_input = Some(z)` (`z (n, k)`, the GELU's input that
/// produced this layer's input) it is `(g W) * gelu'(z)`, returned with its
/// row sum (the bias gradient of the layer that produced `z`).
pub fn input_grad(
    g: &Tensor,
    w: &Tensor,
    gelu_input: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (n, m) = dims2(g, "output gradient")?;
    let (_, k) = dims2(w, "weight")?;
    if let Some(z) = gelu_input {
        if dims2(z, "GELU input")? != (n, k) {
            candle_core::bail!("GELU input {:?} must be ({n}, {k})", z.dims());
        }
    }
    // Column-major: dX^T (k x n) = W (stored k x m) * G^T (stored m x n).
    let gm = Gemm {
        transa: false,
        transb: false,
        m: k as u64,
        n: n as u64,
        k: m as u64,
        lda: k as i64,
        ldb: m as i64,
        ldd: k as i64,
    };
    let Some(z) = gelu_input else {
        let dx = call(&[g, w], &[(vec![n, k], n * k)], gm, &|i, o| {
            (i[1], i[0], o[0], Ep::None)
        })?;
        return Ok((dx.expect("plain GEMMs always run").swap_remove(0), None));
    };
    let outs = [(vec![n, k], n * k), (vec![k], k)];
    let ep = |i: &[CUdeviceptr], o: &[CUdeviceptr]| {
        (
            i[1],
            i[0],
            o[0],
            Ep::DGeluBgrad {
                aux: i[2],
                bgrad: o[1],
            },
        )
    };
    if let Some(mut t) = call(&[g, w, z], &outs, gm, &ep)? {
        let db = t.swap_remove(1);
        return Ok((t.swap_remove(0), Some(db)));
    }
    let dh = call(&[g, w], &outs[..1], gm, &|i, o| {
        (i[1], i[0], o[0], Ep::None)
    })?
    .expect("plain GEMMs always run")
    .swap_remove(0);
    let dz = (dh.to_dtype(DType::F32)? * super::gelu::gelu_grad(z)?)?;
    let db = dz.sum(0)?.to_dtype(g.dtype())?;
    Ok((dz.to_dtype(g.dtype())?, Some(db)))
}

/// [`linear_raw`] over tensors: `epilogue(x W^T + b)` for `x (n, k)`,
/// `w (m, k)`, `b (m,)`, and with `keep_z` (GELU only) the pre-activation.
pub fn linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    gelu: bool,
    keep_z: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (n, k) = dims2(x, "input")?;
    let (m, _) = dims2(w, "weight")?;
    let dev = match x.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        d => candle_core::bail!(
            "cuBLASLt fused GEMM needs a CUDA device, got {:?}",
            d.location()
        ),
    };
    let (gx, lx) = x.storage_and_layout();
    let (gw, lw) = w.storage_and_layout();
    let (gb, lb) = b.storage_and_layout();
    let (Storage::Cuda(sx), Storage::Cuda(sw), Storage::Cuda(sb)) = (&*gx, &*gw, &*gb) else {
        candle_core::bail!("cuBLASLt fused GEMM: every operand must be on the GPU");
    };
    let ops = (
        (sx, lx.start_offset()),
        (sw, lw.start_offset()),
        (sb, lb.start_offset()),
    );
    let (y, z) = linear_raw(
        &dev,
        x.dtype(),
        ops.0,
        ops.1,
        ops.2,
        (n, m, k),
        gelu,
        keep_z,
    )?;
    let wrap = |s| Tensor::from_storage(Storage::Cuda(s), (n, m), BackpropOp::none(), false);
    Ok((wrap(y), z.map(wrap)))
}
