//! Quantizing a dense checkpoint as it is loaded: the decoder layers'
//! `Linear` weights become [`HostTensor`]s in the format a
//! [`QuantizationConfig`] names, the rest stays dense; the result saves in
//! bitsandbytes' layout with [`crate::save_bnb`].
use crate::quantization_config::{QuantMethod, QuantizationConfig};
use crate::quantized_checkpoint::QuantizedCheckpoint;
use candle_core::{DType, Result, Tensor};
use std::collections::HashMap;
use streamer_quant::{FourBit, Fp8, HostTensor, Int8Rows, QuantError};

/// bitsandbytes' default 4-bit block size (transformers passes no other).
const BLOCK: usize = 64;

/// `q` under the name `name` (quantization names it after the format).
fn named(name: &str, q: HostTensor) -> std::result::Result<HostTensor, QuantError> {
    Ok(match q {
        HostTensor::FourBit(q) => HostTensor::FourBit(FourBit::new(
            name,
            q.shape(),
            (q.quant_type(), q.blocksize()),
            q.packed().to_vec(),
            q.absmax().clone(),
        )?),
        HostTensor::Int8(q) => HostTensor::Int8(Int8Rows::new(
            name,
            q.dims(),
            q.data().to_vec(),
            q.scb().to_vec(),
        )?),
        HostTensor::Fp8(q) => HostTensor::Fp8(Fp8::new(
            name,
            q.dims(),
            q.data().to_vec(),
            q.scale().clone(),
        )?),
    })
}

/// `t` (2-D) quantized as `method` says.
fn quantize_one(name: &str, t: &Tensor, method: &QuantMethod) -> Result<HostTensor> {
    let (rows, cols) = t.dims2()?;
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let q = match method {
        QuantMethod::FourBit {
            quant_type,
            double_quant,
            ..
        } => FourBit::quantize(&v, &[rows, cols], *quant_type, BLOCK, *double_quant)
            .map(HostTensor::FourBit),
        QuantMethod::Int8 => Int8Rows::quantize(&v, (rows, cols)).map(HostTensor::Int8),
        QuantMethod::Fp8(_) => Fp8::quantize(&v, (rows, cols), true).map(HostTensor::Fp8),
    };
    q.and_then(|q| named(name, q))
        .map_err(|e| candle_core::Error::Msg(format!("quantizing {name}: {e}")))
}

/// Whether `name` is the weight of a decoder layer's `Linear` (the layers
/// transformers' bitsandbytes and fp8 quantizers convert).
fn is_layer_linear(name: &str, t: &Tensor) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".weight") && t.rank() == 2
}

impl QuantizedCheckpoint {
    /// `tensors` (Hugging Face names) quantized as `qc` says: every 2-D
    /// weight of a decoder layer outside `qc`'s skipped modules, NF4/FP4 in
    /// blocks of 64 (bitsandbytes' default), int8 by rows, fp8 with a scale
    /// per row; everything else stays dense. The 4-bit quant states name the
    /// quantized tensors' dtype (bf16 for a bf16 checkpoint).
    pub fn quantize(tensors: HashMap<String, Tensor>, qc: &QuantizationConfig) -> Result<Self> {
        let mut quantized = HashMap::new();
        let mut dense = HashMap::new();
        let mut dtypes = Vec::new();
        for (name, t) in tensors {
            if is_layer_linear(&name, &t) && !qc.skips(&name) {
                dtypes.push(t.dtype());
                quantized.insert(name.clone(), quantize_one(&name, &t, &qc.method)?);
            } else {
                dense.insert(name, t);
            }
        }
        let weight_dtype = match qc.method {
            QuantMethod::FourBit { .. } => Some(match dtypes.first() {
                Some(&d) if dtypes.iter().all(|&x| x == d) => d,
                _ => DType::F32,
            }),
            _ => None,
        };
        Ok(Self {
            quantized,
            dense,
            weight_dtype,
        })
    }
}
