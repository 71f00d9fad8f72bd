//! CUDA launches of the kernels in `kernels/src/attention.cu` (module
//! [`streamer_kernels::ATTENTION`]), on the compute stream of the inputs'
//! Candle device.
//!
//! Forward: on a GPU of compute capability 9.0 (H100, H200) with kernels built
//! for it, the Hopper kernel `cqsa_fwd_hopper_{f16,bf16}_d{64,128,256}`
//! ([`crate::hopper`]: `wgmma` and TMA) when the dtype is f16/bf16, the head dim
//! 64, 128 or 256 and every input 16-byte aligned, unless
//! [`crate::set_hopper_kernels`] turned it off; else the portable tensor-core
//! kernel `cqsa_fwd_mma_{f16,bf16}_d{64,128}` under the same conditions (head dim
//! 64 or 128); the simple kernel `cqsa_fwd_simple_*` (f32 arithmetic, any head
//! dim up to 256) otherwise. Backward: `cqsa_bwd_delta_*`, then the Hopper
//! `cqsa_bwd_hopper_*` (head dims 64 and 128; dq summed in f32 by bulk
//! reduce-adds) under the forward's Hopper conditions, else the tensor-core
//! `cqsa_bwd_mma_*` (dq accumulated in an f32 buffer with atomics, then
//! `cqsa_bwd_dq_convert_*`), otherwise `cqsa_bwd_dq_simple_*` and
//! `cqsa_bwd_dkdv_simple_*`. With
//! soft-capping the tensor-core kernels are the `*_cap_*` instances (so the plain
//! ones carry none of it); every kernel takes the band `(lo, hi)` of [`Scores`]
//! (see `KernelArgs`).
//!
//! The tensor-core kernels take dynamic shared memory, some of them more than the
//! 48 KiB default: [`allow_smem`] raises the function's limit first. The byte counts
//! here mirror `FwdCfg`/`BwdCfg` in the kernel, which traps if launched with less.
//!
//! Ordering: every launch of one call goes to the compute stream of the inputs'
//! Candle device, so the launches are ordered among themselves and with the
//! stream-ordered frees of cudarc, whether or not the context tracks per-slice
//! events (cudarc's default; a caller may opt out with
//! `streamer_core::disable_cuda_event_tracking`). Every device view passed to
//! a launch is a local borrowed by the launch builder, so it outlives the launch.
use candle_core::backend::BackendStorage;
use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, DType, Layout, Result, Storage, Tensor,
};
use half::{bf16, f16};
use streamer_device::pages::{alloc_readable, page_pieces, PinnedRegion};
use streamer_kernels::ATTENTION;

use crate::launch::{allow_smem, grid, Backward, BwdInputs, KernelArgs};
use crate::packed::Fused;
use crate::segs::Segs;
use crate::{AttentionShape, Scores};

/// Rows handled by one block of the simple kernels (one warp per row).
const SIMPLE_WARPS: u32 = 4;
/// Query rows per block of the tensor-core forward (`FwdCfg::BR`: 4 warps of 32 rows).
const MMA_ROWS: usize = 128;
/// Keys per tile of the tensor-core forward.
const MMA_KEYS: usize = 64;
/// Threads per block of the tensor-core forward.
const MMA_THREADS: u32 = 128;
/// Shared-memory row padding of the tensor-core kernels (elements).
const MMA_PAD: usize = 8;

/// Dynamic shared memory of `cqsa_fwd_mma_*_d{d}`: the Q tile and two stages of
/// K and V tiles (`FwdCfg` in the kernel).
fn fwd_smem(d: usize) -> u32 {
    ((MMA_ROWS + 2 * 2 * MMA_KEYS) * (d + MMA_PAD) * 2) as u32
}

/// Warps per block of `cqsa_bwd_mma_*_d{d}` (`BwdCfg::WARPS`); each owns 16 keys.
fn bwd_warps(d: usize) -> usize {
    if d <= 64 {
        4
    } else {
        8
    }
}

/// Keys per block of `cqsa_bwd_mma_*_d{d}` (`BwdCfg::BC`).
fn bwd_keys(d: usize) -> usize {
    16 * bwd_warps(d)
}

/// Threads per block of `cqsa_bwd_mma_*_d{d}` (`BwdCfg::THREADS`).
fn bwd_threads(d: usize) -> u32 {
    32 * bwd_warps(d) as u32
}

/// Query rows per tile of `cqsa_bwd_mma_*_d{d}` (`BwdCfg::BQ`).
fn bwd_rows(d: usize) -> usize {
    if d <= 64 {
        64
    } else {
        32
    }
}

