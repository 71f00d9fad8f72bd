//! Dequantization of a packed buffer held as a Candle tensor (a streamed
//! layer's slot, or any u8 tensor): the CPU reads it with this crate's
//! reference code, a GPU runs `kernels/src/dequant.cu` on the bytes in
//! place (no copy of the packed data).
use crate::{PackedLayout, QuantError};
use candle_core::{Device, Result, Tensor};

/// The bf16 tensor (of `layout`'s shape, on `bytes`' device) that the packed
/// buffer `bytes` holds: a contiguous 1-D u8 tensor of `layout.bytes()`
/// bytes (see [`PackedLayout`] for the byte order). Bit-identical on the CPU
/// and on CUDA: each element is its f32 product rounded once to bf16.
/// A buffer of another dtype, rank or length is an error naming the tensor.
pub fn dequantize(bytes: &Tensor, layout: &PackedLayout) -> Result<Tensor> {
    let q = |e: QuantError| candle_core::Error::wrap(e);
    if bytes.dtype() != candle_core::DType::U8 || bytes.rank() != 1 || !bytes.is_contiguous() {
        return Err(q(QuantError::NotBytes {
            tensor: layout.name().to_string(),
            dtype: format!("{:?}", bytes.dtype()),
            shape: bytes.dims().to_vec(),
        }));
    }
    layout.check_len(bytes.elem_count()).map_err(q)?;
    match bytes.device() {
        Device::Cpu => {
            let host = layout.unpack(&bytes.to_vec1::<u8>()?).map_err(q)?;
            Tensor::from_vec(host.dequantize_bf16(), layout.shape(), &Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => crate::cuda::dequantize_packed(bytes, layout),
        other => candle_core::bail!(
            "{}: quantized tensors dequantize on the CPU or a CUDA GPU, not {:?}",
            layout.name(),
            other.location()
        ),
    }
}
