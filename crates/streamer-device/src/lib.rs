//! `streamer-device`: the plumbing under the workspace's crates, which neither
//! holds a model nor streams one.
//!
//! - [`pages`]: host pages and page-locking in place (`pages::PinnedRegion`
//!   with `cuda`), shared by the pool, the gradient offload and the streamed
//!   attention.
//! - [`to_device_compact`]: moving a view without its whole storage.
//! - [`HostBuffer`]: host bytes (page-locked for CUDA) that tensors are
//!   copied into and out of without waiting, read on the host only once the
//!   copies are done (the batched decode's kv cache in host memory).
//! - Device memory: the CUDA memory pool's figures and settings
//!   ([`pooled_idle_bytes`], [`retain_freed_device_memory`], ...), host memory
//!   ([`host_available_memory`]) and copy bandwidths ([`measure_copy_gbps`]).
//! - Files written whole or not at all ([`replace_atomic`], [`write_atomic`]).
//! - [`Error`]: the kinds of failure callers match on (out of memory, shape,
//!   dtype, checkpoint, configuration, CUDA), inside `candle_core::Error`.
//! - [`with_backward3`]: a graph node with a hand-written backward.
//! - `cuda` (with the `cuda` feature): the raw copies, kernel launch helpers
//!   (`kernel_suffix`, `grid_stride`, `allow_smem`) and `CudaMemory`, which
//!   hands out a tensor's device address under a guard that lives across the
//!   launch using it.
//!
//! Everything but the `cuda` module works on the CPU (a no-op or `None` where
//! there is no device memory).
//!
//! ```
//! use candle_core::{Device, Tensor};
//!
//! let big = Tensor::arange(0f32, 1024., &Device::Cpu)?;
//! let head = big.narrow(0, 0, 8)?;
//! assert!(!streamer_device::covers_storage(&head));
//! let moved = streamer_device::to_device_compact(&head, &Device::Cpu)?;
//! assert_eq!(moved.dims(), &[8]);
//! assert_eq!(streamer_device::pooled_idle_bytes(&Device::Cpu)?, 0);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod bandwidth;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device_memory;
pub mod error;
mod files;
mod host_buffer;
mod host_memory;
pub mod pages;
mod precomputed;
mod transfer;

pub use bandwidth::{
    measure_copy_gbps, measure_h2d_gbps, measure_pin_gbps, measure_pinned_alloc_gbps, CopyDirection,
};
#[cfg(feature = "cuda")]
pub use cuda::{
    allow_smem, grid_stride, kernel_suffix, record_dropped_error, slice_tensor, CudaMemory,
    DeviceAddress,
};
pub use device_memory::{
    device_pool_stats, device_total_memory, free_device_memory, pooled_idle_bytes,
    reset_device_pool_peaks, retain_freed_device_memory, trim_device_memory, DevicePoolStats,
};
pub use error::Error;
pub use files::{replace_atomic, save_atomic, sibling_file, sync_dir, temp_path, write_atomic};
pub use host_buffer::{HostBuffer, Region};
pub use host_memory::host_available_memory;
pub use precomputed::{with_backward3, Backward3};
pub use transfer::{covers_storage, to_device_compact};
