//! Reading a transformers checkpoint whose `config.json` has a
//! `quantization_config` ([`QuantizationConfig`]): every quantized `Linear`
//! weight becomes a [`HostTensor`] under its Hugging Face name
//! (`model.layers.0.self_attn.q_proj.weight`), every other tensor stays a
//! dense Candle tensor.
//!
//! Everything is checked on the files' headers first (which tensors belong
//! to which weight, dtypes, shapes, lengths, the 4-bit quant states); a
//! malformed weight is an error naming its tensor before any weight data is
//! copied.
//!
//! ```
//! use candle_core::DType;
//! use streamer_models::{init_weights, read_quantized, save_bnb, LlamaConfig};
//! use streamer_models::{QuantMethod, QuantizationConfig, QuantizedCheckpoint};
//! use streamer_quant::{FourBitType, HostTensor};
//!
//! let cfg = LlamaConfig { max_position_embeddings: 16, ..LlamaConfig::bytes(64, 1, 4, 2) };
//! let method = QuantMethod::FourBit {
//!     quant_type: FourBitType::Nf4,
//!     double_quant: true,
//!     compute_dtype: DType::BF16,
//! };
//! let qc = QuantizationConfig { method, skip_modules: None };
//! // A bf16 -> NF4 folder in bitsandbytes' layout, and back.
//! let weights = QuantizedCheckpoint::quantize(init_weights(&cfg, 0)?, &qc)?;
//! let dir = std::env::temp_dir().join(format!("streamer-doc-nf4-{}", std::process::id()));
//! save_bnb(&dir, &cfg, &qc, &weights)?;
//! let text = std::fs::read_to_string(dir.join("config.json")).map_err(candle_core::Error::wrap)?;
//! let qc = QuantizationConfig::from_config_json(&text)?.expect("a quantization_config");
//! let back = read_quantized(&[dir.join("model.safetensors")], &qc)?;
//! back.check(&cfg)?;
//! let q = &back.quantized["model.layers.0.self_attn.q_proj.weight"];
//! assert!(matches!(q, HostTensor::FourBit(f) if f.shape() == [64, 64]));
//! assert!(back.dense.contains_key("model.embed_tokens.weight"));
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), candle_core::Error>(())
//! ```
use crate::bnb_layout::{int8_names, FourBitNames, QuantStateJson, QUANT_STATE};
use crate::config::LlamaConfig;
use crate::fp8_config::Fp8Layout;
use crate::quantization_config::{torch_dtype, QuantMethod, QuantizationConfig};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{bail, DType, Device, Result, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use streamer_quant::{
    Absmax, FourBit, FourBitType, Fp8, Fp8Scale, HostTensor, Int8Rows, NestedAbsmax, QuantError,
    BLOCK_SIZES,
};

/// A quantized checkpoint read into host memory.
#[derive(Debug)]
pub struct QuantizedCheckpoint {
    /// The quantized weights, by Hugging Face weight name.
    pub quantized: HashMap<String, HostTensor>,
    /// Every other tensor (embeddings, norms, a dense head, skipped
    /// modules) on the CPU, in its stored dtype.
    pub dense: HashMap<String, Tensor>,
    /// The dtype bitsandbytes' 4-bit quant states dequantize to (the
    /// model's dtype when it was quantized); `None` for other formats.
    pub weight_dtype: Option<DType>,
}

/// The shape of a quantized tensor.
fn host_shape(q: &HostTensor) -> Vec<usize> {
    match q {
        HostTensor::FourBit(q) => q.shape().to_vec(),
        HostTensor::Int8(q) => vec![q.dims().0, q.dims().1],
        HostTensor::Fp8(q) => vec![q.dims().0, q.dims().1],
    }
}

impl QuantizedCheckpoint {
    /// Checks the weights against `cfg` as [`crate::check_weights`] checks a
    /// dense checkpoint: every tensor the config implies is here, dense or
    /// quantized (not both), with its shape, and there is no other (a tied
    /// model's `lm_head.weight` aside). Errors name the tensor and the
    /// config fields its shape comes from.
    pub fn check(&self, cfg: &LlamaConfig) -> Result<()> {
        let expected = cfg.weight_shapes();
        for (name, shape, fields) in &expected {
            let got = match (self.dense.get(name), self.quantized.get(name)) {
                (Some(t), None) => t.dims().to_vec(),
                (None, Some(q)) => host_shape(q),
                (None, None) => {
                    bail!("the weights lack {name} {shape:?} (from the config's {fields})")
                }
                (Some(_), Some(_)) => bail!("{name} is both dense and quantized"),
            };
            streamer_device::Error::check_shape(&got, shape, || {
                let what = format!("the config does not match the weights: tensor {name:?}");
                (what, format!("{shape:?}, as the config ({fields}) implies"))
            })?;
        }
        let known: BTreeSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
        let extra = self
            .dense
            .keys()
            .chain(self.quantized.keys())
            .filter(|n| !known.contains(n.as_str()))
            .find(|n| !(cfg.tie_word_embeddings && *n == "lm_head.weight"));
        match extra {
            Some(n) => bail!("the weights hold {n}, which this config does not use"),
            None => Ok(()),
        }
    }
}

/// Reads the safetensors `files` (or a `model.safetensors.index.json`) of a
/// checkpoint in the layout `qc` describes. Errors are
/// [`streamer_device::Error::Checkpoint`] naming the file and the tensor
/// (a tensor of a quantized weight that is truncated, of the wrong dtype or
/// length, a quant state that disagrees with the config), or
/// [`streamer_device::Error::Config`] naming the `quantization_config`
/// field a tensor contradicts.
pub fn read_quantized<P: AsRef<Path>>(
    files: &[P],
    qc: &QuantizationConfig,
) -> Result<QuantizedCheckpoint> {
    let paths = streamer_core::expand_paths(files)?;
    // SAFETY: the files are mapped read-only and copied out before this
    // function returns; the caller must not truncate them meanwhile.
    let st = unsafe { MmapedSafetensors::multi(&paths) }?;
    let r = Reader {
        st: &st,
        path: files[0].as_ref().to_path_buf(),
    };
    let plans = r.plan(qc)?;
    let planned: BTreeSet<&String> = plans.iter().flat_map(|p| &p.parts).collect();
    let dense_names: Vec<String> = r
        .names()
        .into_iter()
        .filter(|n| !planned.contains(n))
        .collect();
    for name in &dense_names {
        r.check_dense(name)?;
    }
    let mut quantized = HashMap::new();
    for p in &plans {
        quantized.insert(p.weight.clone(), r.build(p)?);
    }
    let mut dense = HashMap::new();
    for name in dense_names {
        let t = st.load(&name, &Device::Cpu)?;
        dense.insert(name, t);
    }
    let weight_dtype = plans.iter().find_map(|p| match &p.kind {
        Kind::FourBit(f) => Some(f.dtype),
        _ => None,
    });
    Ok(QuantizedCheckpoint {
        quantized,
        dense,
        weight_dtype,
    })
}

/// A quantized weight found in the headers, checked, not yet read.
struct Plan {
    /// `<module>.weight`.
    weight: String,
    /// Every tensor of the weight.
    parts: Vec<String>,
    kind: Kind,
}

/// A 4-bit weight's tensor names and quant state.
struct FourBitPlan {
    names: FourBitNames,
    state: QuantStateJson,
    quant_type: FourBitType,
    dtype: DType,
}

enum Kind {
    FourBit(Box<FourBitPlan>),
    Int8 {
        scb: String,
        dims: (usize, usize),
    },
    Fp8 {
        scale: String,
        dims: (usize, usize),
        per_tensor: bool,
    },
}

struct Reader<'a> {
    st: &'a MmapedSafetensors,
    path: PathBuf,
}

