//! float8 e4m3 ("fn": no infinities, 0x7f and 0xff are NaN; exponent bias 7,
//! 3 mantissa bits, largest finite 448) with one f32 scale per tensor or per
//! output row, as transformers' fp8 checkpoints store weights
//! (`weight` in e4m3, `weight_scale` of shape `[]`, `[1]` or `[rows, 1]`):
//! an element is `e4m3 * scale` in f32.
use crate::DequantizeHost;
use crate::{QuantError, Result};
use rayon::prelude::*;

/// The largest finite e4m3 value.
const E4M3_MAX: f32 = 448.0;

/// An e4m3 byte's value (exact in f32).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xf) as i32;
    let man = (b & 7) as f32;
    if exp == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    sign * match exp {
        0 => man / 8.0 * 2f32.powi(-6),
        _ => (1.0 + man / 8.0) * 2f32.powi(exp - 7),
    }
}

/// `x` rounded to the nearest e4m3 value (ties to even), saturating at
/// ±448 as transformers' quantizers clamp before the cast.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // The 127 non-negative finite codes are ascending in value: the nearest
    // is found by bisection on the codes, ties to the even code.
    let (mut lo, mut hi) = (0u8, 0x7e);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let below = lo;
    let code = if below == 0x7e {
        below
    } else {
        let (d0, d1) = (a - e4m3_to_f32(below), e4m3_to_f32(below + 1) - a);
        if d1 < d0 || (d1 == d0 && below % 2 == 1) {
            below + 1
        } else {
            below
        }
    };
    sign | code
}

/// Scales of an fp8 tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Fp8Scale {
    /// One for the whole tensor.
    Tensor(f32),
    /// One per output row.
    Rows(Vec<f32>),
}

/// An fp8 e4m3 tensor of `rows x cols`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8 {
    name: String,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scale: Fp8Scale,
}

impl Fp8 {
    /// A tensor named `name` from its e4m3 bytes (row-major) and scales,
    /// checked.
    pub fn new(
        name: &str,
        (rows, cols): (usize, usize),
        data: Vec<u8>,
        scale: Fp8Scale,
    ) -> Result<Self> {
        let shape = [rows, cols];
        QuantError::check_len(name, "fp8 data", (data.len(), rows * cols), &shape)?;
        match &scale {
            Fp8Scale::Tensor(s) => QuantError::check_finite(name, "weight_scale", &[*s])?,
            Fp8Scale::Rows(s) => {
                QuantError::check_len(name, "weight_scale", (s.len(), rows), &shape)?;
                QuantError::check_finite(name, "weight_scale", s)?;
            }
        }
        Ok(Self {
            name: name.to_string(),
            rows,
            cols,
            data,
            scale,
        })
    }

    /// `values` quantized with one scale per row (`per_row`) or per tensor:
    /// the scale maps the absmax to 448, each element is the nearest e4m3
    /// of `v / scale`.
    pub fn quantize(values: &[f32], (rows, cols): (usize, usize), per_row: bool) -> Result<Self> {
        let what = "fp8 quantization";
        QuantError::check_len(what, "values", (values.len(), rows * cols), &[rows, cols])?;
        QuantError::check_finite(what, "values", values)?;
        let absmax = |r: &[f32]| r.iter().fold(0f32, |m, v| m.max(v.abs()));
        let to_scale = |top: f32| if top > 0.0 { top / E4M3_MAX } else { 1.0 };
        let scales: Vec<f32> = match per_row {
            true => values
                .par_chunks(cols.max(1))
                .map(|r| to_scale(absmax(r)))
                .collect(),
            false => vec![to_scale(absmax(values)); rows],
        };
        let data = values
            .par_chunks(cols.max(1))
            .zip(scales.par_iter())
            .flat_map_iter(|(row, &s)| row.iter().map(move |&v| f32_to_e4m3(v / s)))
            .collect();
        let scale = match per_row {
            true => Fp8Scale::Rows(scales),
            false => Fp8Scale::Tensor(scales.first().copied().unwrap_or(1.0)),
        };
        Self::new(what, (rows, cols), data, scale)
    }

    /// Row `r`'s scale.
    pub fn row_scale(&self, r: usize) -> f32 {
        match &self.scale {
            Fp8Scale::Tensor(s) => *s,
            Fp8Scale::Rows(s) => s[r],
        }
    }

    /// The e4m3 bytes, row-major.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The scales.
    pub fn scale(&self) -> &Fp8Scale {
        &self.scale
    }

    /// Bytes a copy moves.
    pub fn stored_bytes(&self) -> usize {
        self.data.len()
            + 4 * match &self.scale {
                Fp8Scale::Tensor(_) => 1,
                Fp8Scale::Rows(s) => s.len(),
            }
    }
}

matrix_accessors!(Fp8);

impl DequantizeHost for Fp8 {
    fn dequantize_with<T: Send>(&self, round: impl Fn(f32) -> T + Send + Sync) -> Vec<T> {
        self.data
            .par_chunks(self.cols.max(1))
            .enumerate()
            .flat_map_iter(|(r, row)| {
                let s = self.row_scale(r);
                row.iter().map(move |&b| e4m3_to_f32(b) * s)
            })
            .map(round)
            .collect()
    }
}
