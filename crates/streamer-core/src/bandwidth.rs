//! Measures the host-to-device copy bandwidth the pool can reach on this machine
//! (page-locked host memory, the pool's own copy path), the floor every
//! streaming figure is compared with.
use candle_core::{Device, Result};

/// Median host-to-device bandwidth in GB/s over `iters` copies of `bytes` from
/// page-locked host memory, timed with device events on a dedicated stream.
/// On the CPU device it measures a plain memory copy.
pub fn measure_h2d_gbps(device: &Device, bytes: usize, iters: usize) -> Result<f64> {
    let iters = iters.max(1);
    let host = vec![1u8; bytes];
    let mut times = Vec::with_capacity(iters);
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use cudarc::driver::sys::CUevent_flags;
            let ctx = dev.cuda_stream().context().clone();
            // SAFETY: `host` is a local Vec that outlives `_pin` (declared after it).
            let _pin = unsafe {
                crate::pages::PinnedRegion::register(&ctx, host.as_ptr() as *mut u8, bytes)?
            };
            let stream = ctx.new_stream().map_err(candle_core::Error::wrap)?;
            let (dst, ptr) =
                crate::cuda::alloc_flat(dev, candle_core::DType::F32, bytes.div_ceil(4))?;
            dev.cuda_stream()
                .synchronize()
                .map_err(candle_core::Error::wrap)?;
            let w = candle_core::Error::wrap;
            for i in 0..iters + 2 {
                let a = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                // SAFETY: dst holds at least `bytes`; host lives until the sync below.
                unsafe { crate::cuda::htod_async(ptr, host.as_ptr(), bytes, &stream)? };
                let b = stream
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(w)?;
                b.synchronize().map_err(w)?;
                if i >= 2 {
                    times.push(a.elapsed_ms(&b).map_err(w)? as f64 / 1e3);
                }
            }
            drop(dst);
        }
        _ => {
            let mut dst = vec![0u8; bytes];
            for _ in 0..iters {
                let t = std::time::Instant::now();
                dst.copy_from_slice(&host);
                std::hint::black_box(&dst);
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(bytes as f64 / times[times.len() / 2] / 1e9)
}
