//! Raw CUDA work shared by the workspace's crates, one place for the driver
//! calls: asynchronous copies split at page boundaries (see [`crate::pages`]),
//! queries and settings of the device's default memory pool, launch helpers
//! for our kernels, and [`CudaMemory`], which hands out a tensor's device
//! address under a guard that lives across the launch using it.
use crate::pages::page_pieces;
use candle_core::{CudaDevice, DType, Result, Storage, StorageRef, Tensor};
use cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig, SyncOnDrop,
};
use std::sync::Arc;

/// `(free, total)` bytes of the device's memory as the driver counts them
/// (`cuMemGetInfo` in its context; memory CUDA's pool keeps idle counts as
/// used).
pub fn memory_info(d: &CudaDevice) -> Result<(usize, usize)> {
    d.cuda_stream()
        .context()
        .mem_get_info()
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
}

/// `slice` as a Candle tensor of `shape` on `dev`: no gradient op, not a
/// variable. The tensor owns the slice (frees it when dropped).
pub fn slice_tensor<T: candle_core::cuda_backend::CudaDType>(
    slice: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> Tensor {
    let storage = candle_core::CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}

pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(crate::Error::from_driver(DriverError(r), what, 0).into())
    }
}

impl crate::Error {
    /// A failed driver call as an error callers can match: the driver's
    /// out-of-memory as [`crate::Error::OutOfMemory`] (with `needed` bytes and
    /// what the current context has free), anything else as
    /// [`crate::Error::Cuda`].
    pub fn from_driver(e: DriverError, what: &str, needed: usize) -> Self {
        if e.0 != sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Self::Cuda {
                what: what.to_string(),
                source: Box::new(e),
            };
        }
        let free = cudarc::driver::result::mem_get_info().map_or(0, |(free, _)| free);
        Self::OutOfMemory {
            needed,
            free,
            what: format!(
                "out of device memory in {what}: {needed} bytes asked for, {free} free ({e})"
            ),
        }
    }
}

/// The driver error inside `err`, from candle's own CUDA calls or ours,
/// through candle's context, path and backtrace layers.
pub(crate) fn driver_error(err: &candle_core::Error) -> Option<&DriverError> {
    use candle_core::Error as C;
    match err {
        C::Cuda(b) => {
            b.downcast_ref::<DriverError>().or_else(|| match b
                .downcast_ref::<candle_core::cuda_backend::CudaError>(
            )? {
                candle_core::cuda_backend::CudaError::Cuda(d) => Some(d),
                _ => None,
            })
        }
        C::Context { inner, .. } | C::WithPath { inner, .. } | C::WithBacktrace { inner, .. } => {
            driver_error(inner)
        }
        C::WrappedContext { wrapped, .. } => wrapped
            .downcast_ref::<candle_core::Error>()
            .and_then(driver_error),
        _ => None,
    }
}

/// Enqueues a host-to-device copy on `stream`.
///
/// # Safety
/// `dst..dst+bytes` must be device memory that stays allocated until the copy
/// completes, and `src..src+bytes` host memory that stays valid and unmodified
/// until then (the pool synchronizes the transfer stream before masters change).
pub unsafe fn htod_async(
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
pub unsafe fn dtoh_async(dst: *mut u8, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
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
pub unsafe fn dtoh_pieces(dst: *mut u8, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
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

/// Lets `func` use `smem` bytes of dynamic shared memory (raising the 48 KiB
/// default when needed; the H200 allows up to 227 KiB per block).
pub fn allow_smem(func: &CudaFunction, smem: u32) -> Result<()> {
    if smem > 48 * 1024 {
        func.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(candle_core::Error::wrap)?;
    }
    Ok(())
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

/// A contiguous CUDA tensor's memory, read-locked while addresses taken from
/// it are in use: the storage cannot be swapped or freed under a launch.
///
/// ```ignore
/// let mem = CudaMemory::of(&g)?;
/// let g_addr = mem.address()?; // held across the launch below
/// unsafe { launch(g_addr.get()) }?;
/// ```
pub struct CudaMemory<'t> {
    storage: StorageRef<'t>,
    /// Bytes from the start of the storage to the tensor's first element.
    offset: u64,
    dtype: DType,
    /// The tensor's device's stream, which the launches run on.
    stream: Arc<CudaStream>,
}

impl<'t> CudaMemory<'t> {
    /// Locks `t`'s memory for reading; `t` must be a contiguous CUDA tensor
    /// of a float dtype.
    pub fn of(t: &'t Tensor) -> Result<Self> {
        if !t.is_contiguous() {
            candle_core::bail!(
                "expected a contiguous tensor, got shape {:?} with strides {:?}",
                t.dims(),
                t.stride()
            );
        }
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            candle_core::bail!("expected a CUDA tensor, found {:?}", t.device().location())
        };
        let stream = cs.device.cuda_stream();
        let offset = (layout.start_offset() * t.dtype().size_in_bytes()) as u64;
        Ok(Self {
            offset,
            dtype: t.dtype(),
            stream,
            storage,
        })
    }

    /// The device address of the tensor's first element for work on its
    /// device's stream. Hold the returned guard until that work is enqueued:
    /// on drop it records the use on the stream (cudarc's `SyncOnDrop`), so
    /// that a later free or write on another stream waits for the work.
    pub fn address(&self) -> Result<DeviceAddress<'_>> {
        let Storage::Cuda(cs) = &*self.storage else {
            candle_core::bail!("expected a CUDA tensor")
        };
        macro_rules! ptr {
            ($t:ty) => {{
                cs.as_cuda_slice::<$t>()?.device_ptr(&self.stream)
            }};
        }
        let (base, sync) = match self.dtype {
            DType::BF16 => ptr!(half::bf16),
            DType::F16 => ptr!(half::f16),
            DType::F32 => ptr!(f32),
            DType::F64 => ptr!(f64),
            dt => candle_core::bail!("unsupported dtype {dt:?}"),
        };
        Ok(DeviceAddress {
            addr: base + self.offset,
            _sync: sync,
        })
    }
}

/// A device address from [`CudaMemory::address`], valid while this guard lives.
pub struct DeviceAddress<'a> {
    addr: u64,
    _sync: SyncOnDrop<'a>,
}

impl DeviceAddress<'_> {
    /// The address, for a launch enqueued while this guard lives (using it is
    /// the launch's `unsafe`).
    pub fn get(&self) -> u64 {
        self.addr
    }
}

/// Records `err`, met where no error can be returned (a `Drop`), on `ctx` as
/// cudarc records its own: the context's next checked call (`check_err`, which
/// cudarc runs before binding the context, making streams, ...) returns it.
/// An error whose driver code is not recoverable (not a driver error, or one
/// wrapped as text) is recorded as `CUDA_ERROR_UNKNOWN`.
pub fn record_dropped_error(ctx: &cudarc::driver::CudaContext, err: &candle_core::Error) {
    use cudarc::driver::DriverError;
    fn driver(e: &candle_core::Error) -> Option<DriverError> {
        match e {
            candle_core::Error::Cuda(b) => b.downcast_ref::<DriverError>().copied(),
            candle_core::Error::Context { inner, .. } => driver(inner),
            candle_core::Error::WithBacktrace { inner, .. } => driver(inner),
            _ => None,
        }
    }
    let code = driver(err).unwrap_or(DriverError(sys::CUresult::CUDA_ERROR_UNKNOWN));
    ctx.record_err::<()>(Err(code));
}
