//! The tanh GELU's derivative, which the backwards of `FusedLinear`,
//! `FusedMlp` and the cuBLASLt GEMMs share.
use candle_core::{DType, Result, Tensor};

/// `d gelu(z) / dz` for the tanh form, in f32.
pub(crate) fn gelu_grad(z: &Tensor) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    const A: f64 = 0.044_715;
    let z = z.to_dtype(DType::F32)?;
    let z2 = z.sqr()?;
    let u = ((&z * (z2.affine(A, 1.0)?))? * C)?;
    let t = u.tanh()?;
    let du = (z2.affine(3.0 * A, 1.0)? * C)?;
    let left = (t.affine(0.5, 0.5))?;
    let right = ((&z * 0.5)? * ((t.sqr()?.affine(-1.0, 1.0))? * du)?)?;
    left + right
}
