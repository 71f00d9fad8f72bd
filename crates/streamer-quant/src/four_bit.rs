//! bitsandbytes' 4-bit blockwise formats, NF4 and FP4: the flattened tensor
//! is cut into blocks of `blocksize` elements, each block scaled by its
//! largest magnitude (absmax, f32) into [-1, 1] and each element stored as
//! the 4-bit index of the nearest of 16 code values, two to a byte (the
//! first element in the high nibble). With double quantization the absmax
//! values themselves are stored in 8 bits: their mean is subtracted and the
//! rest quantized blockwise (256 a block) against bitsandbytes' signed
//! dynamic map.
use crate::DequantizeHost;
use crate::{elements, QuantError, Result};
use rayon::prelude::*;
use std::borrow::Cow;

/// NF4's code values (QLoRA's normal-float quantiles), as bitsandbytes' CUDA
/// kernels hold them.
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// FP4's code values (bitsandbytes' sign, two exponent and one mantissa bit
/// layout, scaled so that the largest is 1): index bit 3 is the sign.
pub const FP4_CODE: [f32; 16] = [
    0.0,
    0.0625 / 12.0,
    8.0 / 12.0,
    1.0,
    4.0 / 12.0,
    6.0 / 12.0,
    2.0 / 12.0,
    3.0 / 12.0,
    -0.0,
    -0.0625 / 12.0,
    -8.0 / 12.0,
    -1.0,
    -4.0 / 12.0,
    -6.0 / 12.0,
    -2.0 / 12.0,
    -3.0 / 12.0,
];

/// Block sizes bitsandbytes' 4-bit kernels take.
pub const BLOCK_SIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// Elements a double-quantized absmax block holds (bitsandbytes' fixed 256).
const NESTED_BLOCK: usize = 256;

/// Which 4-bit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FourBitType {
    /// Normal float: quantiles of a normal distribution (QLoRA's default).
    Nf4,
    /// A 4-bit float.
    Fp4,
}

impl FourBitType {
    /// The 16 code values, by index.
    pub fn code(self) -> &'static [f32; 16] {
        match self {
            Self::Nf4 => &NF4_CODE,
            Self::Fp4 => &FP4_CODE,
        }
    }

    /// The name bitsandbytes and transformers use (`nf4`, `fp4`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Nf4 => "nf4",
            Self::Fp4 => "fp4",
        }
    }

    /// `nf4` or `fp4`; anything else is an error naming `tensor`.
    pub fn parse(tensor: &str, s: &str) -> Result<Self> {
        match s {
            "nf4" => Ok(Self::Nf4),
            "fp4" => Ok(Self::Fp4),
            other => Err(QuantError::Unsupported {
                tensor: tensor.to_string(),
                field: "quant_type",
                value: other.to_string(),
                supported: "nf4 or fp4",
            }),
        }
    }

    /// The index of the code value nearest `x` (in [-1, 1]); a tie goes to
    /// the value nearer zero for FP4 (sign, then magnitude, as bitsandbytes'
    /// decision tree) and to the lower value for NF4.
    fn nearest(self, x: f32) -> u8 {
        match self {
            Self::Nf4 => nearest_sorted(&NF4_CODE, x) as u8,
            Self::Fp4 => {
                // Magnitudes in increasing order and their indices.
                const MAG: [(f32, u8); 8] = [
                    (FP4_CODE[0], 0),
                    (FP4_CODE[1], 1),
                    (FP4_CODE[6], 6),
                    (FP4_CODE[7], 7),
                    (FP4_CODE[4], 4),
                    (FP4_CODE[5], 5),
                    (FP4_CODE[2], 2),
                    (FP4_CODE[3], 3),
                ];
                let sign = if x < 0.0 { 8 } else { 0 };
                let values = MAG.map(|(v, _)| v);
                MAG[nearest_sorted(&values, x.abs())].1 | sign
            }
        }
    }
}

