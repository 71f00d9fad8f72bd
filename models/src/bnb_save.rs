//! Saving quantized weights in bitsandbytes' layout: a folder of
//! `config.json` (with the `quantization_config` transformers'
//! `BitsAndBytesConfig` writes) and `model.safetensors` holding every tensor
//! under the names and dtypes bitsandbytes' `Linear4bit` / `Linear8bitLt`
//! state dicts use (held in one module for the reader and this writer), so that transformers with
//! bitsandbytes loads it back, and [`read_quantized`] does.
//!
//! [`read_quantized`]: crate::read_quantized
use crate::bnb_layout::{int8_names, FourBitNames, QuantStateJson};
use crate::config::LlamaConfig;
use crate::quantization_config::{torch_dtype_name, QuantMethod, QuantizationConfig};
use crate::quantized_checkpoint::QuantizedCheckpoint;
use candle_core::{DType, Result, Tensor};
use safetensors::tensor::View;
use safetensors::Dtype;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use streamer_quant::{Absmax, FourBit, HostTensor, Int8Rows};

/// One tensor of the file: bytes made here, or a dense Candle tensor.
enum Entry<'a> {
    Raw {
        dtype: Dtype,
        shape: Vec<usize>,
        data: Vec<u8>,
    },
    Dense(&'a Tensor),
}

impl View for &Entry<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            Entry::Raw { dtype, .. } => *dtype,
            Entry::Dense(t) => View::dtype(t),
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Entry::Raw { shape, .. } => shape,
            Entry::Dense(t) => t.dims(),
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            Entry::Raw { data, .. } => Cow::Borrowed(data),
            Entry::Dense(t) => View::data(t),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            Entry::Raw { data, .. } => data.len(),
            Entry::Dense(t) => View::data_len(t),
        }
    }
}

fn raw(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Entry<'static> {
    Entry::Raw { dtype, shape, data }
}

fn f32_entry(values: &[f32]) -> Entry<'static> {
    let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    raw(Dtype::F32, vec![values.len()], data)
}

/// Writes `weights` into `dir` (created if needed) as a transformers +
/// bitsandbytes checkpoint of `cfg` quantized as `qc` says: `config.json`
/// and `model.safetensors`, each replaced atomically. The quantized weights
/// must be of `qc`'s method (and, for 4-bit, its quant type and double
/// quantization), named `<module>.weight`, outside `qc`'s skipped modules;
/// anything else is an error naming the tensor, before any file is written.
/// The 4-bit quant states name `weights.weight_dtype` as the dtype
/// bitsandbytes dequantizes to, and `config.json` names it as the model's
/// dtype; when it is `None`, the dense tensors' dtype (float32 if they
/// differ).
pub fn save_bnb(
    dir: impl AsRef<Path>,
    cfg: &LlamaConfig,
    qc: &QuantizationConfig,
    weights: &QuantizedCheckpoint,
) -> Result<()> {
    let dir = dir.as_ref();
    let dtype = weights
        .weight_dtype
        .unwrap_or_else(|| dense_dtype(&weights.dense));
    let mut entries: Vec<(String, Entry)> = Vec::new();
    let mut names: Vec<&String> = weights.quantized.keys().collect();
    names.sort();
    for name in names {
        check_weight(name, &weights.quantized[name], qc, &weights.dense)?;
        match &weights.quantized[name] {
            HostTensor::FourBit(q) => entries.extend(four_bit_entries(name, q, dtype)?),
            HostTensor::Int8(q) => entries.extend(int8_entries(name, q)),
            HostTensor::Fp8(_) => fp8_is_not_bnb(name)?,
        }
    }
    entries.extend(
        weights
            .dense
            .iter()
            .map(|(n, t)| (n.clone(), Entry::Dense(t))),
    );
    std::fs::create_dir_all(dir).map_err(|e| bad(dir, format!("cannot create: {e}")))?;
    write_config(dir, cfg, qc, dtype)?;
    let info = HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = dir.join("model.safetensors");
    streamer_device::replace_atomic(&file, |tmp| {
        let refs = entries.iter().map(|(n, e)| (n.as_str(), e));
        safetensors::serialize_to_file(refs, Some(info), tmp).map_err(candle_core::Error::wrap)
    })
}

/// The dtype every tensor of `dense` has, else f32.
fn dense_dtype(dense: &HashMap<String, Tensor>) -> DType {
    let mut dtypes = dense.values().map(Tensor::dtype);
    match dtypes.next() {
        Some(first) if dtypes.all(|d| d == first) => first,
        _ => DType::F32,
    }
}

