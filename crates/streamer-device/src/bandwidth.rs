//! Measures the copy bandwidths the pool and the streamed attention can reach on
//! this machine (page-locked host memory, the pool's own copy path), the floors
//! every streaming figure is compared with, and the cost of page-locking host
//! memory in place.
use candle_core::{Device, Result};

/// Which way a measured copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Host to device.
    HostToDevice,
    /// Device to host.
    DeviceToHost,
}

/// Median host-to-device bandwidth in GB/s over `iters` copies of `bytes` from
/// page-locked host memory, timed with device events on a dedicated stream.
/// On the CPU device it measures a plain memory copy.
pub fn measure_h2d_gbps(device: &Device, bytes: usize, iters: usize) -> Result<f64> {
    measure_copy_gbps(device, CopyDirection::HostToDevice, bytes, iters)
}

/// Median bandwidth in GB/s over `iters` copies of `bytes` between page-locked
/// host memory and the device, in `direction`, timed with device events on a
/// dedicated stream (two untimed copies first). On the CPU device it measures a
/// plain memory copy either way.
pub fn measure_copy_gbps(
    device: &Device,
    direction: CopyDirection,
    bytes: usize,
    iters: usize,
) -> Result<f64> {
    if bytes == 0 {
        candle_core::bail!("measure_copy_gbps: cannot time a copy of 0 bytes")
    }
    let iters = iters.max(1);
    let mut host = vec![1u8; bytes];
    let mut times = Vec::with_capacity(iters);
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use cudarc::driver::{sys::CUevent_flags, DevicePtr};
            let ctx = dev.cuda_stream().context().clone();
            // SAFETY: `host` is a local Vec that outlives `_pin` (declared after it).
            let _pin =
                unsafe { crate::pages::PinnedRegion::register(&ctx, host.as_mut_ptr(), bytes)? };
            let stream = ctx.new_stream().map_err(candle_core::Error::wrap)?;
            let w = candle_core::Error::wrap;
            let dst = dev.cuda_stream().alloc_zeros::<u8>(bytes).map_err(w)?;
            dev.cuda_stream().synchronize().map_err(w)?;
            // Held across every copy below (the copies run on `stream`).
            let (ptr, _dst_guard) = dst.device_ptr(&stream);
            for i in 0..iters + 2 {
                let a = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                match direction {
                    // SAFETY: dst holds at least `bytes`; host lives until the sync below.
                    CopyDirection::HostToDevice => unsafe {
                        crate::cuda::htod_async(ptr, host.as_ptr(), bytes, &stream)?
                    },
                    // SAFETY: as above; `host` is not read before the sync below
                    // (a piece left pageable by the page rounding is copied
                    // synchronously, which is correct, only not overlapped).
                    CopyDirection::DeviceToHost => unsafe {
                        crate::cuda::dtoh_pieces(host.as_mut_ptr(), ptr, bytes, &stream)?
                    },
                }
                let b = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                b.synchronize().map_err(w)?;
                if i >= 2 {
                    times.push(a.elapsed_ms(&b).map_err(w)? as f64 / 1e3);
                }
            }
            drop(_dst_guard);
            drop(dst);
        }
        _ => {
            let _ = direction;
            let mut dst = vec![0u8; bytes];
            for _ in 0..iters {
                let t = std::time::Instant::now();
                dst.copy_from_slice(&host);
                std::hint::black_box(&mut dst);
                times.push(t.elapsed().as_secs_f64());
            }
            std::hint::black_box(&mut host);
        }
    }
    Ok(bytes as f64 / median(times) / 1e9)
}

/// Median rate in GB/s of page-locking `bytes` of freshly allocated host memory
/// in place (`cuMemHostRegister`, then unregistering, which is timed too), over
/// `iters` tries: what the streamed attention pays before its first copy. On
/// the CPU device, and where registration is refused or turned off
/// (`STREAMER_PIN=0`), `None`: nothing is page-locked there.
pub fn measure_pin_gbps(device: &Device, bytes: usize, iters: usize) -> Result<Option<f64>> {
    if bytes == 0 {
        candle_core::bail!("measure_pin_gbps: cannot time the registration of 0 bytes")
    }
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let ctx = dev.cuda_stream().context().clone();
            median_rate(bytes, iters, || {
                // Touched first, as a real input is: registration then only locks.
                let mut host = vec![1u8; bytes];
                let t = std::time::Instant::now();
                // SAFETY: `host` outlives the region, which is dropped at once.
                let pin = unsafe {
                    crate::pages::PinnedRegion::register(&ctx, host.as_mut_ptr(), bytes)?
                };
                let Some(pin) = pin else { return Ok(None) };
                drop(pin);
                let secs = t.elapsed().as_secs_f64();
                std::hint::black_box(&mut host);
                Ok(Some(secs))
            })
        }
        _ => {
            let _ = iters;
            Ok(None)
        }
    }
}

/// Median rate in GB/s of allocating `bytes` of page-locked host memory
/// (`cuMemHostAlloc` as [`crate::pages`]' `alloc_readable` makes it; the free
/// is not timed), over `iters` tries: what
/// a streamed attention call pays for the staging buffers its results come
/// back through, which are kept between calls rather than freed. `None` on the
/// CPU device: nothing is page-locked there.
pub fn measure_pinned_alloc_gbps(
    device: &Device,
    bytes: usize,
    iters: usize,
) -> Result<Option<f64>> {
    if bytes < 4 {
        candle_core::bail!("measure_pinned_alloc_gbps: cannot time an allocation of {bytes} bytes")
    }
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            let ctx = dev.cuda_stream().context().clone();
            median_rate(bytes, iters, || {
                let t = std::time::Instant::now();
                // SAFETY: the buffer is never read; it is freed at once.
                let buf = unsafe { crate::pages::alloc_readable::<f32>(&ctx, bytes / 4)? };
                let secs = t.elapsed().as_secs_f64();
                drop(buf);
                Ok(Some(secs))
            })
        }
        _ => {
            let _ = iters;
            Ok(None)
        }
    }
}

/// GB/s of `bytes` at the median of `iters` (at least one) timings by
/// `once`, which returns its seconds, or `None` when the operation is not
/// available (then so is the rate).
#[cfg(feature = "cuda")]
fn median_rate(
    bytes: usize,
    iters: usize,
    mut once: impl FnMut() -> Result<Option<f64>>,
) -> Result<Option<f64>> {
    let mut times = Vec::with_capacity(iters.max(1));
    for _ in 0..iters.max(1) {
        let Some(secs) = once()? else { return Ok(None) };
        times.push(secs);
    }
    Ok(Some(bytes as f64 / median(times) / 1e9))
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2].max(1e-12)
}
