//! A quantized tensor of any format, as held in host memory.
use crate::{DequantizeHost, FourBit, Fp8, Int8Rows};
use half::bf16;

/// A quantized tensor in host memory, of any format.
#[derive(Clone, Debug)]
pub enum HostTensor {
    /// NF4 or FP4.
    FourBit(FourBit),
    /// int8 rows.
    Int8(Int8Rows),
    /// fp8 e4m3.
    Fp8(Fp8),
}

impl HostTensor {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        match self {
            Self::FourBit(q) => q.name(),
            Self::Int8(q) => q.name(),
            Self::Fp8(q) => q.name(),
        }
    }

    /// The same tensor under another name (what an error about it names).
    pub fn with_name(mut self, name: &str) -> Self {
        match &mut self {
            Self::FourBit(q) => q.set_name(name),
            Self::Int8(q) => q.set_name(name),
            Self::Fp8(q) => q.set_name(name),
        }
        self
    }

    /// The dense tensor's shape.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Self::FourBit(q) => q.shape().to_vec(),
            Self::Int8(q) => vec![q.dims().0, q.dims().1],
            Self::Fp8(q) => vec![q.dims().0, q.dims().1],
        }
    }

    /// Every element rounded once to bf16 (the CPU reference).
    pub fn dequantize_bf16(&self) -> Vec<bf16> {
        match self {
            Self::FourBit(q) => q.dequantize_bf16(),
            Self::Int8(q) => q.dequantize_bf16(),
            Self::Fp8(q) => q.dequantize_bf16(),
        }
    }

    /// Bytes a copy of the tensor moves, as stored.
    pub fn stored_bytes(&self) -> usize {
        match self {
            Self::FourBit(q) => q.stored_bytes(),
            Self::Int8(q) => q.stored_bytes(),
            Self::Fp8(q) => q.stored_bytes(),
        }
    }
}
