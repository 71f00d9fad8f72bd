//! Raw CUDA work of the pool: asynchronous copies on the transfer stream (split
//! at page boundaries, see [`crate::pages`]), launches of our conversion
//! kernel, and queries of the device's memory pool.
use crate::pages::page_pieces;
use candle_core::{CudaDevice, DType, Result};
use cudarc::driver::{sys, CudaStream, LaunchConfig, PushKernelArg};

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        candle_core::bail!("CUDA error in {what}: {r:?}")
    }
}

/// Enqueues a host-to-device copy on `stream`.
///
/// # Safety
/// `dst..dst+bytes` must be device memory that stays allocated until the copy
/// completes, and `src..src+bytes` host memory that stays valid and unmodified
/// until then (the pool synchronizes the transfer stream before masters change).
pub(crate) unsafe fn htod_async(
    dst: u64,
    src: *const u8,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    for (off, n, _) in page_pieces(src as usize, bytes) {
        // SAFETY: `off + n <= bytes`, so both ranges lie inside the caller's
        // buffers, which stay valid until the copy completes (this fn's contract).
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst + off as u64,
                src.add(off) as *const _,
                n,
                stream.cu_stream(),
            )
        };
        check(r, "cuMemcpyHtoDAsync")?;
    }
    Ok(())
}

/// Enqueues a device-to-host copy on `stream` into page-locked host memory.
///
/// # Safety
/// As [`htod_async`], with the roles of host and device swapped; `dst..dst+bytes`
/// must be page-locked (a copy into pageable memory would block the host until
/// the stream reaches it), and must not be read until the stream has passed it.
pub(crate) unsafe fn dtoh_async(
    dst: *mut u8,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    // SAFETY: the caller guarantees both ranges and that `dst` is page-locked and
    // untouched until the stream passes the copy (this fn's contract).
    let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut _, src, bytes, stream.cu_stream()) };
    check(r, "cuMemcpyDtoHAsync")
}

/// Enqueues a device-to-host copy on `stream` into host memory that may be
/// page-locked only in its whole pages, split at page boundaries as
/// [`htod_async`] splits (a copy may not span registered and pageable memory).
///
/// # Safety
/// As [`htod_async`], with the roles of host and device swapped; `dst` must not
/// be read until the stream has passed the copy.
pub(crate) unsafe fn dtoh_pieces(
    dst: *mut u8,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    for (off, n, _) in page_pieces(dst as usize, bytes) {
        // SAFETY: `off + n <= bytes`, so both ranges lie inside the caller's
        // buffers, which stay valid until the copy completes (this fn's contract).
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.add(off) as *mut _,
                src + off as u64,
                n,
                stream.cu_stream(),
            )
        };
        check(r, "cuMemcpyDtoHAsync")?;
    }
    Ok(())
}

/// The name suffix of our kernels' instantiation for a float dtype (`f32`,
/// `bf16`, `f16`); other dtypes are an error naming `what` and the dtype.
pub fn kernel_suffix(dt: DType, what: &str) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("{what}: no CUDA kernel for dtype {other:?} (f32, bf16, f16)"),
    })
}

/// A launch of 256-thread blocks for a grid-stride loop over `n` elements:
/// enough blocks to fill any GPU several times over (capped at 65,535; the
/// loop covers the rest), so no device property is hard-coded.
pub fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether our cast kernel covers this conversion.
pub(crate) fn has_cast(from: DType, to: DType) -> bool {
    matches!(
        (from, to),
        (DType::F32, DType::BF16)
            | (DType::F32, DType::F16)
            | (DType::BF16, DType::F32)
            | (DType::F16, DType::F32)
    )
}

