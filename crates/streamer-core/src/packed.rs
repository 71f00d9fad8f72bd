//! Packed masters: u8 host masters (quantized weights as one byte buffer
//! each) kept as bytes. Slots hold the compute dtype, so a packed master
//! takes `ceil(bytes / dtype size)` of its elements and is copied as raw
//! bytes (never converted); a block reads it back as a u8 tensor of its own
//! length, which its builder decodes (dequantizes) itself. Packed masters
//! are never trainable.
use candle_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

/// Whether a master of `dtype` is packed bytes.
pub fn is_packed(dtype: DType) -> bool {
    dtype == DType::U8
}

/// Elements of a slot of `dtype` that a master of `bytes` bytes occupies
/// when packed.
pub(crate) fn packed_elems(bytes: usize, dtype: DType) -> usize {
    bytes.div_ceil(dtype.size_in_bytes())
}

/// `bytes` as a 1-D CPU tensor of `dtype` with the same bits (the last
/// element zero-padded).
pub(crate) fn bytes_as(bytes: &[u8], dtype: DType) -> Result<Tensor> {
    let n = packed_elems(bytes.len(), dtype);
    let mut padded = bytes.to_vec();
    padded.resize(n * dtype.size_in_bytes(), 0);
    let cpu = &Device::Cpu;
    match dtype {
        DType::BF16 => Tensor::from_vec(halves(&padded, bf16::from_bits), n, cpu),
        DType::F16 => Tensor::from_vec(halves(&padded, f16::from_bits), n, cpu),
        DType::F32 => {
            let v: Vec<f32> = (padded.chunks_exact(4))
                .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            Tensor::from_vec(v, n, cpu)
        }
        DType::U8 => Tensor::from_vec(padded, n, cpu),
        dt => {
            candle_core::bail!("packed masters ride in slots of bf16, f16, f32 or u8, not {dt:?}")
        }
    }
}

/// `bytes` read two at a time (little-endian) as the bits of a 16-bit float.
fn halves<T>(bytes: &[u8], from_bits: fn(u16) -> T) -> Vec<T> {
    (bytes.chunks_exact(2))
        .map(|c| from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// The first `len` bytes of the 1-D CPU tensor `t`'s data, as a u8 tensor
/// (the inverse of [`bytes_as`]).
pub(crate) fn as_bytes(t: &Tensor, len: usize) -> Result<Tensor> {
    let mut out: Vec<u8> = match t.dtype() {
        DType::BF16 => (t.to_vec1::<bf16>()?.iter())
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => (t.to_vec1::<f16>()?.iter())
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F32 => (t.to_vec1::<f32>()?.iter())
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::U8 => t.to_vec1::<u8>()?,
        dt => {
            candle_core::bail!("packed masters ride in slots of bf16, f16, f32 or u8, not {dt:?}")
        }
    };
    if out.len() < len {
        candle_core::bail!(
            "a packed master of {len} bytes overruns its {} slot bytes",
            out.len()
        );
    }
    out.truncate(len);
    Tensor::from_vec(out, len, &Device::Cpu)
}