fn bad(path: &Path, reason: String) -> candle_core::Error {
    streamer_device::Error::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
    .into()
}

fn unsupported(name: &str, reason: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "cannot save {name} in bitsandbytes' layout: {reason}"
    ))
}

fn fp8_is_not_bnb(name: &str) -> Result<()> {
    Err(unsupported(name, "fp8 is not a bitsandbytes format"))
}

/// A quantized weight agrees with the config and collides with nothing.
fn check_weight(
    name: &str,
    q: &HostTensor,
    qc: &QuantizationConfig,
    dense: &HashMap<String, Tensor>,
) -> Result<()> {
    if !name.ends_with(".weight") || qc.skips(name) || dense.contains_key(name) {
        return Err(unsupported(
            name,
            "a quantized weight is a module's `.weight`, outside the skipped modules \
             (llm_int8_skip_modules, lm_head by default) and not also dense",
        ));
    }
    let fits = match (&qc.method, q) {
        (
            QuantMethod::FourBit {
                quant_type,
                double_quant,
                ..
            },
            HostTensor::FourBit(q),
        ) => {
            q.quant_type() == *quant_type
                && matches!(q.absmax(), Absmax::Nested(_)) == *double_quant
        }
        (QuantMethod::Int8, HostTensor::Int8(_)) => true,
        _ => false,
    };
    match fits {
        true => Ok(()),
        false => Err(unsupported(name, format!("it is not of {:?}", qc.method))),
    }
}

/// A 4-bit weight's tensors, as `Linear4bit._save_to_state_dict` writes them.
fn four_bit_entries(
    name: &str,
    q: &FourBit,
    dtype: DType,
) -> Result<Vec<(String, Entry<'static>)>> {
    let qt = q.quant_type().name();
    let names = FourBitNames::new(name, qt);
    let mut state = QuantStateJson {
        quant_type: qt.to_string(),
        blocksize: q.blocksize(),
        dtype: torch_dtype_name(dtype).to_string(),
        shape: q.shape().to_vec(),
        nested_blocksize: None,
        nested_dtype: None,
        nested_offset: None,
    };
    let packed = raw(Dtype::U8, vec![q.packed().len(), 1], q.packed().to_vec());
    let mut out = vec![(name.to_string(), packed)];
    match q.absmax() {
        Absmax::Plain(a) => out.push((names.absmax.clone(), f32_entry(a))),
        Absmax::Nested(n) => {
            let codes = raw(Dtype::U8, vec![n.codes.len()], n.codes.clone());
            out.push((names.absmax.clone(), codes));
            out.push((names.nested_absmax.clone(), f32_entry(&n.absmax)));
            out.push((names.nested_quant_map.clone(), f32_entry(&n.map)));
            state.nested_blocksize = Some(n.blocksize);
            state.nested_dtype = Some("float32".into());
            state.nested_offset = Some(n.offset as f64);
        }
    }
    out.push((names.quant_map.clone(), f32_entry(q.quant_type().code())));
    let bytes = state.to_bytes()?;
    out.push((names.quant_state, raw(Dtype::U8, vec![bytes.len()], bytes)));
    Ok(out)
}

/// An 8-bit weight's tensors, as `Linear8bitLt._save_to_state_dict` writes
/// them.
fn int8_entries(name: &str, q: &Int8Rows) -> Vec<(String, Entry<'static>)> {
    let (rows, cols) = q.dims();
    let (scb, format) = int8_names(name);
    let data = q.data().iter().map(|&b| b as u8).collect();
    vec![
        (name.to_string(), raw(Dtype::I8, vec![rows, cols], data)),
        (scb, f32_entry(q.scb())),
        (format, raw(Dtype::U8, vec![], vec![0])),
    ]
}

/// `config.json`: `cfg` with the `quantization_config` and the dtype the
/// model was quantized from (transformers 4.x's `torch_dtype`, 5.x's
/// `dtype`).
fn write_config(
    dir: &Path,
    cfg: &LlamaConfig,
    qc: &QuantizationConfig,
    dtype: DType,
) -> Result<()> {
    let mut v: serde_json::Value =
        serde_json::from_str(&cfg.to_json()?).map_err(candle_core::Error::wrap)?;
    if let Some(o) = v.as_object_mut() {
        o.insert("quantization_config".into(), qc.to_bnb_json()?);
        for key in ["torch_dtype", "dtype"] {
            o.insert(key.into(), torch_dtype_name(dtype).into());
        }
    }
    let text = serde_json::to_string_pretty(&v).map_err(candle_core::Error::wrap)?;
    streamer_device::write_atomic(&dir.join("config.json"), &text)
}