/// Enqueues our cast kernel on `stream`, converting `n` elements at `src` into `dst`.
///
/// # Safety
/// `src` and `dst` must be device buffers of at least `n` elements of `from`/`to`,
/// alive until the stream passes the kernel.
pub(crate) unsafe fn cast(
    dev: &CudaDevice,
    stream: &CudaStream,
    from: DType,
    src: u64,
    to: DType,
    dst: u64,
    n: usize,
) -> Result<()> {
    let name = match (from, to) {
        (DType::F32, DType::BF16) => "cast_f32_bf16",
        (DType::F32, DType::F16) => "cast_f32_f16",
        (DType::BF16, DType::F32) => "cast_bf16_f32",
        (DType::F16, DType::F32) => "cast_f16_f32",
        _ => candle_core::bail!("no cast kernel from {from:?} to {to:?}"),
    };
    if n == 0 {
        return Ok(());
    }
    let func = streamer_kernels::function(dev, &streamer_kernels::CAST, name)?;
    let cfg = grid_stride(n);
    let mut b = stream.launch_builder(&func);
    b.arg(&src).arg(&dst).arg(&n);
    // SAFETY: the kernel reads n elements at `src` and writes n at `dst`, which
    // the caller guarantees are live device buffers of those dtypes.
    unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// Enqueues a kernel on `stream` that sets the u32 at `flag` to 1 when the `n`
/// bytes at `x` and `y` differ (it leaves it alone when they are equal).
///
/// # Safety
/// `x` and `y` must be 16-byte aligned device buffers of at least `n` bytes and
/// `flag` a device u32, all alive until the stream passes the kernel.
pub(crate) unsafe fn bytes_differ(
    dev: &CudaDevice,
    stream: &CudaStream,
    (x, y, n): (u64, u64, usize),
    flag: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let func = streamer_kernels::function(dev, &streamer_kernels::CAST, "bytes_differ")?;
    let mut l = stream.launch_builder(&func);
    l.arg(&x).arg(&y).arg(&n).arg(&flag);
    // SAFETY: the kernel reads n bytes at x and y and writes one u32 at flag,
    // which the caller guarantees are live device memory.
    unsafe { l.launch(grid_stride(n / 16)) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// Allocates a flat device tensor of `elems` elements of `dtype` and returns it with
/// its raw device address (stable for the tensor's life), for the pool's slots.
pub(crate) fn alloc_flat(
    dev: &CudaDevice,
    dtype: DType,
    elems: usize,
) -> Result<(candle_core::Tensor, u64)> {
    use candle_core::{op::BackpropOp, CudaStorage, Storage, Tensor};
    use cudarc::driver::DevicePtr;
    let stream = dev.cuda_stream();
    macro_rules! alloc {
        ($t:ty) => {{
            let s = dev.alloc_zeros::<$t>(elems)?;
            let ptr = {
                let (p, _guard) = s.device_ptr(&stream);
                p
            };
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), ptr)
        }};
    }
    let (storage, ptr) = match dtype {
        DType::BF16 => alloc!(half::bf16),
        DType::F16 => alloc!(half::f16),
        DType::F32 => alloc!(f32),
        DType::F64 => alloc!(f64),
        dt => candle_core::bail!("slots hold float weights, got {dt:?}"),
    };
    let t = Tensor::from_storage(Storage::Cuda(storage), elems, BackpropOp::none(), false);
    Ok((t, ptr))
}

/// The device address of a contiguous CUDA tensor's first element.
pub(crate) fn device_ptr(t: &candle_core::Tensor) -> Result<u64> {
    use candle_core::Storage;
    use cudarc::driver::DevicePtr;
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*s else {
        candle_core::bail!("expected a CUDA tensor, found {:?}", t.device().location())
    };
    let stream = cs.device.cuda_stream();
    macro_rules! ptr {
        ($t:ty) => {{
            let (p, _guard) = cs.as_cuda_slice::<$t>()?.device_ptr(&stream);
            p
        }};
    }
    let base = match t.dtype() {
        DType::BF16 => ptr!(half::bf16),
        DType::F16 => ptr!(half::f16),
        DType::F32 => ptr!(f32),
        DType::F64 => ptr!(f64),
        dt => candle_core::bail!("unsupported dtype {dt:?}"),
    };
    Ok(base + (l.start_offset() * t.dtype().size_in_bytes()) as u64)
}

/// Enqueues a kernel that waits `ns` nanoseconds on `stream` (slow-transfer tests).
pub(crate) fn delay(dev: &CudaDevice, stream: &CudaStream, ns: u64) -> Result<()> {
    let func = streamer_kernels::function(dev, &streamer_kernels::DELAY, "spin_ns")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&func);
    b.arg(&ns);
    // SAFETY: the kernel takes one u64 by value and touches no memory.
    unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// A Candle variable over existing device memory at `ptr` (a piece of a slot).
///
/// # Safety
/// `ptr` must point to `shape.elem_count()` elements of `dtype` inside an
/// allocation that outlives the variable, and the variable must never be
/// dropped (it would free memory it does not own): the pool forgets it.
pub(crate) unsafe fn alias_var(
    dev: &CudaDevice,
    ptr: u64,
    dtype: DType,
    shape: &candle_core::Shape,
) -> Result<candle_core::Var> {
    use candle_core::{op::BackpropOp, CudaStorage, Storage, Tensor};
    let stream = dev.cuda_stream();
    let n = shape.elem_count();
    // SAFETY (each arm): `ptr` holds n elements of this dtype inside an
    // allocation that outlives the slice, which is never dropped (the caller
    // forgets it): this fn's contract.
    let storage = match dtype {
        DType::BF16 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<half::bf16>(ptr, n) },
            dev.clone(),
        ),
        DType::F16 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<half::f16>(ptr, n) },
            dev.clone(),
        ),
        DType::F32 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<f32>(ptr, n) },
            dev.clone(),
        ),
        DType::F64 => CudaStorage::wrap_cuda_slice(
            unsafe { stream.upgrade_device_ptr::<f64>(ptr, n) },
            dev.clone(),
        ),
        dt => candle_core::bail!("slots hold float weights, got {dt:?}"),
    };
    let t = Tensor::from_storage(
        Storage::Cuda(storage),
        shape.clone(),
        BackpropOp::none(),
        true,
    );
    candle_core::Var::from_tensor(&t)
}