/// Dynamic shared memory of `cqsa_bwd_mma_*_d{d}` (`BwdCfg::SMEM`): K and V of the
/// block, two stages of Q and dO tiles, the dS tile, and two stages of f32 lse and
/// delta of a query tile.
fn bwd_smem(d: usize) -> u32 {
    let (bc, bq) = (bwd_keys(d), bwd_rows(d));
    let (ld, lds) = (d + MMA_PAD, bc + MMA_PAD);
    ((2 * bc * ld + 4 * bq * ld + bq * lds) * 2 + 4 * bq * 4) as u32
}

/// Whether the tensor-core kernels apply: f16/bf16, head dim 64 or 128, and every
/// element offset a multiple of 8 (16-byte vector loads).
fn use_mma(dtype: DType, d: usize, offsets: &[usize]) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
        && matches!(d, 64 | 128)
        && offsets.iter().all(|a| a % 8 == 0)
}

fn suffix(dtype: DType) -> Result<&'static str> {
    streamer_device::kernel_suffix(dtype, "cqsa attention")
}

/// The contiguous part of `s` described by `l`, and its element offset.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<(CudaView<'a, T>, usize)> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("cqsa: cuda input must be contiguous, got layout {l:?}")
    };
    Ok((s.as_cuda_slice::<T>()?.slice(a..b), a))
}

/// The portable forward kernels (see the module docs for when each applies).
#[derive(Clone, Copy, PartialEq)]
enum Forward {
    Mma,
    Simple,
}

/// The name of the portable forward kernel of `family` for this call, and its
/// launch shape.
fn forward_kernel(
    dims: &AttentionShape,
    args: &KernelArgs,
    sfx: &str,
    family: Forward,
) -> Result<(String, LaunchConfig)> {
    let AttentionShape { b, hq, nq, d, .. } = *dims;
    let cap = args.cap_infix();
    let (name, rows, threads, smem) = match family {
        Forward::Mma => (
            format!("cqsa_fwd_mma_{cap}{sfx}_d{d}"),
            MMA_ROWS,
            MMA_THREADS,
            fwd_smem(d),
        ),
        Forward::Simple => (
            format!("cqsa_fwd_simple_{sfx}"),
            SIMPLE_WARPS as usize,
            32 * SIMPLE_WARPS,
            0,
        ),
    };
    let cfg = LaunchConfig {
        grid_dim: grid(nq.div_ceil(rows), hq, b)?,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    Ok((name, cfg))
}

/// Calls `$f::<T>(args)` with `T` the Rust type of the attention dtype
/// `$dtype` (f32, f16, bf16: the dtypes the CUDA kernels are built for).
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($a:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($a),*),
            DType::F16 => $f::<f16>($($a),*),
            DType::BF16 => $f::<bf16>($($a),*),
            other => bail!("cqsa: no CUDA attention kernel for dtype {other:?}"),
        }
    };
}

/// Forward: returns the output (dtype of q) and the f32 log-sum-exp `(b, hq, nq)`.
/// A packed call (`packed`, whose bands replace `sc`'s) is one launch of the
/// tensor-core kernels, Hopper or portable (`varlen::fused` chose it where
/// they serve: f16/bf16 at head dims 64 and 128).
pub(crate) fn forward(
    t: [(&CudaStorage, &Layout); 3],
    dims: &AttentionShape,
    p: (&Scores, Option<&Fused>),
) -> Result<(CudaStorage, CudaStorage)> {
    by_dtype!(t[0].0.dtype(), forward_t(t, dims, p))
}

fn forward_t<T: CudaDType + DeviceRepr>(
    [q, k, v]: [(&CudaStorage, &Layout); 3],
    dims: &AttentionShape,
    (sc, packed): (&Scores, Option<&Fused>),
) -> Result<(CudaStorage, CudaStorage)> {
    let dev: &CudaDevice = q.0.device();
    let dtype = q.0.dtype();
    let sfx = suffix(dtype)?;
    let (qv, qa) = view::<T>(q.0, q.1)?;
    let (kv, ka) = view::<T>(k.0, k.1)?;
    let (vv, va) = view::<T>(v.0, v.1)?;
    let AttentionShape { b, hq, nq, d, .. } = *dims;
    // SAFETY (uninitialised): both kernels below write every row of `out` and
    // `lse`, a row that sees no key included (0 and -inf); sizes are > 0
    // (`AttentionShape::check`). Zeroing first would cost a memset of the output
    // per call.
    let mut out: CudaSlice<T> = unsafe { dev.alloc::<T>(b * hq * nq * d) }?;
    let mut lse: CudaSlice<f32> = unsafe { dev.alloc::<f32>(b * hq * nq) }?;
    let args = KernelArgs::new(dims, sc)?;
    let outputs = (&mut out, &mut lse);
    if crate::hopper::applies(dev, dtype, d, &[qa, ka, va], false)? {
        crate::hopper::forward(dev, (&qv, &kv, &vv), outputs, dims, &args, (sfx, packed))?;
    } else {
        let mma = use_mma(dtype, d, &[qa, ka, va]);
        let kernel = Portable { sfx, mma, packed };
        portable_forward(dev, (&qv, &kv, &vv), outputs, dims, &args, kernel)?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev.clone()),
    ))
}

