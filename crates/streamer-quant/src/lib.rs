//! Quantized frozen weights: the formats the peers write, held as packed host
//! bytes (what a streamed layer moves over PCIe), dequantized on the CPU here
//! (the reference the GPU paths are tested against), and made from dense
//! weights.
//!
//! - [`FourBit`]: bitsandbytes' 4-bit blockwise formats (NF4 and FP4, one
//!   absmax per block, optionally double-quantized absmax), the layout QLoRA
//!   checkpoints use.
//! - [`Int8Rows`]: bitsandbytes' `Linear8bitLt` weights, int8 with one absmax
//!   per output row.
//! - [`Fp8`]: float8 e4m3 with one scale per tensor or per output row, as
//!   transformers' fp8 checkpoints (`fbgemm_fp8`, `compressed-tensors`) hold
//!   them.
//!
//! A streamed layer keeps each quantized weight as ONE byte buffer
//! ([`HostTensor::to_bytes`], laid out as [`PackedLayout`] says): the pool
//! copies those bytes, and [`dequantize`] turns the buffer on the device
//! into a bf16 tensor. [`QuantScheme`] quantizes dense weights on load.
//!
//! Dequantization follows the order of operations of bitsandbytes' CUDA
//! kernels (f32 products, one rounding to the output type), so a dequantized
//! tensor equals theirs bit for bit.
//!
//! ```
//! use streamer_quant::{DequantizeHost, FourBit, FourBitType};
//! let w: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) / 64.0).collect();
//! let q = FourBit::quantize(&w, &[4, 64], FourBitType::Nf4, 64, false).unwrap();
//! assert_eq!(q.packed().len(), 128);
//! let back = q.dequantize_f32();
//! let worst = w.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
//! assert!(worst <= 0.16 * 2.0);
//! ```

/// The accessors of a row-scaled quantized matrix (a type with the fields
/// `name`, `rows` and `cols`): its name and `(rows, cols)`.
macro_rules! matrix_accessors {
    ($t:ty) => {
        impl $t {
            /// Renames the tensor.
            pub(crate) fn set_name(&mut self, name: &str) {
                self.name = name.to_string();
            }

            /// The tensor's name.
            pub fn name(&self) -> &str {
                &self.name
            }

            /// `(rows, cols)`.
            pub fn dims(&self) -> (usize, usize) {
                (self.rows, self.cols)
            }
        }
    };
}

#[cfg(feature = "cuda")]
mod cuda;
mod dequantize;
mod dequantize_host;
mod error;
mod four_bit;
mod fp8;
mod host_tensor;
mod int8;
mod on_device;
mod packed;
mod scheme;

pub use dequantize::dequantize;
pub use dequantize_host::DequantizeHost;
pub use error::QuantError;
pub use four_bit::{
    dynamic_map, Absmax, FourBit, FourBitType, NestedAbsmax, BLOCK_SIZES, FP4_CODE, NF4_CODE,
};
pub use fp8::{e4m3_to_f32, f32_to_e4m3, Fp8, Fp8Scale};
pub use host_tensor::HostTensor;
pub use int8::Int8Rows;
pub use on_device::{Dequantize, Uploaded};
pub use packed::{PackedFormat, PackedLayout, Sections};
pub use scheme::QuantScheme;

/// Results of this crate.
pub type Result<T> = std::result::Result<T, QuantError>;

/// Elements of a shape.
fn elements(shape: &[usize]) -> usize {
    shape.iter().product()
}
