//! `streamer-core`: run native Candle blocks whose weights live in host memory,
//! streamed through a bounded window of device slots.
//!
//! - [`StreamedSequential`]: a sequence of blocks built from `VarBuilder`s, run
//!   with at most `prefetch_ahead + 1` blocks' weights on the device.
//! - [`ResidencyPool`]: the slots, the transfer stream and its events, and the
//!   statistics ([`StreamStats`]); the training crate drives it in reverse.
//! - [`HostMasters`]: one host copy of each weight, page-locked in place on CUDA.
//!
//! Everything runs on the CPU too (copies are memory copies), which is what CI
//! tests; the `cuda` feature adds the CUDA path with the same behaviour.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, VarBuilder, VarMap};
//! use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
//!
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! for i in 0..3 {
//!     linear(8, 8, vb.pp(format!("layers.{i}")))?;
//! }
//! let blocks = (0..3)
//!     .map(|i| BlockSpec::module(format!("layers.{i}"), |vb| linear(8, 8, vb)))
//!     .collect();
//! let cfg = StreamConfig { prefetch_ahead: 1, ..Default::default() };
//! let model = StreamedSequential::from_varmap(&varmap, blocks, cfg)?;
//! let y = model.forward(&Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?)?;
//! assert_eq!(y.dims(), &[2, 8]);
//! println!("{}", model.stats()?);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod block;
mod config;
mod context;
mod convert;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod device_cap;
pub mod faults;
mod host;
mod offload;
mod packed;
mod pool;
#[cfg(feature = "cuda")]
mod reuse;
mod sequential;
mod setup;
mod source;
mod stats;
mod timeline;

pub use block::{
    mix_seed, Block, BlockCtx, BlockSpec, ManualBackward, ModuleBlock, SavedActivations,
};
pub use config::{AcrossCalls, StreamConfig};
pub use context::{cuda_event_tracking, disable_cuda_event_tracking};
pub use convert::convert;
pub use device_cap::DeviceCap;
#[cfg(feature = "cuda")]
pub use host::{host_bytes, upload, PinnedHost};
pub use host::{HostMasters, Master};
pub use offload::{OffloadMarker, Offloader};
pub use packed::is_packed;
pub use pool::{BlockLayout, DeviceMaster, Entry, ResidencyPool};
pub use sequential::{
    discovering, release_all, run_blocks_with, stand_in, PoolView, RunBlock, StreamedSequential,
};
pub use setup::{SetupEvent, SetupHook, SetupTimes};
pub use source::{expand_paths, WeightSource};
pub use stats::{Observer, StreamStats, Transition, TransitionKind, TRANSITION_LOG_LEN};
pub use timeline::{Timeline, TraceEvent, TraceKind};
// The device plumbing a streaming user reaches for beside the pool (memory
// settings, copies, atomic saves) lives in `streamer-device`; its public
// items stay reachable here under their old paths.
pub use streamer_device::{
    covers_storage, device_pool_stats, device_total_memory, free_device_memory,
    host_available_memory, measure_copy_gbps, measure_h2d_gbps, measure_pin_gbps,
    measure_pinned_alloc_gbps, pages, pooled_idle_bytes, replace_atomic, reset_device_pool_peaks,
    retain_freed_device_memory, save_atomic, sibling_file, sync_dir, temp_path, to_device_compact,
    trim_device_memory, with_backward3, Backward3, CopyDirection, DevicePoolStats,
};
#[cfg(feature = "cuda")]
pub use streamer_device::{grid_stride, kernel_suffix};