/// Which portable forward runs: the tensor-core kernel when `mma`, else the
/// simple one; a packed call (`packed`) needs the tensor-core kernel.
struct Portable<'a> {
    sfx: &'a str,
    mma: bool,
    packed: Option<&'a Fused>,
}

/// The error of a packed call that no one-launch kernel serves (`varlen::fused`
/// chooses one launch for f16/bf16 at head dims 64 and 128 only).
fn packed_unserved() -> candle_core::Error {
    candle_core::Error::Msg(
        "cqsa: a packed (varlen) call in one launch needs the tensor-core kernels (f16/bf16, head dim 64 or 128)".into(),
    )
}

/// Launches the portable forward (see [`Portable`]); a packed call is one
/// launch of the tensor-core kernel, a block per query block of each document.
fn portable_forward<T: DeviceRepr>(
    dev: &CudaDevice,
    (qv, kv, vv): (&CudaView<'_, T>, &CudaView<'_, T>, &CudaView<'_, T>),
    (out, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    dims: &AttentionShape,
    args: &KernelArgs,
    Portable { sfx, mma, packed }: Portable<'_>,
) -> Result<()> {
    if packed.is_some() && !mma {
        return Err(packed_unserved());
    }
    let family = if mma { Forward::Mma } else { Forward::Simple };
    let (name, mut cfg) = forward_kernel(dims, args, sfx, family)?;
    let segs = packed
        .map(|f| Segs::forward(dev, f, (MMA_ROWS, MMA_KEYS)))
        .transpose()?;
    if let Some(s) = &segs {
        cfg.grid_dim = grid(s.blocks, dims.hq, dims.b)?;
    }
    let func = streamer_kernels::function(dev, &ATTENTION, &name)?;
    allow_smem(&func, cfg.shared_mem_bytes)?;
    if cfg.grid_dim.0 == 0 {
        return Ok(());
    }
    let null = 0u64;
    {
        let mut builder = func.builder();
        builder.arg(qv).arg(kv).arg(vv).arg(out).arg(lse);
        args.push(&mut builder, family == Forward::Simple);
        if family == Forward::Mma {
            match &segs {
                Some(s) => builder.arg(&s.table),
                None => builder.arg(&null),
            };
        }
        // SAFETY: the kernel reads b*hq*nq*d / b*hkv*nk*d elements of the views
        // (their exact lengths), writes b*hq*nq*d of `out` and b*hq*nq of `lse`;
        // argument types and order match the kernel's signature (`KernelArgs`,
        // then for the tensor-core kernel its Segs: null, or a packed call's,
        // which cover every row once);
        // the tensor-core kernel gets FwdCfg::SMEM of dynamic shared memory (it
        // traps on less) and 16-byte aligned inputs (`use_mma`), the simple one
        // d <= 256 (checked by `AttentionShape::check`: it keeps at most 8
        // elements per lane); every view lives past the launch.
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(())
}

/// Backward: inputs `[q, k, v, o, grad_o, lse]`; returns `(dq, dk, dv)` in the
/// dtype of q.
/// A packed call (`packed`) is one launch of the tensor-core kernels, as in
/// [`forward`].
pub(crate) fn backward(
    t: [(&CudaStorage, &Layout); 6],
    dims: &AttentionShape,
    p: (&Scores, Option<&Fused>),
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    by_dtype!(t[0].0.dtype(), backward_t(t, dims, p))
}

fn backward_t<'a, T: CudaDType + DeviceRepr>(
    t: [(&'a CudaStorage, &Layout); 6],
    dims: &AttentionShape,
    (sc, packed): (&Scores, Option<&'a Fused>),
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dev: &CudaDevice = t[0].0.device();
    let dtype = t[0].0.dtype();
    let (qv, qa) = view::<T>(t[0].0, t[0].1)?;
    let (kv, ka) = view::<T>(t[1].0, t[1].1)?;
    let (vv, va) = view::<T>(t[2].0, t[2].1)?;
    let (ov, _) = view::<T>(t[3].0, t[3].1)?;
    let (gv, ga) = view::<T>(t[4].0, t[4].1)?;
    let (lv, _) = view::<f32>(t[5].0, t[5].1)?;
    let AttentionShape {
        b,
        hq,
        hkv,
        nq,
        nk,
        d,
        ..
    } = *dims;
    let rows = b * hq * nq;
    // SAFETY (uninitialised): every element is written before it is read: delta by
    // the delta kernel (every row), dq by a conversion or the simple dq kernel
    // (every row), dk and dv by the backward kernels (every key, a key no query
    // sees included); sizes are > 0 (`AttentionShape::check`). Only the f32 dq
    // accumulators (allocated where used) need zeros.
    let mut bw = Backward {
        dev,
        sfx: suffix(dtype)?,
        dims: *dims,
        args: KernelArgs::new(dims, sc)?,
        packed,
        inputs: BwdInputs {
            q: qv,
            k: kv,
            v: vv,
            g: gv,
            lse: lv,
            delta: unsafe { dev.alloc::<f32>(rows) }?,
        },
        dq: unsafe { dev.alloc::<T>(rows * d) }?,
        dk: unsafe { dev.alloc::<T>(b * hkv * nk * d) }?,
        dv: unsafe { dev.alloc::<T>(b * hkv * nk * d) }?,
    };
    bw.delta(&ov)?;
    if crate::hopper::applies(dev, dtype, d, &[qa, ka, va, ga], true)? {
        crate::hopper::backward(&mut bw)?;
    } else if use_mma(dtype, d, &[qa, ka, va, ga]) {
        bw.mma()?;
    } else if packed.is_some() {
        return Err(packed_unserved());
    } else {
        bw.simple()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(bw.dq, dev.clone()),
        CudaStorage::wrap_cuda_slice(bw.dk, dev.clone()),
        CudaStorage::wrap_cuda_slice(bw.dv, dev.clone()),
    ))
}

impl<T: CudaDType + DeviceRepr> Backward<'_, T> {
    /// The attention module's kernel `name`, loaded on this call's device.
    fn kernel(&self, name: &str) -> Result<streamer_kernels::Kernel> {
        streamer_kernels::function(self.dev, &ATTENTION, name)
    }

    /// `delta = rowsum(do * o)`, one warp per row.
    fn delta(&mut self, o: &CudaView<'_, T>) -> Result<()> {
        let rows = self.dims.b * self.dims.hq * self.dims.nq;
        let func = self.kernel(&format!("cqsa_bwd_delta_{}", self.sfx))?;
        let cfg = LaunchConfig {
            grid_dim: grid(rows.div_ceil(SIMPLE_WARPS as usize), 1, 1)?,
            block_dim: (32 * SIMPLE_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows_ = rows as i64;
        let mut builder = func.builder();
        builder
            .arg(o)
            .arg(&self.inputs.g)
            .arg(&mut self.inputs.delta)
            .arg(&rows_)
            .arg(&self.args.d);
        // SAFETY: reads rows*d elements of o and grad_o, writes rows of delta; views live.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }

    /// The tensor-core backward (dq through an f32 accumulator and atomics), then
    /// the conversion of dq.
    fn mma(&mut self) -> Result<()> {
        let AttentionShape { b, hkv, nk, d, .. } = self.dims;
        let n = self.dims.b * self.dims.hq * self.dims.nq * d;
        let mut dq_acc: CudaSlice<f32> = self.dev.alloc_zeros::<f32>(n)?;
        let smem = bwd_smem(d);
        let func = self.kernel(&format!(
            "cqsa_bwd_mma_{}{}_d{d}",
            self.args.cap_infix(),
            self.sfx
        ))?;
        allow_smem(&func, smem)?;
        let segs = self
            .packed
            .map(|f| Segs::backward(self.dev, f, bwd_keys(d), None))
            .transpose()?
            .map(|s| s.0);
        let blocks = segs.as_ref().map_or(nk.div_ceil(bwd_keys(d)), |s| s.blocks);
        let cfg = LaunchConfig {
            grid_dim: grid(blocks, hkv, b)?,
            block_dim: (bwd_threads(d), 1, 1),
            shared_mem_bytes: smem,
        };
        let null = 0u64;
        if blocks > 0 {
            let mut builder = func.builder();
            self.inputs.push(&mut builder);
            builder.arg(&mut dq_acc).arg(&mut self.dk).arg(&mut self.dv);
            self.args.push(&mut builder, false);
            match &segs {
                Some(s) => builder.arg(&s.table),
                None => builder.arg(&null),
            };
            // SAFETY: reads b*hq*nq*d of q and grad_o, b*hkv*nk*d of k and v, rows of
            // lse and delta (the views' lengths); adds into rows*d f32 of dq_acc and
            // writes b*hkv*nk*d of dk and dv (a packed call's Segs cover every key
            // once); every offset is a multiple of 8 elements (checked by `use_mma`);
            // the dynamic shared memory is BwdCfg::SMEM; the argument types match
            // the kernel (segs: null or `blocks` Segs); every view lives past the launch.
            unsafe { builder.launch(cfg) }.w()?;
        }
        let func = self.kernel(&format!("cqsa_bwd_dq_convert_{}", self.sfx))?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).min(65536) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n_ = n as i64;
        let mut builder = func.builder();
        builder
            .arg(&dq_acc)
            .arg(&mut self.dq)
            .arg(&n_)
            .arg(&self.args.scale);
        // SAFETY: reads and writes n = rows*d elements (both buffers' lengths),
        // grid-stride loop; dq_acc lives past the launch (freed stream-ordered).
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }

    /// The simple kernels: dq by query rows, dk and dv by key rows.
    fn simple(&mut self) -> Result<()> {
        let AttentionShape {
            hq, hkv, nq, nk, ..
        } = self.dims;
        let (func, cfg) = self.simple_kernel("dq", nq, hq)?;
        {
            let mut builder = func.builder();
            self.inputs.push(&mut builder);
            builder.arg(&mut self.dq);
            self.args.push(&mut builder, true);
            // SAFETY: reads within the views' lengths, writes rows*d of dq; views live.
            unsafe { builder.launch(cfg) }.w()?;
        }
        let (func, cfg) = self.simple_kernel("dkdv", nk, hkv)?;
        let mut builder = func.builder();
        self.inputs.push(&mut builder);
        builder.arg(&mut self.dk).arg(&mut self.dv);
        self.args.push(&mut builder, true);
        // SAFETY: reads within the views' lengths, writes b*hkv*nk*d of dk and dv;
        // views live.
        unsafe { builder.launch(cfg) }.w()?;
        Ok(())
    }

    /// The simple kernel `cqsa_bwd_<what>_simple_<sfx>` and its launch shape:
    /// a warp a row of `rows` rows of each of `heads` heads.
    fn simple_kernel(
        &self,
        what: &str,
        rows: usize,
        heads: usize,
    ) -> Result<(streamer_kernels::Kernel, LaunchConfig)> {
        let name = format!("cqsa_bwd_{what}_simple_{}", self.sfx);
        let func = self.kernel(&name)?;
        let cfg = LaunchConfig {
            grid_dim: grid(rows.div_ceil(SIMPLE_WARPS as usize), heads, self.dims.b)?,
            block_dim: (32 * SIMPLE_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok((func, cfg))
    }
}

/// Host-to-device copies of row chunks for the streamed mode, on a transfer stream
/// of their own so that they overlap the attention kernels on the compute stream,
/// and device-to-host copies of result chunks, on a third stream.
///
/// The host tensors' memory is page-locked in place with `cuMemHostRegister` (so
/// the copies are asynchronous DMA) and unregistered when the feed is finished or
/// dropped. Ordering is explicit, never left to cudarc's per-slice event tracking
/// (which the caller may have turned off): a chunk's buffer is allocated on the compute
/// stream, an event recorded there makes the transfer stream wait for the
/// allocation, the copies run on the transfer stream, and an event recorded after
/// them is what the compute stream waits on before the chunk's first use
/// ([`Fetched::ready`]). The buffer is freed stream-ordered on the compute stream,
/// after its last kernel.
///
/// Results go the other way ([`ChunkFeed::drain`]): an event recorded on the
/// compute stream after the kernels that produce a chunk makes the drain stream
/// wait, the chunk is copied into a reused page-locked staging buffer, and an event
/// recorded after the copy tells the host when the data is there
/// ([`ChunkFeed::receive`]). The drain stream is not the transfer stream, so the
/// next inputs' copies are never queued behind a result's.
pub(crate) struct ChunkFeed<'a> {
    dev: CudaDevice,
    compute: std::sync::Arc<CudaStream>,
    transfer: std::sync::Arc<CudaStream>,
    /// Device-to-host copies of results.
    drain_stream: std::sync::Arc<CudaStream>,
    /// Idle page-locked staging buffers for results, reused within the call
    /// (each kind of result, one size, ends up with as many as it had in flight
    /// at once, two when each result is received one subproblem after its
    /// drain) and given to the cache ([`crate::staging`]) at its end.
    staging: Vec<PinnedHostSlice<f32>>,
    /// Host pages this feed page-locked (unregistered at the end).
    registered: Vec<PinnedRegion>,
    /// Whether `release` already ran.
    released: bool,
    /// Where the host thread's time went (`CQSA_VERBOSE` prints it).
    pub(crate) times: HostTimes,
    /// The host memory read by copies in flight lives at least as long as `'a`.
    _host: std::marker::PhantomData<&'a CpuStorage>,
}

/// Seconds the host thread of a streamed call spent on each kind of work
/// outside issuing kernels (what the planner's time model must account for).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HostTimes {
    /// Page-locking the inputs in place.
    pub register: f64,
    /// Allocating page-locked staging buffers, and their bytes.
    pub staging: f64,
    pub staged_bytes: usize,
    /// Waiting for results' copies (the device's compute included).
    pub wait: f64,
    /// Landing results in the host's buffers.
    pub land: f64,
    /// Waiting for the last copies, unlocking the inputs, caching (or freeing)
    /// the staging.
    pub release: f64,
}

impl std::fmt::Display for HostTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "page-locking {:.3} s, staging {:.3} s ({:.2} GiB), waiting for results {:.3} s, \
             landing {:.3} s, release {:.3} s",
            self.register,
            self.staging,
            self.staged_bytes as f64 / (1u64 << 30) as f64,
            self.wait,
            self.land,
            self.release
        )
    }
}

/// A chunk whose copy was issued: the tensor and the event that marks the end of
/// its copy on the transfer stream.
pub(crate) struct Fetched {
    tensor: Tensor,
    copied: CudaEvent,
}

impl Fetched {
    /// Makes the compute stream wait for the copy and returns the chunk.
    pub(crate) fn ready(self, feed: &ChunkFeed<'_>) -> Result<Tensor> {
        feed.compute.wait(&self.copied).w()?;
        Ok(self.tensor)
    }
}

impl<'a> ChunkFeed<'a> {
    /// A feed onto `dev`, page-locking the memory of `sources` (contiguous host
    /// storages that outlive the feed). A storage that cannot be registered (or is
    /// already registered elsewhere) is still copied correctly, only without overlap.
    pub(crate) fn new(dev: &CudaDevice, sources: &[&'a CpuStorage]) -> Result<Self> {
        crate::staging::cap_bytes()?; // a bad cap is an error before any work
        let compute = dev.cuda_stream();
        let transfer = compute.context().new_stream().w()?;
        let drain_stream = compute.context().new_stream().w()?;
        let mut feed = Self {
            dev: dev.clone(),
            compute,
            transfer,
            drain_stream,
            staging: Vec::new(),
            registered: Vec::new(),
            released: false,
            times: HostTimes::default(),
            _host: std::marker::PhantomData,
        };
        let t = std::time::Instant::now();
        for s in sources {
            let (ptr, bytes) = host_span(s)?;
            // Only the whole pages inside the storage are registered (OS page
            // size; see `streamer_device::pages`).
            // SAFETY: `ptr..ptr + bytes` is the live allocation of a host storage
            // borrowed for 'a; the region is dropped in `release` (from `finish`
            // or `drop`), so before the borrow ends.
            let pin =
                unsafe { PinnedRegion::register(feed.compute.context(), ptr as *mut u8, bytes)? };
            feed.registered.extend(pin);
        }
        feed.times.register = t.elapsed().as_secs_f64();
        Ok(feed)
    }

    /// Issues the copy of rows `r0..r1` of every (batch, head) of the contiguous
    /// `(b, h, n, d)` host storage `s` into a new device tensor `(b, h, r1 - r0, d)`.
    pub(crate) fn fetch(
        &self,
        s: &'a CpuStorage,
        l: &Layout,
        r0: usize,
        r1: usize,
    ) -> Result<Fetched> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("cqsa: streamed input must be contiguous, got layout {l:?}")
        };
        match s {
            CpuStorage::F32(v) => self.fetch_t(&v[start..end], l, r0, r1),
            CpuStorage::F16(v) => self.fetch_t(&v[start..end], l, r0, r1),
            CpuStorage::BF16(v) => self.fetch_t(&v[start..end], l, r0, r1),
            other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
        }
    }

    fn fetch_t<T: CudaDType + DeviceRepr>(
        &self,
        v: &'a [T],
        l: &Layout,
        r0: usize,
        r1: usize,
    ) -> Result<Fetched> {
        let (b, h, n, d) = l.shape().dims4()?;
        if r0 > r1 || r1 > n || v.len() != b * h * n * d {
            bail!(
                "cqsa: chunk rows {r0}..{r1} out of range for shape {:?}",
                l.dims()
            )
        }
        let c = r1 - r0;
        let e = std::mem::size_of::<T>();
        // SAFETY: every element is written by the copies below, and the compute
        // stream waits for them (`Fetched::ready`) before any kernel reads it.
        let mut slice = unsafe { self.compute.alloc::<T>(b * h * c * d) }.w()?;
        let allocated = self.compute.record_event(None).w()?;
        self.transfer.wait(&allocated).w()?;
        {
            let (dst, _record) = slice.device_ptr_mut(&self.transfer);
            for x in 0..b * h {
                let src = &v[(x * n + r0) * d..(x * n + r1) * d];
                // SAFETY: the destination range `x*c*d..(x+1)*c*d` lies inside the
                // new allocation of b*h*c*d elements; the source is host memory
                // borrowed for 'a, which outlives the copy because `finish`/`drop`
                // synchronize the transfer stream before the feed goes away.
                // A copy may not span registered and unregistered pages: copy the
                // whole pages and the partial ends separately.
                let base = src.as_ptr() as usize;
                for (off, len, _) in page_pieces(base, std::mem::size_of_val(src)) {
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dst + (x * c * d * e + off) as u64,
                            (base + off) as *const c_void,
                            len,
                            self.transfer.cu_stream(),
                        )
                    }
                    .result()
                    .w()?;
                }
            }
        }
        let copied = self.transfer.record_event(None).w()?;
        let tensor = streamer_device::slice_tensor(slice, &self.dev, (b, h, c, d));
        Ok(Fetched { tensor, copied })
    }

    /// Issues the copy of `chunk` (a contiguous f32 tensor on this feed's device,
    /// produced by kernels already issued on the compute stream) back to host
    /// memory; [`ChunkFeed::receive`] waits for it and hands over the data.
    pub(crate) fn drain(&mut self, chunk: &Tensor) -> Result<Drained> {
        let len = chunk.elem_count();
        let (storage, layout) = chunk.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            bail!("cqsa: a drained chunk must be on the CUDA device")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("cqsa: a drained chunk must be contiguous, got layout {layout:?}")
        };
        let slice = cuda.as_cuda_slice::<f32>()?;
        if end - start != len || end > slice.len() {
            bail!("cqsa: drained chunk layout {layout:?} does not match its storage")
        }
        let mut staging = self.take_staging(len)?;
        let dst = staging.as_mut_ptr().w()?;
        let produced = self.compute.record_event(None).w()?;
        self.drain_stream.wait(&produced).w()?;
        {
            let (src, _record) = slice.device_ptr(&self.drain_stream);
            // SAFETY: the source `start..end` lies inside the chunk's allocation,
            // which stays alive until the copy is over (`Drained` keeps the tensor
            // and waits for `done` before dropping it); the destination holds at
            // least `len` f32s and is owned by the `Drained` that waits for `done`
            // before it is reused or freed. The drain stream waits for the
            // producing kernels (`produced`) before the copy starts.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst as *mut c_void,
                    src + (start * std::mem::size_of::<f32>()) as u64,
                    len * std::mem::size_of::<f32>(),
                    self.drain_stream.cu_stream(),
                )
            }
            .result()
            .w()?;
        }
        let done = match self.drain_stream.record_event(None) {
            Ok(done) => done,
            Err(e) => {
                // The copy may still be writing into `staging`, which is freed on
                // return: wait for it first.
                self.compute
                    .context()
                    .record_err(self.drain_stream.synchronize());
                return Err(e).w();
            }
        };
        drop(storage);
        Ok(Drained {
            done,
            staging: Some(staging),
            len,
            _chunk: chunk.clone(),
        })
    }

    /// Waits for the copy of `drained`, passes its data (the chunk's elements in
    /// order) to `use_data`, then keeps its staging buffer for the next drain.
    pub(crate) fn receive(
        &mut self,
        mut drained: Drained,
        use_data: impl FnOnce(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let t = std::time::Instant::now();
        drained.done.synchronize().w()?;
        self.times.wait += t.elapsed().as_secs_f64();
        let Some(staging) = drained.staging.take() else {
            bail!("cqsa: drained chunk without a staging buffer")
        };
        let data = staging.as_slice().w()?;
        let t = std::time::Instant::now();
        use_data(&data[..drained.len])?;
        self.times.land += t.elapsed().as_secs_f64();
        self.staging.push(staging);
        Ok(())
    }

    /// A staging buffer for at least `len` f32s: the smallest idle one of this
    /// call that fits (so each kind of result keeps reusing its own), else the
    /// smallest fitting one of earlier calls ([`crate::staging`]), else a new one.
    fn take_staging(&mut self, len: usize) -> Result<PinnedHostSlice<f32>> {
        let len = len.max(1); // cudarc cannot allocate an empty one
        let fit = (0..self.staging.len())
            .filter(|&i| self.staging[i].len() >= len)
            .min_by_key(|&i| self.staging[i].len());
        if let Some(i) = fit {
            return Ok(self.staging.swap_remove(i));
        }
        if let Some(buf) = crate::staging::take(self.compute.context(), len) {
            return Ok(buf);
        }
        let t = std::time::Instant::now();
        // SAFETY: the buffer is uninitialized, but it is read only up to the
        // length of a drain's copy, after that copy is done (`receive`).
        let buf = unsafe { alloc_readable::<f32>(self.compute.context(), len) };
        self.times.staging += t.elapsed().as_secs_f64();
        self.times.staged_bytes += len * 4;
        buf
    }

    /// Waits for every copy and unregisters the host memory, surfacing errors;
    /// returns where the host's time went.
    pub(crate) fn finish(mut self) -> Result<HostTimes> {
        let t = std::time::Instant::now();
        self.release().w()?;
        self.times.release = t.elapsed().as_secs_f64();
        Ok(self.times)
    }

    /// Synchronizes the transfer and drain streams, then unregisters what this
    /// feed registered and gives its idle staging buffers to the cache.
    /// Idempotent; returns the first error.
    fn release(&mut self) -> std::result::Result<(), DriverError> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut first = self.transfer.synchronize();
        let drained = self.drain_stream.synchronize();
        if first.is_ok() {
            first = drained;
        }
        // Idle buffers: no copy targets them (those in flight belong to a `Drained`).
        for buf in self.staging.drain(..) {
            crate::staging::give(buf);
        }
        // Every copy reading the registered pages has completed (the transfer
        // stream was synchronized just above): unregister them (a failure is
        // recorded on the context).
        self.registered.clear();
        first
    }
}

