//! Quantizing a dense checkpoint for saving in a peer's layout: the decoder
//! layers' `Linear` weights become [`HostTensor`]s in the format a
//! [`QuantizationConfig`] names, the rest stays dense; the result saves in
//! bitsandbytes' layout with [`crate::save_bnb`].
use crate::quantization_config::{QuantMethod, QuantizationConfig};
use crate::quantized_checkpoint::QuantizedCheckpoint;
use candle_core::{DType, Result, Tensor};
use std::collections::HashMap;
use streamer_quant::HostTensor;

/// `t` (2-D) quantized as `method` says.
fn quantize_one(name: &str, t: &Tensor, method: &QuantMethod) -> Result<HostTensor> {
    let (rows, cols) = t.dims2()?;
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    method
        .scheme()
        .quantize(name, &v, &[rows, cols])
        .map_err(candle_core::Error::wrap)
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
