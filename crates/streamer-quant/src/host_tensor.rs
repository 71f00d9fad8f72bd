//! A quantized tensor of any format, as held in host memory.
use crate::{FourBit, Fp8, Int8Rows};

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
