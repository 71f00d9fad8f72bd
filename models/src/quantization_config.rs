//! `quantization_config` of a transformers `config.json`: which quantized
//! layout the weights are in (bitsandbytes 4-bit or 8-bit, fp8), read
//! strictly. A field this project's math does not implement, or a value it
//! does not support, is a [`streamer_device::Error::Config`] naming the field
//! (`quantization_config.bnb_4bit_quant_storage`), found before any tensor is
//! read.
//!
//! Fields that only steer how the peer multiplies *activations* are accepted:
//! our quantized layers are weight-only (the weight is dequantized, the
//! activations stay in the compute dtype), so bitsandbytes' int8 outlier
//! threshold (`llm_int8_threshold`), fbgemm's `activation_scale_ub` and a
//! dynamic fp8 activation scheme name nothing we compute, and the stored
//! weights are the same whatever they say. Static activation scales
//! (calibrated values stored in the checkpoint) are refused: ignoring them
//! would change the model.
use crate::config_fields::{field_error, flag, names, only_known, require, Obj};
use crate::fp8_config::{parse_fp8, Fp8Layout};
use candle_core::{DType, Result};
use serde_json::{json, Value};
use streamer_quant::{FourBitType, QuantScheme};

/// The quantized layout of a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizationConfig {
    /// The format of the quantized weights.
    pub method: QuantMethod,
    /// Modules kept dense (bitsandbytes' `llm_int8_skip_modules`, the fp8
    /// methods' `modules_to_not_convert` or `ignore`); `None` when the file
    /// names none (transformers then keeps `lm_head` dense).
    pub skip_modules: Option<Vec<String>>,
}

/// The quantized weight formats a checkpoint can hold.
#[derive(Clone, Debug, PartialEq)]
pub enum QuantMethod {
    /// bitsandbytes `load_in_4bit`: NF4 or FP4 blocks.
    FourBit {
        /// `bnb_4bit_quant_type`.
        quant_type: FourBitType,
        /// `bnb_4bit_use_double_quant`: absmax stored in 8 bits.
        double_quant: bool,
        /// `bnb_4bit_compute_dtype`: the dtype bitsandbytes multiplies in.
        compute_dtype: DType,
    },
    /// bitsandbytes `load_in_8bit`: int8 rows and their absmax (`SCB`).
    Int8,
    /// float8 e4m3 weights with per-tensor or per-row scales.
    Fp8(Fp8Layout),
}

impl QuantMethod {
    /// How this method quantizes a weight: bitsandbytes' 4-bit blocks of 64
    /// (the only size transformers passes), its int8 rows, fp8 with a scale
    /// per row.
    pub fn scheme(&self) -> QuantScheme {
        match self {
            Self::FourBit {
                quant_type,
                double_quant,
                ..
            } => QuantScheme::FourBit {
                kind: *quant_type,
                blocksize: 64,
                double: *double_quant,
            },
            Self::Int8 => QuantScheme::Int8,
            Self::Fp8(_) => QuantScheme::Fp8 { per_row: true },
        }
    }
}

/// Fields of transformers' `BitsAndBytesConfig.to_dict()`.
const BNB_FIELDS: [&str; 13] = [
    "quant_method",
    "load_in_4bit",
    "load_in_8bit",
    "_load_in_4bit",
    "_load_in_8bit",
    "llm_int8_threshold",
    "llm_int8_skip_modules",
    "llm_int8_enable_fp32_cpu_offload",
    "llm_int8_has_fp16_weight",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
];

impl QuantizationConfig {
    /// The `quantization_config` of a `config.json` text, `None` when it
    /// has none (or `null`).
    pub fn from_config_json(text: &str) -> Result<Option<Self>> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid config.json: {e}")))?;
        match v.get("quantization_config") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => Self::from_object(o).map(Some),
            Some(v) => Err(streamer_device::Error::Config {
                field: "quantization_config".into(),
                reason: format!("= {v} is not an object"),
            }
            .into()),
        }
    }

    /// A `quantization_config` object.
    pub fn from_object(o: &Obj) -> Result<Self> {
        match o.get("quant_method").and_then(Value::as_str) {
            Some("bitsandbytes") => parse_bnb(o),
            Some(m @ ("fbgemm_fp8" | "fp8" | "compressed-tensors")) => {
                let (layout, skip_modules) = parse_fp8(m, o)?;
                Ok(QuantizationConfig {
                    method: QuantMethod::Fp8(layout),
                    skip_modules,
                })
            }
            _ => Err(field_error(
                "quant_method",
                format!(
                    "= {} is not supported (\"bitsandbytes\", \"fbgemm_fp8\", \"fp8\" or \
                     \"compressed-tensors\")",
                    o.get("quant_method").unwrap_or(&Value::Null)
                ),
            )),
        }
    }

    /// The `quantization_config` transformers' `BitsAndBytesConfig` writes
    /// for this configuration (bitsandbytes methods only; fp8 is read, not
    /// written).
    pub fn to_bnb_json(&self) -> Result<Value> {
        let (four, quant_type, double, compute) = match &self.method {
            QuantMethod::FourBit {
                quant_type,
                double_quant,
                compute_dtype,
            } => (true, *quant_type, *double_quant, *compute_dtype),
            QuantMethod::Int8 => (false, FourBitType::Fp4, false, DType::F32),
            QuantMethod::Fp8(_) => {
                return Err(field_error(
                    "quant_method",
                    "fp8 checkpoints are read, not written (only bitsandbytes' layout is)",
                ))
            }
        };
        Ok(json!({
            "quant_method": "bitsandbytes",
            "_load_in_4bit": four,
            "_load_in_8bit": !four,
            "load_in_4bit": four,
            "load_in_8bit": !four,
            "llm_int8_threshold": 6.0,
            "llm_int8_skip_modules": self.skip_modules,
            "llm_int8_enable_fp32_cpu_offload": false,
            "llm_int8_has_fp16_weight": false,
            "bnb_4bit_quant_type": quant_type.name(),
            "bnb_4bit_use_double_quant": double,
            "bnb_4bit_compute_dtype": torch_dtype_name(compute),
            "bnb_4bit_quant_storage": "uint8",
        }))
    }

    /// Whether `weight` (an HF weight name) belongs to a module kept dense:
    /// one of [`Self::skip_modules`] (`lm_head` when the file names none) is
    /// the module's name, its last components or a dotted run inside it.
    pub fn skips(&self, weight: &str) -> bool {
        let default = [String::from("lm_head")];
        let skip = self.skip_modules.as_deref().unwrap_or(&default);
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        skip.iter().any(|s| {
            module == s || module.ends_with(&format!(".{s}")) || module.contains(&format!(".{s}."))
        })
    }
}