/// The f32 values of little-endian f32, bf16 or f16 bytes.
fn floats(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

impl Reader<'_> {
    fn names(&self) -> BTreeSet<String> {
        self.st.tensors().into_iter().map(|(n, _)| n).collect()
    }

    fn bad(&self, reason: impl Into<String>) -> candle_core::Error {
        streamer_device::Error::Checkpoint {
            path: self.path.clone(),
            reason: reason.into(),
        }
        .into()
    }

    fn quant(&self, e: QuantError) -> candle_core::Error {
        self.bad(e.to_string())
    }

    /// Tensor `name`, which `weight` needs.
    fn view(&self, weight: &str, name: &str) -> Result<TensorView<'_>> {
        self.st
            .get(name)
            .map_err(|_| self.bad(format!("{weight}: no tensor {name:?} beside it")))
    }

    /// `name`'s view, of dtype `dtype` and `want` elements.
    fn part(&self, weight: &str, name: &str, dtype: Dtype, want: usize) -> Result<TensorView<'_>> {
        let v = self.view(weight, name)?;
        if v.dtype() != dtype {
            return Err(self.bad(format!("{name}: dtype {:?}, expected {dtype:?}", v.dtype())));
        }
        let got = v.shape().iter().product::<usize>();
        if got != want {
            return Err(self.bad(format!(
                "{name}: {got} elements (shape {:?}) where {weight} needs {want}",
                v.shape()
            )));
        }
        Ok(v)
    }

    /// A tensor left dense must be a float tensor: a uint8 or int8 one is a
    /// quantized weight whose state is missing.
    fn check_dense(&self, name: &str) -> Result<()> {
        let dt = self.view(name, name)?.dtype();
        match dt {
            Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64 => Ok(()),
            _ => Err(self.bad(format!(
                "{name}: dtype {dt:?} but no part of a quantized weight (no quant state, SCB \
                 or weight scale beside it for this quantization_config)"
            ))),
        }
    }

    /// Every quantized weight of the files, checked on their headers.
    fn plan(&self, qc: &QuantizationConfig) -> Result<Vec<Plan>> {
        let names = self.names();
        let mut plans = Vec::new();
        for name in &names {
            let plan = match &qc.method {
                QuantMethod::FourBit {
                    quant_type,
                    double_quant,
                    ..
                } => match name.find(QUANT_STATE) {
                    Some(i) => {
                        self.plan_four_bit(&name[..i], name, (*quant_type, *double_quant))?
                    }
                    None => continue,
                },
                QuantMethod::Int8 => match name.strip_suffix(".SCB") {
                    Some(m) => self.plan_int8(&format!("{m}.weight"))?,
                    None => continue,
                },
                QuantMethod::Fp8(layout) => {
                    let suffix = match layout {
                        Fp8Layout::FineGrained { .. } => ".weight_scale_inv",
                        _ => ".weight_scale",
                    };
                    match name.strip_suffix(suffix) {
                        Some(m) => self.plan_fp8(&format!("{m}.weight"), name, *layout, &names)?,
                        None => continue,
                    }
                }
            };
            plans.push(plan);
        }
        Ok(plans)
    }
}

