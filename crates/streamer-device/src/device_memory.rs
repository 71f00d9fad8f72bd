//! Device memory held by CUDA's stream-ordered allocator between calls.
//!
//! Candle allocates through cudarc's `cuMemAllocAsync`, from the device's default
//! memory pool. That pool's release threshold is 0 by default: at every
//! synchronisation (a `to_device(Cpu)`, a `synchronize`) it hands all freed
//! memory back to the driver, so the next call maps its activations afresh, and
//! every allocation of a large output costs a trip through the driver. On the
//! H200 that made Candle's element-wise ops and GEMMs in a once-synchronised
//! loop several times slower than the same kernels on warm memory. Keeping the
//! freed memory in the pool (as PyTorch's caching allocator does) removes that
//! cost; [`trim_device_memory`] gives it back when wanted.
use candle_core::{Device, Result};

/// Keeps memory freed on `device` in CUDA's default memory pool instead of
/// returning it to the driver at each synchronisation. A no-op on the CPU.
/// `StreamedSequential` does this by default (`StreamConfig::retain_device_memory`).
pub fn retain_freed_device_memory(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return crate::cuda::set_release_threshold(d, u64::MAX);
    }
    let _ = device;
    Ok(())
}

/// Returns the memory the pool holds but no tensor uses to the driver (after
/// waiting for every stream of the device's context), so `cuMemGetInfo` sees
/// it free again. A no-op on the CPU.
pub fn trim_device_memory(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        // Memory freed on another stream (a pool's transfer stream, another
        // `CudaDevice` of the same GPU) returns to the pool only once that
        // stream has reached the free: this stream's synchronize is not enough.
        let ctx = d.cuda_stream().context().clone();
        ctx.synchronize().map_err(candle_core::Error::wrap)?;
        return crate::cuda::trim_pool(d);
    }
    let _ = device;
    Ok(())
}

/// Bytes the default pool of `device` holds without any tensor using them: free
/// for Candle's next allocations although `cuMemGetInfo` counts them as used.
/// Zero on the CPU.
pub fn pooled_idle_bytes(device: &Device) -> Result<usize> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return crate::cuda::pool_idle_bytes(d);
    }
    let _ = device;
    Ok(0)
}

/// Device memory Candle could allocate now: what the driver reports free plus
/// what the pool holds idle. `None` on the CPU (no device memory to budget).
pub fn free_device_memory(device: &Device) -> Result<Option<usize>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        let (free, _total) = crate::cuda::memory_info(d)?;
        return Ok(Some(free + crate::cuda::pool_idle_bytes(d)?));
    }
    let _ = device;
    Ok(None)
}

/// The device's memory in all (bytes); `None` on the CPU.
pub fn device_total_memory(device: &Device) -> Result<Option<usize>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return Ok(Some(crate::cuda::memory_info(d)?.1));
    }
    let _ = device;
    Ok(None)
}

/// The figures of CUDA's default memory pool of a device (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DevicePoolStats {
    /// Reserved from the driver now (used or idle).
    pub reserved: usize,
    /// Held by live allocations now.
    pub used: usize,
    /// The most ever reserved since the peaks were last reset.
    pub reserved_peak: usize,
    /// The most held by live allocations at any moment since the peaks were
    /// last reset: the workload's peak demand on the pool.
    pub used_peak: usize,
}

/// The default pool's figures on `device`; `None` on the CPU.
pub fn device_pool_stats(device: &Device) -> Result<Option<DevicePoolStats>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return crate::cuda::pool_stats(d).map(Some);
    }
    let _ = device;
    Ok(None)
}

/// Resets the peaks of [`device_pool_stats`] to the current figures, so the
/// next read gives the peaks since now. A no-op on the CPU.
pub fn reset_device_pool_peaks(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return crate::cuda::reset_pool_peaks(d);
    }
    let _ = device;
    Ok(())
}
