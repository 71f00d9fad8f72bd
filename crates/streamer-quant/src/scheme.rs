//! How to quantize a dense weight when a model is quantized on load
//! (`--quantize nf4|fp4|int8|fp8`): the format and its settings, with the
//! defaults the peers use (bitsandbytes' 4-bit block size 64 without double
//! quantization, its int8 rows, fp8 with one scale per row).
use crate::{FourBit, FourBitType, Fp8, HostTensor, Int8Rows, PackedFormat, PackedLayout};
use crate::{QuantError, Result};

/// A quantization format and its settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantScheme {
    /// NF4 or FP4 blocks of `blocksize`, the absmax double-quantized when
    /// `double` (bitsandbytes' `bnb_4bit_use_double_quant`).
    FourBit {
        /// NF4 or FP4.
        kind: FourBitType,
        /// Elements an absmax covers.
        blocksize: usize,
        /// Double-quantized absmax.
        double: bool,
    },
    /// int8 with one absmax per output row.
    Int8,
    /// fp8 e4m3 with one scale per output row (`per_row`) or per tensor.
    Fp8 {
        /// One scale per row.
        per_row: bool,
    },
}

impl QuantScheme {
    /// `nf4` and `fp4` (block size 64, plain absmax), `int8`, `fp8` (row
    /// scales); anything else is an error.
    pub fn parse(s: &str) -> Result<Self> {
        let four = |kind| Self::FourBit {
            kind,
            blocksize: 64,
            double: false,
        };
        match s {
            "nf4" => Ok(four(FourBitType::Nf4)),
            "fp4" => Ok(four(FourBitType::Fp4)),
            "int8" => Ok(Self::Int8),
            "fp8" => Ok(Self::Fp8 { per_row: true }),
            other => Err(QuantError::Unsupported {
                tensor: "--quantize".into(),
                field: "format",
                value: other.to_string(),
                supported: "nf4, fp4, int8 or fp8",
            }),
        }
    }

    /// `values` (row-major, `shape`) quantized, the result named `name`.
    pub fn quantize(&self, name: &str, values: &[f32], shape: &[usize]) -> Result<HostTensor> {
        let t = match *self {
            Self::FourBit {
                kind,
                blocksize,
                double,
            } => HostTensor::FourBit(FourBit::quantize(values, shape, kind, blocksize, double)?),
            Self::Int8 => HostTensor::Int8(Int8Rows::quantize(values, rows_cols(name, shape)?)?),
            Self::Fp8 { per_row } => {
                HostTensor::Fp8(Fp8::quantize(values, rows_cols(name, shape)?, per_row)?)
            }
        };
        Ok(t.with_name(name))
    }

    /// The packed layout a tensor `name` of `shape` gets, without its data.
    pub fn layout(&self, name: &str, shape: &[usize]) -> Result<PackedLayout> {
        let format = match *self {
            Self::FourBit {
                kind,
                blocksize,
                double,
            } => PackedFormat::FourBit {
                kind,
                blocksize,
                nested: double.then_some(256),
            },
            Self::Int8 => PackedFormat::Int8,
            Self::Fp8 { per_row } => PackedFormat::Fp8 { per_row },
        };
        PackedLayout::new(name, shape, format)
    }
}

/// `(rows, cols)` of a 2-D shape; other ranks are an error naming `name`.
fn rows_cols(name: &str, shape: &[usize]) -> Result<(usize, usize)> {
    match shape {
        &[r, c] => Ok((r, c)),
        _ => Err(QuantError::Unsupported {
            tensor: name.to_string(),
            field: "shape",
            value: format!("{shape:?}"),
            supported: "two dimensions (rows, cols) for int8 and fp8",
        }),
    }
}
