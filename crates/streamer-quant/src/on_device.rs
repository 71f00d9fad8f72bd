//! Quantized tensors dequantized into bf16 Candle tensors on a device: on
//! the CPU by this crate's reference code, on a GPU by the kernels of
//! `kernels/src/dequant.cu` (the same bits). The weight moves in its packed
//! form; only the dequantized copy is dense.
use crate::{FourBit, Fp8, Int8Rows};
use candle_core::{Device, Result, Tensor};

/// A quantized tensor that can be made dense on a device.
pub trait Dequantize {
    /// The tensor in bf16 on `dev`, of its shape.
    fn dequantize_on(&self, dev: &Device) -> Result<Tensor>;
}

impl Dequantize for FourBit {
    fn dequantize_on(&self, dev: &Device) -> Result<Tensor> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => crate::cuda::four_bit(d, self),
            _ => Tensor::from_vec(self.dequantize_bf16(), self.shape(), dev),
        }
    }
}

impl Dequantize for Int8Rows {
    fn dequantize_on(&self, dev: &Device) -> Result<Tensor> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => crate::cuda::int8_rows(d, self),
            _ => Tensor::from_vec(self.dequantize_bf16(), self.dims(), dev),
        }
    }
}

impl Dequantize for Fp8 {
    fn dequantize_on(&self, dev: &Device) -> Result<Tensor> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => crate::cuda::fp8(d, self),
            _ => Tensor::from_vec(self.dequantize_bf16(), self.dims(), dev),
        }
    }
}
