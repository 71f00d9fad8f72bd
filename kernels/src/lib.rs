//! The project's own CUDA kernels, compiled by `build.rs` from
//! `kernels/src/*.cu` with nvcc for the compute capability in
//! `CUDA_COMPUTE_CAP`, and the one way the other crates load them.
//!
//! Each `.cu` file becomes a [`Module`]: a fat binary holding machine code
//! (SASS) for the build's GPU beside its PTX. The driver runs the machine code
//! as it is; only another GPU would make it compile the PTX at first launch
//! (which, for these modules, takes tens of seconds). `function` (CUDA builds) loads a
//! module once per device context and looks a kernel up in it.
//!
//! Without the `cuda` feature this crate is empty and needs no CUDA toolkit.
//!
//! ```
//! // The crate compiles on every machine; the modules exist only with `cuda`.
//! #[cfg(feature = "cuda")]
//! assert!(!streamer_kernels::CAST.is_empty());
//! ```
#![warn(missing_docs)]
// Images and a loader over cudarc's safe API: nothing here needs unsafe.
#![forbid(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(feature = "cuda")]
mod loader;
#[cfg(feature = "cuda")]
pub use loader::{function, Kernel};

/// One compiled `.cu` file.
#[derive(Debug)]
pub struct Module {
    /// The name it is registered under with a device context.
    pub name: &'static str,
    /// The fat binary (machine code and PTX); empty where the build's GPU
    /// cannot run the file's kernels (see `ATTENTION_HOPPER`).
    pub image: &'static [u8],
}

impl Module {
    /// Whether the build left this module empty.
    pub fn is_empty(&self) -> bool {
        self.image.is_empty()
    }
}

#[cfg(feature = "cuda")]
macro_rules! module {
    ($name:literal, $file:literal) => {
        Module {
            name: $name,
            image: include_bytes!(concat!(env!("OUT_DIR"), "/", $file, ".fatbin")),
        }
    };
}

/// Element-wise dtype conversions (f32 <-> bf16 / f16) between raw device
/// buffers, used by the pool to convert streamed masters and gradients, and
/// the byte comparison that verifies a block kept on the device.
#[cfg(feature = "cuda")]
pub const CAST: Module = module!("streamer_cast", "cast");

/// Dequantization of quantized frozen weights (crate `streamer-quant`: NF4 and
/// FP4 with plain or double-quantized absmax, int8 rows, fp8 e4m3) into bf16.
#[cfg(feature = "cuda")]
pub const DEQUANT: Module = module!("streamer_dequant", "dequant");

/// A kernel that waits a given number of nanoseconds, enqueued on the transfer
/// stream to simulate slow copies in tests.
#[cfg(feature = "cuda")]
pub const DELAY: Module = module!("streamer_delay", "delay");

/// Exact chunked attention (crate `cqsa`): forward and backward, simple f32-math
/// kernels for any head dim and tensor-core forward kernels for f16/bf16.
#[cfg(feature = "cuda")]
pub const ATTENTION: Module = module!("cqsa_attention", "attention");

/// The attention kernels for Hopper GPUs (compute capability 9.0): forward and
/// backward with `wgmma` fed by TMA copies, taking Q, K, V (and dO) as tensor
/// maps (crate `cqsa` builds them). Empty when the crate was built for another
/// `CUDA_COMPUTE_CAP`: callers then use the portable kernels in [`ATTENTION`].
#[cfg(feature = "cuda")]
pub const ATTENTION_HOPPER: Module = module!("cqsa_attention_hopper", "attention_hopper");

/// The decoder layer's fused backward pieces (SwiGLU derivative, RMSNorm
/// input and weight gradients), used by the models crate.
#[cfg(feature = "cuda")]
pub const DECODER: Module = module!("streamer_decoder", "decoder");

/// AdamW in one pass over a parameter, its gradient and both moments (the
/// device optimizer of streamer-autograd), rounding as the host optimizer does.
#[cfg(feature = "cuda")]
pub const OPTIM: Module = module!("streamer_optim", "optim");