/// 4-bit weights: the quant state, then every part's dtype and length.
impl Reader<'_> {
    /// `weight`, whose quant state is `qs_name`, for a config of quant type
    /// `cfg_type` and double quantization `double_quant`.
    fn plan_four_bit(
        &self,
        weight: &str,
        qs_name: &str,
        (cfg_type, double_quant): (FourBitType, bool),
    ) -> Result<Plan> {
        let qs_view = self.view(weight, qs_name)?;
        if qs_view.dtype() != Dtype::U8 {
            return Err(self.bad(format!(
                "{qs_name}: dtype {:?}, expected U8",
                qs_view.dtype()
            )));
        }
        let state = QuantStateJson::parse(qs_name, qs_view.data()).map_err(|e| self.bad(e))?;
        let quant_type =
            FourBitType::parse(weight, &state.quant_type).map_err(|e| self.quant(e))?;
        if !qs_name.ends_with(&state.quant_type) {
            return Err(self.bad(format!("{qs_name}: holds quant_type {}", state.quant_type)));
        }
        if quant_type != cfg_type {
            return Err(crate::config_fields::field_error(
                "bnb_4bit_quant_type",
                format!(
                    "= {} but {weight} is {}",
                    cfg_type.name(),
                    quant_type.name()
                ),
            ));
        }
        if state.nested_offset.is_some() != double_quant {
            return Err(crate::config_fields::field_error(
                "bnb_4bit_use_double_quant",
                format!("= {double_quant} but {weight}'s quant state says otherwise"),
            ));
        }
        let dtype = torch_dtype(&state.dtype).ok_or_else(|| {
            self.bad(format!(
                "{qs_name}: dtype {:?} is not supported (float32, bfloat16 or float16)",
                state.dtype
            ))
        })?;
        let names = FourBitNames::new(weight, &state.quant_type);
        self.check_four_bit(weight, &names, &state, quant_type)?;
        let parts = names
            .all(weight)
            .into_iter()
            .filter(|n| self.st.get(n).is_ok())
            .collect();
        Ok(Plan {
            weight: weight.to_string(),
            parts,
            kind: Kind::FourBit(Box::new(FourBitPlan {
                names,
                state,
                quant_type,
                dtype,
            })),
        })
    }

    fn check_four_bit(
        &self,
        weight: &str,
        names: &FourBitNames,
        state: &QuantStateJson,
        quant_type: FourBitType,
    ) -> Result<()> {
        if !BLOCK_SIZES.contains(&state.blocksize) {
            return Err(self.quant(QuantError::Unsupported {
                tensor: weight.to_string(),
                field: "blocksize",
                value: state.blocksize.to_string(),
                supported: "32, 64, 128, 256, 512, 1024, 2048 or 4096",
            }));
        }
        let n: usize = state.shape.iter().product();
        let packed = self.view(weight, weight)?;
        if packed.dtype() != Dtype::U8 {
            return Err(crate::config_fields::field_error(
                "bnb_4bit_quant_storage",
                format!(
                    "{weight} is stored as {:?}; only uint8 is supported",
                    packed.dtype()
                ),
            ));
        }
        let want = [n.div_ceil(2), 1];
        if packed.shape() != want {
            return Err(self.quant(QuantError::Length {
                tensor: weight.to_string(),
                part: "packed data",
                got: packed.shape().iter().product(),
                expected: n.div_ceil(2),
                shape: state.shape.clone(),
            }));
        }
        let blocks = n.div_ceil(state.blocksize);
        let map = self.part(weight, &names.quant_map, Dtype::F32, 16)?;
        let code = quant_type.code();
        let far = floats(Dtype::F32, map.data())
            .iter()
            .zip(code)
            .any(|(a, b)| (a - b).abs() > 1e-6);
        if far {
            return Err(self.bad(format!(
                "{}: not the {} code (custom 4-bit maps are not implemented)",
                names.quant_map,
                quant_type.name()
            )));
        }
        match state.nested_offset {
            None => self
                .part(weight, &names.absmax, Dtype::F32, blocks)
                .map(|_| ()),
            Some(_) => self.check_nested(weight, names, state, blocks),
        }
    }

    fn check_nested(
        &self,
        weight: &str,
        names: &FourBitNames,
        state: &QuantStateJson,
        blocks: usize,
    ) -> Result<()> {
        let nested_bs = state.nested_blocksize.unwrap_or(0);
        if nested_bs == 0 || state.nested_dtype.as_deref() != Some("float32") {
            return Err(self.bad(format!(
                "{}: nested_blocksize {:?} and nested_dtype {:?} are not supported (a positive \
                 block size, float32)",
                names.quant_state, state.nested_blocksize, state.nested_dtype
            )));
        }
        self.part(weight, &names.absmax, Dtype::U8, blocks)?;
        self.part(weight, &names.nested_quant_map, Dtype::F32, 256)?;
        let scales = blocks.div_ceil(nested_bs);
        self.part(weight, &names.nested_absmax, Dtype::F32, scales)
            .map(|_| ())
    }

    fn build_four_bit(
        &self,
        weight: &str,
        names: &FourBitNames,
        state: &QuantStateJson,
        quant_type: FourBitType,
    ) -> Result<HostTensor> {
        let data = |name: &str| -> Result<Vec<u8>> { Ok(self.view(weight, name)?.data().to_vec()) };
        let f32s = |name: &str| -> Result<Vec<f32>> {
            Ok(floats(Dtype::F32, self.view(weight, name)?.data()))
        };
        let absmax = match state.nested_offset {
            None => Absmax::Plain(f32s(&names.absmax)?),
            Some(offset) => Absmax::Nested(NestedAbsmax {
                codes: data(&names.absmax)?,
                map: f32s(&names.nested_quant_map)?,
                absmax: f32s(&names.nested_absmax)?,
                blocksize: state.nested_blocksize.unwrap_or(0),
                offset: offset as f32,
            }),
        };
        let q = FourBit::new(
            weight,
            &state.shape,
            (quant_type, state.blocksize),
            data(weight)?,
            absmax,
        )
        .map_err(|e| self.quant(e))?;
        Ok(HostTensor::FourBit(q))
    }
}