/// A result chunk whose copy to host memory was issued ([`ChunkFeed::drain`]):
/// the event that marks the end of the copy, the staging buffer it writes, and the
/// device chunk itself, kept alive until the copy is over because its memory is
/// freed stream-ordered on the compute stream, which does not wait for the drain
/// stream.
pub(crate) struct Drained {
    done: CudaEvent,
    /// `None` once handed back to the feed by `receive`.
    staging: Option<PinnedHostSlice<f32>>,
    /// Elements of the chunk (the staging buffer may be longer).
    len: usize,
    _chunk: Tensor,
}

impl Drop for Drained {
    /// Whether received or not (an early exit), the copy must be over before the
    /// staging buffer and the device chunk go away; errors are recorded on the
    /// context (cudarc's `check_err` surfaces them).
    fn drop(&mut self) {
        let r = self.done.synchronize();
        self.done.context().record_err(r);
    }
}

impl Drop for ChunkFeed<'_> {
    /// On an early exit (an error between fetches): copies may still be reading
    /// host memory, so wait for them before the borrow ends; errors are recorded
    /// on the context (cudarc's `check_err` surfaces them).
    fn drop(&mut self) {
        let r = self.release();
        self.compute.context().record_err(r);
    }
}

/// Start address and byte length of a host storage's whole buffer.
fn host_span(s: &CpuStorage) -> Result<(usize, usize)> {
    Ok(match s {
        CpuStorage::F32(v) => (v.as_ptr() as usize, std::mem::size_of_val(v.as_slice())),
        CpuStorage::F16(v) => (v.as_ptr() as usize, std::mem::size_of_val(v.as_slice())),
        CpuStorage::BF16(v) => (v.as_ptr() as usize, std::mem::size_of_val(v.as_slice())),
        other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
    })
}
