//! The Hopper kernels (`kernels/src/attention_hopper.cu`, module
//! [`streamer_kernels::ATTENTION_HOPPER`]): `wgmma` fed by the tensor
//! memory accelerator, forward (head dims 64, 128, 256) and backward (64, 128:
//! one kernel for dk, dv and dq after the portable delta kernel, dq summed in f32
//! by bulk reduce-adds).
//! They read Q, K, V and dO through TMA tensor maps, which this module builds
//! (`cuTensorMapEncodeTiled`) and passes by value.
//!
//! A map describes one input as a 3-D tensor (head dim, sequence, batch * heads)
//! with 128-byte swizzle and boxes of 64 x rows x 1: what one copy brings into
//! shared memory (rows: the kernel's query block or key tile). Reads past the
//! sequence come back as zeros, so a tile never crosses into the next head.
use candle_core::cuda_backend::cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, DType, Result};
use streamer_kernels::ATTENTION_HOPPER;

use crate::launch::{allow_smem, grid, to_i32, Backward, KernelArgs};
use crate::packed::Fused;
use crate::segs::Segs;
use crate::AttentionShape;

/// Query rows per block (`hopper::FwdCfg::BR`: two consumer warpgroups of 64).
const ROWS: usize = 128;
/// Threads per block (`hopper::FwdCfg::THREADS`): a producer warpgroup and two
/// consumers.
const THREADS: u32 = 384;

/// Keys per K/V tile (`hopper::FwdCfg::BC`).
fn keys(d: usize) -> usize {
    if d == 256 {
        64
    } else {
        128
    }
}

/// Dynamic shared memory (`hopper::FwdCfg::SMEM`): 1024 bytes to align the
/// swizzled tiles, the Q tile, two stages each of K and V, and the mbarriers.
fn smem(d: usize) -> u32 {
    (1024 + ROWS * d * 2 + 4 * keys(d) * d * 2 + 128) as u32
}

/// Whether the Hopper kernels apply: built (the module is empty for GPUs other
/// than compute capability 9.0), enabled ([`crate::set_hopper_kernels`]),
/// f16/bf16 at head dim 64, 128 or (forward only) 256 with 16-byte aligned
/// inputs (TMA needs them), and a device of compute capability exactly 9.0
/// (`sm_90a` code runs on no other).
pub(crate) fn applies(
    dev: &CudaDevice,
    dtype: DType,
    d: usize,
    offsets: &[usize],
    backward: bool,
) -> Result<bool> {
    let dims_ok = matches!(d, 64 | 128) || (d == 256 && !backward);
    if !crate::hopper_kernels_enabled()
        || !matches!(dtype, DType::F16 | DType::BF16)
        || !dims_ok
        || offsets.iter().any(|a| a % 8 != 0)
    {
        return Ok(false);
    }
    available(dev)
}

/// Whether `dev` can run the Hopper kernels: built for compute capability 9.0
/// and a device of exactly that capability.
pub(crate) fn available(dev: &CudaDevice) -> Result<bool> {
    if ATTENTION_HOPPER.is_empty() {
        return Ok(false);
    }
    Ok(dev.cuda_stream().context().compute_capability().w()? == (9, 0))
}

/// Streaming multiprocessors of `dev`: the blocks of a persistent launch.
fn sm_count(dev: &CudaDevice) -> Result<usize> {
    let n = dev
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .w()?;
    Ok(n.max(1) as usize)
}

/// A TMA descriptor, passed to the kernel by value (`__grid_constant__ const
/// CUtensorMap`).
#[repr(transparent)]
struct TensorMap(sys::CUtensorMap);

// SAFETY: a CUtensorMap is 128 bytes of plain data that the kernel takes by
// value; the driver copies it from the pointer the launch passes.
unsafe impl DeviceRepr for TensorMap {}

