//! The models' ops layer: what runs below the layers.
//!
//! - [`fused`]: RMSNorm, the rotary embedding, SwiGLU and the residual add
//!   with its norm, forward and backward; Candle ops on every device, one
//!   kernel each on CUDA where it applies.
//! - `decoder` (CUDA): those kernels (`kernels/src/decoder.cu`) and the
//!   cross-entropy and embedding ones, each one call of `launch`.
//! - `lt` (CUDA): the cuBLASLt GEMMs with the epilogues `FusedLinear` and
//!   `FusedMlp` train with.
//! - `launch` (CUDA): the one launch helper and the typed views of Candle's
//!   CUDA storages the other two use.
//! - `gelu`: the tanh GELU's derivative the fused layers' backwards share.
pub mod fused;
pub(crate) mod gelu;

#[cfg(feature = "cuda")]
pub(crate) mod decoder;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub(crate) mod lt;
