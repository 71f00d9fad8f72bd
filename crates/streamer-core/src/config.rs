//! How a streamed model is placed and moved.
use candle_core::{DType, Device};
use std::path::PathBuf;

/// Configuration of a [`crate::StreamedSequential`] and its pool.
///
/// Building a model changes nothing context-wide that this struct does not
/// name: the pool orders its transfer stream with its own events and works
/// whether or not the CUDA context tracks per-tensor events (cudarc's default,
/// which costs a few microseconds per kernel once a second stream exists). To
/// trade that safety net for speed, opt in explicitly with the `unsafe`
/// [`crate::disable_cuda_event_tracking`] before building.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Where blocks compute. Weights always live on the host.
    pub device: Device,
    /// Blocks loaded ahead of the one computing; the window is `prefetch_ahead + 1`.
    pub prefetch_ahead: usize,
    /// Compute dtype: the dtype of the weights on the device and of the inputs.
    pub dtype: DType,
    /// Dtype of the host masters; `None` means the compute dtype. An f32 master with
    /// bf16/f16 compute is converted on the device after each copy.
    pub master_dtype: Option<DType>,
    /// Upper bound on one slot's bytes; a block larger than this is an error.
    /// `None` sizes slots to the largest block.
    pub slot_budget_bytes: Option<usize>,
    /// Tied weights stored once under another name: `(alias, canonical)` pairs.
    /// In-memory tensors that share storage are detected without this.
    pub aliases: Vec<(String, String)>,
    /// Record a Chrome-trace/Perfetto timeline of copies and compute; written by
    /// [`crate::StreamedSequential::write_timeline`].
    pub timeline: bool,
    /// Where `write_timeline` writes when given no path.
    pub timeline_path: Option<PathBuf>,
    /// Repeated inference: after a call's last blocks, start loading the first
    /// blocks for the next call, so its first copies hide behind this call's tail.
    /// The window still holds. Those copies read the host masters after the call
    /// has returned, so a master changed before the next call (`Var::set`, an
    /// optimizer step) would be computed with as it was: turning this on takes
    /// the `unsafe` [`AcrossCalls::promise_masters_unchanged`]. `None` (the
    /// default) loads every call's weights during that call.
    pub prefetch_across_calls: Option<AcrossCalls>,
    /// Keep device memory freed between calls in CUDA's memory pool instead of
    /// handing it back to the driver at every synchronisation (see
    /// [`crate::retain_freed_device_memory`]); on by default, like PyTorch's
    /// caching allocator. It applies to the whole device, not only this model.
    pub retain_device_memory: bool,
    /// Training on CUDA: when an optimizer stepped a block's masters on the
    /// device and they were written back, the next training forward computes
    /// with that copy at once instead of copying the block again, and checks it
    /// against the host masters behind the call's other copies (running the
    /// call again if they changed). Costs one block's masters of device memory
    /// for the check. On by default; nothing it does is observable but time.
    pub reuse_stepped_blocks: bool,
    /// Testing aid: make every block's transfer take at least this long (a
    /// sleep on the CPU, a waiting kernel on the transfer stream on CUDA).
    pub transfer_delay: Option<std::time::Duration>,
    /// Told of each phase while the model is built (every block's masters,
    /// page-locking, the end), so a caller can show progress on a big model.
    pub on_setup: Option<crate::SetupHook>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            prefetch_ahead: 1,
            dtype: DType::F32,
            master_dtype: None,
            slot_budget_bytes: None,
            aliases: Vec::new(),
            timeline: false,
            timeline_path: None,
            transfer_delay: None,
            prefetch_across_calls: None,
            retain_device_memory: true,
            reuse_stepped_blocks: true,
            on_setup: None,
        }
    }
}

/// Permission for [`StreamConfig::prefetch_across_calls`]: the caller's promise
/// that the model's host masters do not change between its calls while blocks
/// are loaded ahead. Only the `unsafe` constructor makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcrossCalls(());

impl AcrossCalls {
    /// Lets a model load the next call's first blocks at the end of a call.
    ///
    /// # Safety
    /// Between two calls of a model built with this, the caller must not change
    /// any of its host masters (`Var::set` or `slice_set` on what
    /// `StreamedSequential::parameters` returns, an optimizer step) without first
    /// calling `StreamedSequential::evict_all`, and must not change one from
    /// another thread while a call runs. Otherwise the early copies read the
    /// masters while they are written (a data race on the host buffer, whose
    /// pages the device reads by DMA) or the next call computes silently with
    /// the weights from before the change.
    pub unsafe fn promise_masters_unchanged() -> Self {
        Self(())
    }
}

impl StreamConfig {
    /// The dtype of the host masters.
    pub fn master_dtype(&self) -> DType {
        self.master_dtype.unwrap_or(self.dtype)
    }

    /// Number of device slots (blocks that may hold device state at once).
    pub fn window(&self) -> usize {
        self.prefetch_ahead + 1
    }

    /// Rejects requests that cannot work, before anything is loaded.
    pub fn validate(&self) -> candle_core::Result<()> {
        for (what, dt) in [("dtype", self.dtype), ("master_dtype", self.master_dtype())] {
            if !dt.is_float() {
                return Err(streamer_device::Error::Config {
                    field: format!("StreamConfig.{what}"),
                    reason: format!("must be a float dtype (f16, bf16, f32, f64), got {dt:?}"),
                }
                .into());
            }
        }
        if self.slot_budget_bytes == Some(0) {
            return Err(streamer_device::Error::Config {
                field: "StreamConfig.slot_budget_bytes".into(),
                reason: "must be positive, got 0".into(),
            }
            .into());
        }
        Ok(())
    }
}