/// transformers' name of a dtype (`bfloat16`).
pub(crate) fn torch_dtype_name(dt: DType) -> &'static str {
    match dt {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// The dtype of a torch name (`bfloat16`, `torch.bfloat16`): float16,
/// bfloat16 or float32.
pub(crate) fn torch_dtype(name: &str) -> Option<DType> {
    match name.trim_start_matches("torch.") {
        "bfloat16" => Some(DType::BF16),
        "float16" => Some(DType::F16),
        "float32" => Some(DType::F32),
        _ => None,
    }
}

/// A dtype field ([`torch_dtype`]).
fn parse_torch_dtype(field: &str, v: &Value) -> Result<DType> {
    v.as_str().and_then(torch_dtype).ok_or_else(|| {
        field_error(
            field,
            format!("= {v} is not supported (\"float32\", \"bfloat16\" or \"float16\")"),
        )
    })
}

/// Which of `load_in_4bit` / `load_in_8bit` (and their `_`-prefixed twins,
/// which must agree) is on: exactly one.
fn bnb_bits(o: &Obj) -> Result<bool> {
    let four = flag(o, "load_in_4bit", false)?;
    let eight = flag(o, "load_in_8bit", false)?;
    for (twin, value) in [("_load_in_4bit", four), ("_load_in_8bit", eight)] {
        if o.contains_key(twin) && flag(o, twin, value)? != value {
            return Err(field_error(twin, format!("disagrees with {}", &twin[1..])));
        }
    }
    match (four, eight) {
        (true, false) => Ok(true),
        (false, true) => Ok(false),
        _ => Err(field_error(
            "load_in_4bit",
            format!("= {four} with load_in_8bit = {eight}: exactly one must be true"),
        )),
    }
}

fn parse_bnb(o: &Obj) -> Result<QuantizationConfig> {
    only_known(o, "", &BNB_FIELDS)?;
    let four = bnb_bits(o)?;
    if flag(o, "llm_int8_has_fp16_weight", false)? {
        return Err(field_error(
            "llm_int8_has_fp16_weight",
            "= true is not supported (the weights would be 16-bit, not int8)",
        ));
    }
    // Placement only (which modules bitsandbytes may keep on the CPU).
    flag(o, "llm_int8_enable_fp32_cpu_offload", false)?;
    if let Some(t) = o.get("llm_int8_threshold").filter(|t| !t.is_null()) {
        // Activation outliers in bitsandbytes' int8 matmul: see the module
        // comment; checked for type only.
        t.as_f64()
            .ok_or_else(|| field_error("llm_int8_threshold", format!("= {t} is not a number")))?;
    }
    require(o, "bnb_4bit_quant_storage", &json!("uint8"))?;
    let method = match four {
        true => four_bit_method(o)?,
        false => QuantMethod::Int8,
    };
    Ok(QuantizationConfig {
        method,
        skip_modules: names(o, "llm_int8_skip_modules")?,
    })
}

fn four_bit_method(o: &Obj) -> Result<QuantMethod> {
    let quant_type = match o.get("bnb_4bit_quant_type") {
        None | Some(Value::Null) => FourBitType::Fp4,
        Some(v) => v
            .as_str()
            .and_then(|s| FourBitType::parse("", s).ok())
            .ok_or_else(|| {
                field_error(
                    "bnb_4bit_quant_type",
                    format!("= {v} is not supported (\"nf4\" or \"fp4\")"),
                )
            })?,
    };
    let compute_dtype = match o.get("bnb_4bit_compute_dtype") {
        None | Some(Value::Null) => DType::F32,
        Some(v) => parse_torch_dtype("bnb_4bit_compute_dtype", v)?,
    };
    Ok(QuantMethod::FourBit {
        quant_type,
        double_quant: flag(o, "bnb_4bit_use_double_quant", false)?,
        compute_dtype,
    })
}