/// The device's default memory pool (the one `cuMemAllocAsync` draws from).
fn default_pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(candle_core::Error::wrap)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver query into a local.
    check(
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) },
        "cuDeviceGetDefaultMemPool",
    )?;
    Ok(pool)
}

/// Sets how many freed bytes the default pool keeps across synchronisations.
pub(crate) fn set_release_threshold(dev: &CudaDevice, bytes: u64) -> Result<()> {
    let pool = default_pool(dev)?;
    let mut v = bytes;
    // SAFETY: the attribute takes a cuuint64_t, which `v` is.
    check(
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut v as *mut u64 as *mut std::ffi::c_void,
            )
        },
        "cuMemPoolSetAttribute(RELEASE_THRESHOLD)",
    )
}

/// Returns the default pool's unused memory to the driver.
pub(crate) fn trim_pool(dev: &CudaDevice) -> Result<()> {
    let pool = default_pool(dev)?;
    // SAFETY: trimming only releases memory no allocation uses.
    check(unsafe { sys::cuMemPoolTrimTo(pool, 0) }, "cuMemPoolTrimTo")
}

/// Reads one `cuuint64_t` attribute of the default pool.
fn pool_attr(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: the attributes read here are all cuuint64_t, which `v` is.
    check(
        unsafe {
            sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void)
        },
        "cuMemPoolGetAttribute",
    )?;
    Ok(v)
}

/// Bytes reserved by the default pool minus bytes in use.
pub(crate) fn pool_idle_bytes(dev: &CudaDevice) -> Result<usize> {
    let s = pool_stats(dev)?;
    Ok(s.reserved.saturating_sub(s.used))
}

/// The default pool's reserved and used bytes, now and at their peaks since
/// the peaks were last reset.
pub(crate) fn pool_stats(dev: &CudaDevice) -> Result<crate::DevicePoolStats> {
    use sys::CUmemPool_attribute as A;
    let pool = default_pool(dev)?;
    let get = |a| pool_attr(pool, a).map(|v| v as usize);
    Ok(crate::DevicePoolStats {
        reserved: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        used: get(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        reserved_peak: get(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        used_peak: get(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
    })
}

/// Resets the default pool's peaks to its current figures.
pub(crate) fn reset_pool_peaks(dev: &CudaDevice) -> Result<()> {
    use sys::CUmemPool_attribute as A;
    let pool = default_pool(dev)?;
    for attr in [
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
    ] {
        // The driver only accepts 0 here: "reset to the current value".
        let mut zero: u64 = 0;
        // SAFETY: both attributes take a cuuint64_t, which `zero` is.
        check(
            unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    attr,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )
            },
            "cuMemPoolSetAttribute(*_MEM_HIGH)",
        )?;
    }
    Ok(())
}

/// The device address of a contiguous CUDA tensor's first element, for
/// launching a kernel on it (using the address is the caller's `unsafe`).
pub fn cuda_address(t: &candle_core::Tensor) -> Result<u64> {
    if !t.is_contiguous() {
        candle_core::bail!(
            "expected a contiguous tensor, got shape {:?} with strides {:?}",
            t.dims(),
            t.stride()
        );
    }
    device_ptr(t)
}
