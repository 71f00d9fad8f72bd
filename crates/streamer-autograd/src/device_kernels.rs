//! Launches of the device optimizer's kernels (`kernels/src/optim.cu`) on
//! raw device buffers: the finite check of a gradient and the fused AdamW
//! update, both on the device's compute stream.
use candle_core::{CudaDevice, DType, Result};
use cudarc::driver::PushKernelArg;

use crate::adamw::AdamConsts;

fn suffix(dt: DType) -> Result<&'static str> {
    streamer_device::kernel_suffix(dt, "device AdamW")
}

/// A kernel of `kernels/src/optim.cu`, loaded once per device.
fn optim_func(dev: &CudaDevice, name: &str) -> Result<cudarc::driver::CudaFunction> {
    streamer_kernels::function(dev, &streamer_kernels::OPTIM, name)
        .map(streamer_kernels::Kernel::into_function)
}

/// Sets the u32 at `flag` to 1 if any of the `n` elements at `g` is NaN or
/// infinite (it is left alone otherwise; zero it first).
///
/// # Safety
/// `g` holds `n` elements of `dt` and `flag` one u32, both device memory
/// alive until the compute stream passes the kernel.
pub(crate) unsafe fn nonfinite(
    dev: &CudaDevice,
    g: u64,
    dt: DType,
    n: usize,
    flag: u64,
) -> Result<()> {
    let name = format!("nonfinite_{}", suffix(dt)?);
    let func = optim_func(dev, &name)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&g).arg(&n).arg(&flag);
    // SAFETY: the kernel reads n elements at g and writes one u32 at flag
    // (this fn's contract).
    unsafe { b.launch(streamer_device::grid_stride(n)) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// The buffers of one AdamW update: parameter (in place), gradient, moments
/// (in place, f32 or bf16 as `state`) and the skip flag, all device addresses
/// of `n` elements, and the seed of bf16 moments' stochastic rounding.
pub(crate) struct AdamBuffers {
    pub p: u64,
    pub p_dtype: DType,
    pub g: u64,
    pub g_dtype: DType,
    pub m: u64,
    pub v: u64,
    pub state: DType,
    pub seed: u32,
    pub skip: u64,
    pub n: usize,
}

/// Enqueues the fused AdamW update of `b` with the step's constants `k`;
/// a set skip flag leaves everything unchanged.
///
/// # Safety
/// Every address in `b` is device memory of the stated dtype and length,
/// alive until the compute stream passes the kernel, and `p`, `m`, `v` are
/// not read or written by anything else until then.
pub(crate) unsafe fn adamw(dev: &CudaDevice, b: &AdamBuffers, k: &AdamConsts) -> Result<()> {
    let name = format!(
        "adamw_{}_{}_{}",
        suffix(b.p_dtype)?,
        suffix(b.g_dtype)?,
        suffix(b.state)?
    );
    let func = optim_func(dev, &name)?;
    let stream = dev.cuda_stream();
    let mut l = stream.launch_builder(&func);
    l.arg(&b.p)
        .arg(&b.g)
        .arg(&b.m)
        .arg(&b.v)
        .arg(&b.n)
        .arg(&b.skip);
    l.arg(&k.beta1).arg(&k.one_minus_beta1);
    l.arg(&k.beta2).arg(&k.one_minus_beta2);
    l.arg(&k.scale_m).arg(&k.scale_v);
    l.arg(&k.decay).arg(&k.eps).arg(&k.lr).arg(&b.seed);
    // SAFETY: the buffers are as the kernel expects (this fn's contract).
    unsafe { l.launch(streamer_device::grid_stride(b.n)) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}
