//! bitsandbytes' int8 weight format (`Linear8bitLt`): a 2-D weight of
//! `rows x cols` stored as int8 with one f32 absmax per row (`SCB`);
//! an element is `q * SCB[row] / 127`, computed as bitsandbytes does:
//! `(q * SCB[row]) * 7.874015718698502e-3` in f32.
use crate::DequantizeHost;
use crate::{QuantError, Result};
use rayon::prelude::*;

/// 1/127 as bitsandbytes multiplies by it.
const INV_127: f32 = 0.007_874_016;

/// A row-wise int8 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Int8Rows {
    name: String,
    rows: usize,
    cols: usize,
    data: Vec<i8>,
    scb: Vec<f32>,
}

impl Int8Rows {
    /// A tensor named `name` of `rows x cols` from its int8 data (row-major)
    /// and its rows' absmax, checked.
    pub fn new(
        name: &str,
        (rows, cols): (usize, usize),
        data: Vec<i8>,
        scb: Vec<f32>,
    ) -> Result<Self> {
        let shape = [rows, cols];
        QuantError::check_len(name, "int8 data", (data.len(), rows * cols), &shape)?;
        QuantError::check_len(name, "SCB (row absmax)", (scb.len(), rows), &shape)?;
        QuantError::check_finite(name, "SCB (row absmax)", &scb)?;
        Ok(Self {
            name: name.to_string(),
            rows,
            cols,
            data,
            scb,
        })
    }

    /// `values` (`rows x cols`) quantized as bitsandbytes does: each row's
    /// absmax, each element `round(v * 127 / absmax)` (ties away from zero).
    pub fn quantize(values: &[f32], (rows, cols): (usize, usize)) -> Result<Self> {
        let what = "int8 quantization";
        QuantError::check_len(what, "values", (values.len(), rows * cols), &[rows, cols])?;
        QuantError::check_finite(what, "values", values)?;
        let scb: Vec<f32> = values
            .par_chunks(cols.max(1))
            .map(|r| r.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        let data = values
            .par_chunks(cols.max(1))
            .zip(scb.par_iter())
            .flat_map_iter(|(row, &top)| {
                let k = if top > 0.0 { 127.0 / top } else { 0.0 };
                row.iter()
                    .map(move |&v| (v * k).round().clamp(-127.0, 127.0) as i8)
            })
            .collect();
        Self::new(what, (rows, cols), data, scb)
    }

    /// The int8 data, row-major.
    pub fn data(&self) -> &[i8] {
        &self.data
    }

    /// The rows' absmax.
    pub fn scb(&self) -> &[f32] {
        &self.scb
    }

    /// Bytes a copy moves.
    pub fn stored_bytes(&self) -> usize {
        self.data.len() + 4 * self.scb.len()
    }
}

matrix_accessors!(Int8Rows);

impl DequantizeHost for Int8Rows {
    fn dequantize_with<T: Send>(&self, round: impl Fn(f32) -> T + Send + Sync) -> Vec<T> {
        self.data
            .par_chunks(self.cols.max(1))
            .zip(self.scb.par_iter())
            .flat_map_iter(|(row, &s)| row.iter().map(move |&q| (q as f32 * s) * INV_127))
            .map(round)
            .collect()
    }
}
