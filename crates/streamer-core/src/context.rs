//! Context-wide CUDA switches, only ever flipped by the caller.
//!
//! Nothing in this workspace changes such a switch on its own: a model is
//! built and run with the context as the caller left it.
use candle_core::{Device, Result};

/// Turns off cudarc's per-tensor event tracking for `device`'s CUDA context: CUDA
/// tensors created afterwards (on every device sharing that context object, not
/// only this model's) no longer record and wait on events when used, which saves
/// a few microseconds per kernel launch once the context has a second stream (the
/// pool's transfer stream). Tensors created before keep their tracking. A no-op
/// on the CPU.
///
/// # Safety
/// From this call on, the caller orders work across streams of this context
/// itself (cudarc's `CudaContext::disable_event_tracking` contract): no tensor may
/// be freed while another stream still uses it, used on another stream before its
/// allocation on its own stream is done, or written concurrently by two streams.
/// Candle runs every op of a device on that device's one stream, and the
/// streamer pool and cqsa order their extra streams with explicit events, so
/// code that only goes through them is fine; your own multi-stream code is
/// yours to order.
pub unsafe fn disable_cuda_event_tracking(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        // SAFETY: the caller took on cudarc's contract (this function's).
        unsafe { d.disable_event_tracking() };
    }
    let _ = device;
    Ok(())
}

/// Whether `device`'s CUDA context tracks per-tensor events (`None` on the CPU,
/// which has no such context).
pub fn cuda_event_tracking(device: &Device) -> Option<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return Some(d.is_event_tracking());
    }
    let _ = device;
    None
}