/// int8 and fp8 weights: a 2-D data tensor and its scales.
impl Reader<'_> {
    /// The `(rows, cols)` of a 2-D `weight` of dtype `dtype`.
    fn dims(&self, weight: &str, dtype: Dtype) -> Result<(usize, usize)> {
        let v = self.view(weight, weight)?;
        match (v.dtype() == dtype, v.shape()) {
            (true, &[rows, cols]) => Ok((rows, cols)),
            _ => Err(self.bad(format!(
                "{weight}: dtype {:?} shape {:?}, expected a 2-D {dtype:?} weight",
                v.dtype(),
                v.shape()
            ))),
        }
    }

    fn plan_int8(&self, weight: &str) -> Result<Plan> {
        let dims = self.dims(weight, Dtype::I8)?;
        let (scb, format) = int8_names(weight);
        self.part(weight, &scb, Dtype::F32, dims.0)?;
        let mut parts = vec![weight.to_string(), scb.clone()];
        if let Ok(f) = self.st.get(&format) {
            // bitsandbytes refuses other layouts (col32, col_turing, ...) too.
            if f.dtype() != Dtype::U8 || f.data() != [0] {
                return Err(self.bad(format!(
                    "{format}: {:?} {:?} is not supported (0, row-major, as uint8)",
                    f.dtype(),
                    f.data()
                )));
            }
            parts.push(format);
        }
        Ok(Plan {
            weight: weight.to_string(),
            parts,
            kind: Kind::Int8 { scb, dims },
        })
    }

    fn plan_fp8(
        &self,
        weight: &str,
        scale: &str,
        layout: Fp8Layout,
        names: &BTreeSet<String>,
    ) -> Result<Plan> {
        let dims = self.dims(weight, Dtype::F8_E4M3)?;
        let v = self.view(weight, scale)?;
        if !matches!(v.dtype(), Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            return Err(self.bad(format!("{scale}: dtype {:?}, expected a float", v.dtype())));
        }
        let per_row = v.shape() == [dims.0, 1] || v.shape() == [dims.0];
        let per_tensor = v.shape().iter().product::<usize>() == 1;
        let fits = match layout {
            Fp8Layout::Fbgemm => per_row,
            Fp8Layout::CompressedTensors { per_channel } => match per_channel {
                true => per_row,
                false => per_tensor,
            },
            Fp8Layout::FineGrained { block: None } => per_tensor,
            Fp8Layout::FineGrained { block: Some(_) } => per_row,
        };
        if !fits {
            return Err(self.bad(format!(
                "{scale}: shape {:?} is not the scale {layout:?} implies for {weight} of {dims:?} \
                 (quantization_config.weight_block_size / strategy)",
                v.shape()
            )));
        }
        let mut parts = vec![weight.to_string(), scale.to_string()];
        // fbgemm's activation bound: activation-side, see quantization_config.
        let ub = format!("{}.input_scale_ub", weight.trim_end_matches(".weight"));
        if names.contains(&ub) {
            parts.push(ub);
        }
        Ok(Plan {
            weight: weight.to_string(),
            parts,
            kind: Kind::Fp8 {
                scale: scale.to_string(),
                dims,
                per_tensor: matches!(
                    layout,
                    Fp8Layout::CompressedTensors { per_channel: false }
                        | Fp8Layout::FineGrained { block: None }
                ),
            },
        })
    }

    /// The planned weight, copied out of the files.
    fn build(&self, p: &Plan) -> Result<HostTensor> {
        let w = &p.weight;
        match &p.kind {
            Kind::FourBit(f) => self.build_four_bit(w, &f.names, &f.state, f.quant_type),
            Kind::Int8 { scb, dims } => {
                let data = self.view(w, w)?.data().iter().map(|&b| b as i8).collect();
                let scb = floats(Dtype::F32, self.view(w, scb)?.data());
                let q = Int8Rows::new(w, *dims, data, scb).map_err(|e| self.quant(e))?;
                Ok(HostTensor::Int8(q))
            }
            Kind::Fp8 {
                scale,
                dims,
                per_tensor,
            } => {
                let v = self.view(w, scale)?;
                let s = floats(v.dtype(), v.data());
                let scale = match *per_tensor {
                    true => Fp8Scale::Tensor(s[0]),
                    false => Fp8Scale::Rows(s),
                };
                let data = self.view(w, w)?.data().to_vec();
                let q = Fp8::new(w, *dims, data, scale).map_err(|e| self.quant(e))?;
                Ok(HostTensor::Fp8(q))
            }
        }
    }
}