/// The position in ascending `sorted` of the value nearest `x`, ties to the
/// lower one (midpoints compared with `>`).
fn nearest_sorted(sorted: &[f32], x: f32) -> usize {
    sorted
        .windows(2)
        .take_while(|w| x > (w[0] + w[1]) / 2.0)
        .count()
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`):
/// for exponents 10^-6 .. 10^0 the midpoints of an even split of [0.1, 1]
/// into 2^i parts, both signs, and 0 and 1; ascending.
pub fn dynamic_map() -> [f32; 256] {
    let mut data = Vec::with_capacity(256);
    for i in 0..7i32 {
        let items = (1usize << i) + 1;
        let step = (1.0f32 - 0.1) / (items - 1) as f32;
        let bounds: Vec<f32> = (0..items).map(|k| 0.1 + step * k as f32).collect();
        let scale = 10f32.powi(i - 6);
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            data.push(-scale * mean);
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.sort_by(f32::total_cmp);
    data.try_into().expect("254 values and 0 and 1")
}

/// Absmax values stored in 8 bits (double quantization).
#[derive(Clone, Debug, PartialEq)]
pub struct NestedAbsmax {
    /// One 8-bit index into `map` per 4-bit block.
    pub codes: Vec<u8>,
    /// The 256 values the indices stand for.
    pub map: Vec<f32>,
    /// One f32 scale per `blocksize` indices.
    pub absmax: Vec<f32>,
    /// Indices a scale covers (256 in bitsandbytes).
    pub blocksize: usize,
    /// Added back after scaling (the mean of the original absmax values).
    pub offset: f32,
}

impl NestedAbsmax {
    /// `absmax` less its mean, quantized blockwise against [`dynamic_map`].
    pub fn quantize(absmax: &[f32]) -> Self {
        let offset =
            (absmax.iter().map(|&a| a as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
        let map = dynamic_map();
        let mut codes = Vec::with_capacity(absmax.len());
        let mut scales = Vec::with_capacity(absmax.len().div_ceil(NESTED_BLOCK));
        for block in absmax.chunks(NESTED_BLOCK) {
            let top = block.iter().fold(0f32, |m, &a| m.max((a - offset).abs()));
            let inv = if top > 0.0 { 1.0 / top } else { 0.0 };
            codes.extend(
                block
                    .iter()
                    .map(|&a| nearest_sorted(&map, (a - offset) * inv) as u8),
            );
            scales.push(top);
        }
        Self {
            codes,
            map: map.to_vec(),
            absmax: scales,
            blocksize: NESTED_BLOCK,
            offset,
        }
    }

    /// The absmax values: `map[code] * absmax[block]` in f32, plus the
    /// offset (bitsandbytes' order).
    pub fn dequantize(&self) -> Vec<f32> {
        self.codes
            .iter()
            .enumerate()
            .map(|(i, &q)| self.map[q as usize] * self.absmax[i / self.blocksize] + self.offset)
            .collect()
    }

    fn check(&self, tensor: &str, blocks: usize, shape: &[usize]) -> Result<()> {
        QuantError::check_len(
            tensor,
            "nested absmax codes",
            (self.codes.len(), blocks),
            shape,
        )?;
        QuantError::check_len(tensor, "nested quant map", (self.map.len(), 256), shape)?;
        if self.blocksize == 0 {
            return Err(QuantError::Unsupported {
                tensor: tensor.to_string(),
                field: "nested_blocksize",
                value: "0".into(),
                supported: "a positive block size (bitsandbytes writes 256)",
            });
        }
        let scales = blocks.div_ceil(self.blocksize);
        QuantError::check_len(tensor, "nested absmax", (self.absmax.len(), scales), shape)?;
        QuantError::check_finite(tensor, "nested absmax", &self.absmax)?;
        QuantError::check_finite(tensor, "nested quant map", &self.map)?;
        QuantError::check_finite(tensor, "nested offset", &[self.offset])
    }
}

/// A block's scale: plain f32 or double-quantized.
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    /// One f32 per block.
    Plain(Vec<f32>),
    /// 8 bits per block ([`NestedAbsmax`]).
    Nested(NestedAbsmax),
}

/// A tensor in a 4-bit blockwise format.
#[derive(Clone, Debug, PartialEq)]
pub struct FourBit {
    name: String,
    shape: Vec<usize>,
    quant_type: FourBitType,
    blocksize: usize,
    packed: Vec<u8>,
    absmax: Absmax,
}

impl FourBit {
    /// A tensor named `name` from its parts, checked: the block size is one
    /// bitsandbytes takes, the packed bytes hold every element, there is one
    /// absmax per block, and every scale is finite.
    pub fn new(
        name: &str,
        shape: &[usize],
        (quant_type, blocksize): (FourBitType, usize),
        packed: Vec<u8>,
        absmax: Absmax,
    ) -> Result<Self> {
        if !BLOCK_SIZES.contains(&blocksize) {
            return Err(QuantError::Unsupported {
                tensor: name.to_string(),
                field: "blocksize",
                value: blocksize.to_string(),
                supported: "32, 64, 128, 256, 512, 1024, 2048 or 4096",
            });
        }
        let n = elements(shape);
        QuantError::check_len(name, "packed data", (packed.len(), n.div_ceil(2)), shape)?;
        let blocks = n.div_ceil(blocksize);
        match &absmax {
            Absmax::Plain(a) => {
                QuantError::check_len(name, "absmax", (a.len(), blocks), shape)?;
                QuantError::check_finite(name, "absmax", a)?;
            }
            Absmax::Nested(nested) => nested.check(name, blocks, shape)?,
        }
        Ok(Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            quant_type,
            blocksize,
            packed,
            absmax,
        })
    }

    /// `values` (row-major, `shape`) quantized: each block's absmax, each
    /// element the nearest code value of its scaled value; with `double`,
    /// the absmax values double-quantized.
    pub fn quantize(
        values: &[f32],
        shape: &[usize],
        quant_type: FourBitType,
        blocksize: usize,
        double: bool,
    ) -> Result<Self> {
        let what = format!("{} quantization", quant_type.name());
        QuantError::check_len(&what, "values", (values.len(), elements(shape)), shape)?;
        QuantError::check_finite(&what, "values", values)?;
        if !BLOCK_SIZES.contains(&blocksize) {
            // Reported by `new` with the same words.
            return Self::new(
                &what,
                shape,
                (quant_type, blocksize),
                vec![],
                Absmax::Plain(vec![]),
            );
        }
        let absmax: Vec<f32> = values
            .par_chunks(blocksize)
            .map(|b| b.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        let codes: Vec<u8> = values
            .par_chunks(blocksize)
            .zip(absmax.par_iter())
            .flat_map_iter(|(block, &top)| {
                let inv = if top > 0.0 { 1.0 / top } else { 0.0 };
                block.iter().map(move |&v| quant_type.nearest(v * inv))
            })
            .collect();
        let packed = codes
            .chunks(2)
            .map(|p| p[0] << 4 | p.get(1).copied().unwrap_or(0))
            .collect();
        let absmax = match double {
            true => Absmax::Nested(NestedAbsmax::quantize(&absmax)),
            false => Absmax::Plain(absmax),
        };
        Self::new(&what, shape, (quant_type, blocksize), packed, absmax)
    }

    /// The blocks' absmax in f32 (dequantized when nested).
    pub fn absmax_f32(&self) -> Cow<'_, [f32]> {
        match &self.absmax {
            Absmax::Plain(a) => Cow::Borrowed(a),
            Absmax::Nested(n) => Cow::Owned(n.dequantize()),
        }
    }

    /// Renames the tensor.
    pub(crate) fn set_name(&mut self, name: &str) {
        self.name = name.to_string();
    }

    /// The tensor's name (or what made it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements.
    pub fn elements(&self) -> usize {
        elements(&self.shape)
    }

    /// NF4 or FP4.
    pub fn quant_type(&self) -> FourBitType {
        self.quant_type
    }

    /// Elements an absmax covers.
    pub fn blocksize(&self) -> usize {
        self.blocksize
    }

    /// Two 4-bit indices a byte, the first in the high nibble.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// The blocks' scales as stored.
    pub fn absmax(&self) -> &Absmax {
        &self.absmax
    }

    /// Bytes a copy of the tensor moves: the packed data and the scales as
    /// stored.
    pub fn stored_bytes(&self) -> usize {
        self.packed.len()
            + match &self.absmax {
                Absmax::Plain(a) => 4 * a.len(),
                Absmax::Nested(n) => n.codes.len() + 4 * (n.absmax.len() + n.map.len() + 1),
            }
    }
}

impl DequantizeHost for FourBit {
    fn dequantize_with<T: Send>(&self, round: impl Fn(f32) -> T + Send + Sync) -> Vec<T> {
        let code = self.quant_type.code();
        let absmax = self.absmax_f32();
        let n = self.elements();
        let half = self.blocksize / 2;
        let mut out: Vec<T> = self
            .packed
            .par_chunks(half)
            .zip(absmax.par_iter())
            .flat_map_iter(|(bytes, &scale)| {
                bytes
                    .iter()
                    .flat_map(move |&b| [b >> 4, b & 15].map(|q| code[q as usize] * scale))
            })
            .map(&round)
            .collect();
        out.truncate(n);
        out
    }
}