/// The map of a `(slices, n, d)` tensor at device address `ptr` with boxes of
/// `(64, rows, 1)`.
fn tensor_map(
    ptr: u64,
    dtype: DType,
    (slices, n, d): (usize, usize, usize),
    rows: usize,
) -> Result<TensorMap> {
    let data = match dtype {
        DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        other => bail!("cqsa: no Hopper attention kernel for dtype {other:?}"),
    };
    let dims = [d as u64, n as u64, slices as u64];
    let strides = [(d * 2) as u64, (n * d * 2) as u64];
    let boxes = [64u32, rows as u32, 1];
    let elem_strides = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every array has the lengths a rank-3 map reads (dims and boxes 3,
    // strides 2); `ptr` is a live device allocation of slices * n * d elements,
    // 16-byte aligned (`applies`); the call writes the whole map or fails.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("cqsa: cuTensorMapEncodeTiled failed ({r:?}) for a ({slices}, {n}, {d}) {dtype:?} tensor")
    }
    // SAFETY: initialised by the successful call above.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// Which side of attention a tensor is on: shaped like q (`b * hq` slices of
/// `nq` rows) or like k and v (`b * hkv` slices of `nk` rows).
enum Side {
    Query,
    Key,
}

impl Side {
    /// The tensor map of the contiguous tensor at `ptr` on this side, in
    /// boxes of `rows` rows.
    fn map(self, dims: &AttentionShape, ptr: u64, rows: usize) -> Result<TensorMap> {
        let (heads, n) = match self {
            Side::Query => (dims.hq, dims.nq),
            Side::Key => (dims.hkv, dims.nk),
        };
        tensor_map(ptr, dims.dtype, (dims.b * heads, n, dims.d), rows)
    }
}

/// Launches `cqsa_fwd_hopper_{cap_}{sfx}_d{d}` on the device's compute stream:
/// `out` and `lse` get the output and the log-sum-exp. The kernel is
/// persistent: one block per SM works through the items (a query block of a
/// head; a packed call: of each document), loading an item's first tiles while
/// the previous one finishes.
pub(crate) fn forward<T: DeviceRepr>(
    dev: &CudaDevice,
    (q, k, v): (&CudaView<'_, T>, &CudaView<'_, T>, &CudaView<'_, T>),
    (out, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    dims: &AttentionShape,
    args: &KernelArgs,
    (sfx, packed): (&str, Option<&Fused>),
) -> Result<()> {
    let AttentionShape { b, hq, nq, d, .. } = *dims;
    let segs = packed
        .map(|f| Segs::forward(dev, f, (ROWS, keys(d))))
        .transpose()?;
    let blocks = segs.as_ref().map_or(nq.div_ceil(ROWS), |s| s.blocks);
    // The grid the items stand for keeps a launch's limits; the kernel counts
    // items in an i32.
    grid(blocks, hq, b)?;
    let items = blocks * hq * b;
    to_i32(items, "blocks of queries over heads and batch")?;
    let cfg = LaunchConfig {
        grid_dim: (items.min(sm_count(dev)?) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem(d),
    };
    let name = format!("cqsa_fwd_hopper_{}{sfx}_d{d}", args.cap_infix());
    let func = streamer_kernels::function(dev, &ATTENTION_HOPPER, &name)?;
    allow_smem(&func, cfg.shared_mem_bytes)?;
    let stream = dev.cuda_stream();
    // The guards record the reads on the stream when dropped, after the launch
    // (as passing the views to the launch builder would).
    let (qp, _gq) = q.device_ptr(&stream);
    let (kp, _gk) = k.device_ptr(&stream);
    let (vp, _gv) = v.device_ptr(&stream);
    let tq = Side::Query.map(dims, qp, ROWS)?;
    let tk = Side::Key.map(dims, kp, keys(d))?;
    let tv = Side::Key.map(dims, vp, keys(d))?;
    let mut builder = func.builder();
    builder.arg(&tq).arg(&tk).arg(&tv).arg(out).arg(lse);
    args.push(&mut builder, false);
    let null = 0u64;
    match &segs {
        Some(s) => builder.arg(&s.table),
        None => builder.arg(&null),
    };
    let (gx, nb) = (blocks as i32, b as i32);
    // The count of items taken after the first wave (the kernel adds to it).
    let mut next = dev.alloc_zeros::<i32>(1)?;
    builder.arg(&gx).arg(&nb).arg(&mut next);
    if blocks == 0 {
        return Ok(());
    }
    // SAFETY: the maps describe exactly the views' elements (b*hq*nq*d and
    // b*hkv*nk*d, contiguous, 16-byte aligned), which live past the launch; the
    // kernel writes b*hq*nq*d of `out` and b*hq*nq of `lse` (a packed call's
    // Segs cover every row once, `Segs::forward`); argument types and order
    // match its signature (`segs`: a null pointer or `blocks` Segs; gx, nb and
    // their product with hq fit an i32; `next` a zeroed i32); it gets
    // its FwdCfg::SMEM (it traps on less) and runs only on a 9.0 device
    // (`applies`).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// Keys per backward block (`hopper::BwdCfg::BR`: two consumer warpgroups of 64)
/// and query rows per streamed tile (`BS`), the granule of the statistics and of
/// the dq accumulator.
const BWD_KEYS: usize = 128;
const BWD_QUERIES: usize = 64;

/// Dynamic shared memory of the backward kernel (`hopper::BwdCfg::SMEM`):
/// alignment, K and V, two stages of (Q, dO), two dS tiles, two dQ blocks per
/// warpgroup, two stages of statistics, the mbarriers (the pipeline's, then
/// eight for the dQ blocks' hand-over to the writer warp).
fn bwd_smem(d: usize) -> u32 {
    const STAGES: usize = 2;
    let kv = 2 * BWD_KEYS * d * 2;
    let stages = STAGES * 2 * BWD_QUERIES * d * 2;
    let ds = 2 * BWD_KEYS * BWD_QUERIES * 2;
    let dq = 2 * 2 * 64 * 64 * 4;
    let stats = STAGES * BWD_QUERIES * 8;
    (1024 + kv + stages + ds + dq + stats + 8 * (1 + 2 * STAGES + 8)) as u32
}

/// The Hopper backward after `bw.delta`, on the device's compute stream:
/// `cqsa_bwd_stats_hopper` pads (lse, delta) to tiles of 64 queries, then
/// `cqsa_bwd_hopper_*` (a block per 128 keys) writes dk and dv and sums dq into
/// a zeroed f32 accumulator by bulk reduce-adds, which
/// `cqsa_bwd_dq_convert_hopper_*` turns into dq. The sums land in an order that
/// varies from run to run, so dq is exact to f32 rounding, not bit-reproducible.
/// A packed call pads each document to its own tiles.
pub(crate) fn backward<T: DeviceRepr>(bw: &mut Backward<'_, T>) -> Result<()> {
    let AttentionShape { b, hq, nq, d, .. } = bw.dims;
    let tables = bw
        .packed
        .map(|f| Segs::backward(bw.dev, f, BWD_KEYS, Some(BWD_QUERIES)))
        .transpose()?;
    let (segs, tiles) = match &tables {
        Some((s, t)) => (Some(s), t.as_ref()),
        None => (None, None),
    };
    let nqt = tiles.map_or(nq.div_ceil(BWD_QUERIES), |t| t.len);
    let nqp = nqt * BWD_QUERIES;
    // SAFETY (uninitialised): cqsa_bwd_stats_hopper writes every padded row.
    let mut stats = unsafe { bw.dev.alloc::<f32>(2 * b * hq * nqp) }?;
    let mut acc = bw.dev.alloc_zeros::<f32>(b * hq * nqp * d)?;
    let tiles = (tiles.map(|t| &t.table), nqt);
    stats_kernel(bw, &mut stats, tiles)?;
    bwd_kernel(bw, (&stats, &mut acc), (segs, nqt))?;
    convert_kernel(bw, &acc, tiles)
}

/// `cqsa_bwd_stats_hopper`: (lse, delta) padded to `nqt` tiles per slice
/// (`tiles`: a packed call's, `None` for a plain call).
fn stats_kernel<T: DeviceRepr>(
    bw: &Backward<'_, T>,
    stats: &mut CudaSlice<f32>,
    (tiles, nqt): (Option<&CudaSlice<i32>>, usize),
) -> Result<()> {
    let AttentionShape { b, hq, nq, .. } = bw.dims;
    let (slices, nq_, nqt_, null) = ((b * hq) as i64, nq as i32, nqt as i32, 0u64);
    let func = streamer_kernels::function(bw.dev, &ATTENTION_HOPPER, "cqsa_bwd_stats_hopper")?;
    let mut builder = func.builder();
    builder.arg(&bw.inputs.lse).arg(&bw.inputs.delta).arg(stats);
    builder.arg(&slices).arg(&nq_).arg(&nqt_);
    match tiles {
        Some(t) => builder.arg(t),
        None => builder.arg(&null),
    };
    // SAFETY: reads slices*nq of lse and delta (the tiles' rows lie in 0..nq),
    // writes slices*nqt*64 float2 (twice that in f32) of stats; argument types
    // match the signature (tiles: null or nqt int2).
    unsafe { builder.launch(flat(b * hq * nqt * BWD_QUERIES)?) }.w()?;
    Ok(())
}

/// `cqsa_bwd_dq_convert_hopper_*`: dq from the f32 accumulator of `nqt` tiles
/// per slice (`tiles` as in [`stats_kernel`]).
fn convert_kernel<T: DeviceRepr>(
    bw: &mut Backward<'_, T>,
    acc: &CudaSlice<f32>,
    (tiles, nqt): (Option<&CudaSlice<i32>>, usize),
) -> Result<()> {
    let AttentionShape { b, hq, nq, d, .. } = bw.dims;
    let (slices, nq_, nqt_, null) = ((b * hq) as i64, nq as i32, nqt as i32, 0u64);
    let (d_, scale) = (d as i32, bw.args.scale());
    let func = streamer_kernels::function(
        bw.dev,
        &ATTENTION_HOPPER,
        &format!("cqsa_bwd_dq_convert_hopper_{}", bw.sfx),
    )?;
    let mut builder = func.builder();
    builder.arg(acc).arg(&mut bw.dq);
    builder
        .arg(&slices)
        .arg(&nq_)
        .arg(&nqt_)
        .arg(&d_)
        .arg(&scale);
    match tiles {
        Some(t) => builder.arg(t),
        None => builder.arg(&null),
    };
    // SAFETY: reads slices*nqt*64*d f32 of acc, writes the slices*nq*d of dq that
    // the tiles cover (all of it: every row is in one tile; d even); argument
    // types match the signature (tiles: null or nqt int2).
    unsafe { builder.launch(flat(b * hq * nqt * BWD_QUERIES * d / 2)?) }.w()?;
    Ok(())
}

/// `cqsa_bwd_hopper_*`: a block per key block (of each document, `segs`),
/// reading the padded statistics, summing dq into `acc` (nqt tiles per slice),
/// writing dk and dv.
fn bwd_kernel<T: DeviceRepr>(
    bw: &mut Backward<'_, T>,
    (stats, acc): (&CudaSlice<f32>, &mut CudaSlice<f32>),
    (segs, nqt): (Option<&Segs>, usize),
) -> Result<()> {
    let AttentionShape { b, hkv, nk, d, .. } = bw.dims;
    let name = format!("cqsa_bwd_hopper_{}{}_d{d}", bw.args.cap_infix(), bw.sfx);
    let func = streamer_kernels::function(bw.dev, &ATTENTION_HOPPER, &name)?;
    let smem = bwd_smem(d);
    allow_smem(&func, smem)?;
    let blocks = segs.map_or(nk.div_ceil(BWD_KEYS), |s| s.blocks);
    if blocks == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: grid(blocks, hkv, b)?,
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let stream = bw.dev.cuda_stream();
    // The guards record the reads on the stream when dropped, after the launch.
    let (qp, _gq) = bw.inputs.q.device_ptr(&stream);
    let (kp, _gk) = bw.inputs.k.device_ptr(&stream);
    let (vp, _gv) = bw.inputs.v.device_ptr(&stream);
    let (gp, _gg) = bw.inputs.g.device_ptr(&stream);
    let tq = Side::Query.map(&bw.dims, qp, BWD_QUERIES)?;
    let tg = Side::Query.map(&bw.dims, gp, BWD_QUERIES)?;
    let tk = Side::Key.map(&bw.dims, kp, BWD_KEYS)?;
    let tv = Side::Key.map(&bw.dims, vp, BWD_KEYS)?;
    let mut builder = func.builder();
    builder.arg(&tq).arg(&tk).arg(&tv).arg(&tg);
    builder.arg(stats).arg(acc).arg(&mut bw.dk).arg(&mut bw.dv);
    bw.args.push(&mut builder, false);
    let (null, nqt) = (0u64, nqt as i32);
    match segs {
        Some(s) => builder.arg(&s.table),
        None => builder.arg(&null),
    };
    builder.arg(&nqt);
    // SAFETY: the maps describe exactly the views' elements (contiguous, 16-byte
    // aligned, alive past the launch); the kernel reads slices*nqp float2 of
    // stats, adds into the slices*nqp*d f32 of acc and writes b*hkv*nk*d of dk
    // and of dv (a packed call's Segs cover every key once, `Segs::backward`);
    // argument types and order match its signature (segs: null or `blocks`
    // Segs); it gets BwdCfg::SMEM (it traps on less) on a 9.0 device.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// A launch of one thread per element of `n`, in blocks of 256.
fn flat(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: grid(n.div_ceil(256), 1, 1)?,
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}
