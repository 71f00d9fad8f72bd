//! The Hopper forward (`kernels/src/attention_hopper.cu`, module
//! [`streamer_kernels::module::ATTENTION_HOPPER`]): `wgmma` fed by the tensor
//! memory accelerator. Its kernels read Q, K and V through TMA tensor maps, which
//! this module builds (`cuTensorMapEncodeTiled`) and passes by value.
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
use streamer_kernels::{module, ATTENTION_HOPPER};

use crate::cuda::KernelArgs;
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

/// Whether the Hopper forward applies: built (the PTX is empty for GPUs other
/// than compute capability 9.0), enabled ([`crate::set_hopper_kernels`]),
/// f16/bf16 at head dim 64, 128 or 256 with 16-byte aligned inputs (TMA needs
/// them), and a device of compute capability exactly 9.0 (`sm_90a` code runs on
/// no other).
pub(crate) fn applies(dev: &CudaDevice, dtype: DType, d: usize, offsets: &[usize]) -> Result<bool> {
    if ATTENTION_HOPPER.is_empty()
        || !crate::hopper_kernels_enabled()
        || !matches!(dtype, DType::F16 | DType::BF16)
        || !matches!(d, 64 | 128 | 256)
        || offsets.iter().any(|a| a % 8 != 0)
    {
        return Ok(false);
    }
    Ok(dev.cuda_stream().context().compute_capability().w()? == (9, 0))
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

/// The inputs of one Hopper forward launch (contiguous device views).
pub(crate) struct Inputs<'a, T> {
    pub(crate) q: &'a CudaView<'a, T>,
    pub(crate) k: &'a CudaView<'a, T>,
    pub(crate) v: &'a CudaView<'a, T>,
    pub(crate) dtype: DType,
}

/// Launches `cqsa_fwd_hopper_{cap_}{sfx}_d{d}` on the device's compute stream:
/// `out` and `lse` get the output and the log-sum-exp.
pub(crate) fn forward<T: DeviceRepr>(
    dev: &CudaDevice,
    inputs: Inputs<'_, T>,
    (out, lse): (&mut CudaSlice<T>, &mut CudaSlice<f32>),
    dims: &AttentionShape,
    args: &KernelArgs,
    sfx: &str,
) -> Result<()> {
    let AttentionShape {
        b,
        hq,
        hkv,
        nq,
        nk,
        d,
        ..
    } = *dims;
    let name = format!("cqsa_fwd_hopper_{}{sfx}_d{d}", args.cap_infix());
    let func = dev.get_or_load_custom_func(&name, module::ATTENTION_HOPPER, ATTENTION_HOPPER)?;
    let smem = smem(d);
    func.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let stream = dev.cuda_stream();
    // The guards record the reads on the stream when dropped, after the launch
    // (as passing the views to the launch builder would).
    let (qp, _gq) = inputs.q.device_ptr(&stream);
    let (kp, _gk) = inputs.k.device_ptr(&stream);
    let (vp, _gv) = inputs.v.device_ptr(&stream);
    let tq = tensor_map(qp, inputs.dtype, (b * hq, nq, d), ROWS)?;
    let tk = tensor_map(kp, inputs.dtype, (b * hkv, nk, d), keys(d))?;
    let tv = tensor_map(vp, inputs.dtype, (b * hkv, nk, d), keys(d))?;
    if hq > 65535 || b > 65535 {
        bail!(
            "cqsa: launch grid ({}, {hq}, {b}) too large",
            nq.div_ceil(ROWS)
        )
    }
    let cfg = LaunchConfig {
        grid_dim: (nq.div_ceil(ROWS) as u32, hq as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut builder = func.builder();
    builder.arg(&tq).arg(&tk).arg(&tv).arg(out).arg(lse);
    args.push(&mut builder, false);
    // SAFETY: the maps describe exactly the views' elements (b*hq*nq*d and
    // b*hkv*nk*d, contiguous, 16-byte aligned), which live past the launch; the
    // kernel writes b*hq*nq*d of `out` and b*hq*nq of `lse`; argument types and
    // order match its signature; it gets its FwdCfg::SMEM (it traps on less) and
    // runs only on a 9.0 device (`applies`).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}
