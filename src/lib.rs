//! `candle-streamer`: train and run Candle models whose weights do not fit on the GPU.
//!
//! This package re-exports the workspace's crates and owns the top-level
//! `examples/`, `tests/` and `benches/`:
//!
//! - [`streamer_device`]: page-locked memory, copies, device-memory settings,
//!   atomic files: the plumbing under the others.
//! - [`streamer_core`]: the residency pool and `StreamedSequential` inference.
//! - [`streamer_autograd`]: training through the pool, with the optimizer on the host.
//! - [`cqsa`]: exact chunked attention as a Candle custom op.
//! - [`streamer_models`]: models written the ordinary Candle way.
//! - [`streamer_dist`]: collectives, data-parallel training, ring attention.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! let x = Tensor::ones((2, 2), candle_core::DType::F32, &Device::Cpu)?;
//! assert_eq!(x.sum_all()?.to_scalar::<f32>()?, 4.0);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub use cqsa;
pub use streamer_autograd;
pub use streamer_core;
pub use streamer_device;
pub use streamer_dist;
pub use streamer_models;
pub use streamer_quant;

pub mod cli;
pub mod report;

/// Helpers for the project's tests: the device list and the test macro.
pub mod test_utils {
    /// The CUDA device tests run on, with its own compute stream (so the pool's
    /// transfer stream is a different one).
    #[cfg(feature = "cuda")]
    pub fn cuda_device() -> candle_core::Result<candle_core::Device> {
        Ok(candle_core::Device::Cuda(
            candle_core::CudaDevice::new_with_stream(0)?,
        ))
    }

    /// Turns `fn name(dev: &Device) -> anyhow::Result<()>` into a CPU test
    /// `name::cpu` and, with the `cuda` feature, a CUDA test `name::cuda`, so GPU
    /// behaviour is checked by the very same assertions (like candle's `test_device!`).
    #[macro_export]
    macro_rules! test_device {
        ($name:ident) => {
            mod $name {
                #[test]
                fn cpu() -> anyhow::Result<()> {
                    super::$name(&candle_core::Device::Cpu)
                }

                #[cfg(feature = "cuda")]
                #[test]
                fn cuda() -> anyhow::Result<()> {
                    super::$name(&$crate::test_utils::cuda_device()?)
                }
            }
        };
    }
}
