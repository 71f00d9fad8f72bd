//! The project's own CUDA kernels, as PTX text compiled by `build.rs` from
//! `kernels/src/*.cu` with nvcc, for the compute capability in `CUDA_COMPUTE_CAP`.
//!
//! Without the `cuda` feature this crate is empty and needs no CUDA toolkit. With
//! it, each `.cu` file becomes a constant holding its PTX, which the other crates
//! load through Candle's `CudaDevice::get_or_load_custom_func`.
//!
//! ```
//! // The crate compiles on every machine; the PTX constants exist only with `cuda`.
//! #[cfg(feature = "cuda")]
//! assert!(streamer_kernels::CAST.contains(".entry"));
//! ```
#![warn(missing_docs)]
// PTX text only: nothing here needs unsafe.
#![forbid(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

/// Element-wise dtype conversions (f32 <-> bf16 / f16) between raw device
/// buffers, used by the pool to convert streamed masters and gradients, and
/// the byte comparison that verifies a block kept on the device.
#[cfg(feature = "cuda")]
pub const CAST: &str = include_str!(concat!(env!("OUT_DIR"), "/cast.ptx"));

/// A kernel that waits a given number of nanoseconds, enqueued on the transfer
/// stream to simulate slow copies in tests.
#[cfg(feature = "cuda")]
pub const DELAY: &str = include_str!(concat!(env!("OUT_DIR"), "/delay.ptx"));

/// Exact chunked attention (crate `cqsa`): forward and backward, simple f32-math
/// kernels for any head dim and tensor-core forward kernels for f16/bf16.
#[cfg(feature = "cuda")]
pub const ATTENTION: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));

/// The attention kernels for Hopper GPUs (compute capability 9.0): forward and
/// backward with `wgmma` fed by TMA copies, taking Q, K, V (and dO) as tensor
/// maps (crate `cqsa` builds them). Empty when the crate was built for another
/// `CUDA_COMPUTE_CAP`: callers then use the portable kernels in [`ATTENTION`].
#[cfg(feature = "cuda")]
pub const ATTENTION_HOPPER: &str = include_str!(concat!(env!("OUT_DIR"), "/attention_hopper.ptx"));

/// The decoder layer's fused backward pieces (SwiGLU derivative, RMSNorm
/// input and weight gradients), used by the models crate.
#[cfg(feature = "cuda")]
pub const DECODER: &str = include_str!(concat!(env!("OUT_DIR"), "/decoder.ptx"));

/// AdamW in one pass over a parameter, its gradient and both moments (the
/// device optimizer of streamer-autograd), rounding as the host optimizer does.
#[cfg(feature = "cuda")]
pub const OPTIM: &str = include_str!(concat!(env!("OUT_DIR"), "/optim.ptx"));

/// Module names under which the PTX above is registered with a Candle device.
pub mod module {
    /// Module name of [`super::CAST`].
    pub const CAST: &str = "streamer_cast";
    /// Module name of [`super::ATTENTION`].
    pub const ATTENTION: &str = "cqsa_attention";
    /// Module name of [`super::ATTENTION_HOPPER`].
    pub const ATTENTION_HOPPER: &str = "cqsa_attention_hopper";
    /// Module name of [`super::DECODER`].
    pub const DECODER: &str = "streamer_decoder";
    /// Module name of [`super::OPTIM`].
    pub const OPTIM: &str = "streamer_optim";
    /// Module name of [`super::DELAY`].
    pub const DELAY: &str = "streamer_delay";
}
