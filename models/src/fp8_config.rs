//! The fp8 `quantization_config`s: `fbgemm_fp8`, transformers' fine-grained
//! `fp8` and `compressed-tensors` float-quantized, each accepted where its
//! weights are e4m3 with one scale per tensor or per output row (what
//! [`streamer_quant::Fp8`] holds exactly) and refused, naming the field,
//! otherwise. Why activation settings are accepted: see
//! [`crate::quantization_config`].
use crate::config_fields::{field_error, flag, names, only_known, require, Obj};
use candle_core::Result;
use serde_json::{json, Value};

/// The fp8 layout and skipped modules of a `quantization_config` of method
/// `method` (`fbgemm_fp8`, `fp8` or `compressed-tensors`).
pub(crate) fn parse_fp8(method: &str, o: &Obj) -> Result<Parsed> {
    match method {
        "fbgemm_fp8" => fbgemm(o),
        "fp8" => fine_grained(o),
        _ => compressed_tensors(o),
    }
}

/// Where an fp8 checkpoint keeps its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Layout {
    /// `fbgemm_fp8`: `weight_scale` of shape `[rows, 1]`.
    Fbgemm,
    /// `fp8` (transformers' fine-grained fp8): `weight_scale_inv`, one per
    /// block of `weight_block_size` (`None`: one per tensor). Only blocks
    /// our [`streamer_quant::Fp8`] holds exactly are accepted: whole rows
    /// (`[1, n]` with `n` at least the row length) or the whole tensor.
    FineGrained {
        /// `weight_block_size`.
        block: Option<[usize; 2]>,
    },
    /// `compressed-tensors` float-quantized: `weight_scale` per tensor or
    /// per output channel.
    CompressedTensors {
        /// `strategy: "channel"` (else `"tensor"`).
        per_channel: bool,
    },
}

pub(crate) type Parsed = (Fp8Layout, Option<Vec<String>>);

fn fbgemm(o: &Obj) -> Result<Parsed> {
    only_known(
        o,
        "",
        &[
            "quant_method",
            "activation_scale_ub",
            "modules_to_not_convert",
        ],
    )?;
    Ok((Fp8Layout::Fbgemm, names(o, "modules_to_not_convert")?))
}

fn fine_grained(o: &Obj) -> Result<Parsed> {
    only_known(
        o,
        "",
        &[
            "quant_method",
            "activation_scheme",
            "weight_block_size",
            "modules_to_not_convert",
            // Whether transformers dequantizes on load: the stored weights
            // are the same.
            "dequantize",
        ],
    )?;
    require(o, "activation_scheme", &json!("dynamic"))?;
    flag(o, "dequantize", false)?;
    let block = match o.get("weight_block_size") {
        None | Some(Value::Null) => None,
        Some(v) => Some(row_block(v)?),
    };
    let layout = Fp8Layout::FineGrained { block };
    Ok((layout, names(o, "modules_to_not_convert")?))
}

/// A `weight_block_size` our per-row scales hold: `[1, n]` (a scale per row
/// when `n` covers the row, checked per tensor).
fn row_block(v: &Value) -> Result<[usize; 2]> {
    let pair = v
        .as_array()
        .filter(|a| a.len() == 2)
        .and_then(|a| Some([a[0].as_u64()? as usize, a[1].as_u64()? as usize]));
    match pair {
        Some([1, n]) if n > 0 => Ok([1, n]),
        _ => Err(field_error(
            "weight_block_size",
            format!(
                "= {v} is not supported: block scales other than one per row ([1, n] with n \
                 at least the row length) or one per tensor (null) are not implemented"
            ),
        )),
    }
}

/// Top-level fields of a compressed-tensors config.
const CT_FIELDS: [&str; 10] = [
    "quant_method",
    "format",
    "config_groups",
    "ignore",
    "quantization_status",
    "kv_cache_scheme",
    "global_compression_ratio",
    "version",
    "sparsity_config",
    "transform_config",
];

fn compressed_tensors(o: &Obj) -> Result<Parsed> {
    only_known(o, "", &CT_FIELDS)?;
    require(o, "format", &json!("float-quantized"))?;
    require(o, "quantization_status", &json!("compressed"))?;
    require(o, "kv_cache_scheme", &Value::Null)?;
    for empty in ["sparsity_config", "transform_config"] {
        if o.get(empty)
            .is_some_and(|v| !v.is_null() && v != &json!({}))
        {
            return Err(field_error(empty, "is not supported (must be empty)"));
        }
    }
    let group = match o.get("config_groups") {
        Some(Value::Object(g)) if g.len() == 1 => g.iter().next(),
        _ => None,
    };
    let (name, group) = match group {
        Some(g) => g,
        None => {
            return Err(field_error(
                "config_groups",
                format!(
                    "= {} is not supported (one group of fp8 weights)",
                    o.get("config_groups").unwrap_or(&Value::Null)
                ),
            ))
        }
    };
    let per_channel = ct_group(&format!("config_groups.{name}."), group)?;
    let layout = Fp8Layout::CompressedTensors { per_channel };
    Ok((layout, names(o, "ignore")?))
}

/// One config group: fp8 weights (tensor or channel scales), dynamic or no
/// input activations, no output activations. Whether its scales are per
/// channel.
fn ct_group(prefix: &str, g: &Value) -> Result<bool> {
    let g = g
        .as_object()
        .ok_or_else(|| field_error(prefix, "is not an object"))?;
    let at = |f: &str| format!("{prefix}{f}");
    only_known(
        g,
        prefix,
        &[
            "targets",
            "weights",
            "input_activations",
            "output_activations",
            "format",
        ],
    )?;
    require(g, "targets", &json!(["Linear"])).map_err(|_| targets_error(&at("targets")))?;
    require(g, "output_activations", &Value::Null)
        .map_err(|_| field_error(&at("output_activations"), "is not supported (must be null)"))?;
    if let Some(a) = g.get("input_activations").and_then(Value::as_object) {
        if a.get("dynamic") != Some(&json!(true)) {
            return Err(field_error(
                &at("input_activations.dynamic"),
                "is not supported: static activation scales are not implemented (must be true)",
            ));
        }
    }
    let w = g
        .get("weights")
        .and_then(Value::as_object)
        .ok_or_else(|| field_error(&at("weights"), "is missing or not an object"))?;
    ct_weights(&at("weights."), w)
}

fn targets_error(field: &str) -> candle_core::Error {
    field_error(field, "is not supported (must be [\"Linear\"])")
}

/// The weights' scheme: 8-bit symmetric float, static, scales per tensor or
/// per channel. Whether per channel.
fn ct_weights(prefix: &str, w: &Obj) -> Result<bool> {
    // Calibration settings (`observer`, `observer_kwargs`) pass: they chose
    // the stored scales and play no part in using them.
    let must = [
        ("num_bits", json!(8)),
        ("type", json!("float")),
        ("symmetric", json!(true)),
        ("dynamic", json!(false)),
        ("group_size", Value::Null),
        ("block_structure", Value::Null),
        ("actorder", Value::Null),
    ];
    for (field, want) in &must {
        if w.get(*field).is_some_and(|v| v != want) {
            return Err(field_error(
                &format!("{prefix}{field}"),
                format!("= {} is not supported (must be {want})", w[*field]),
            ));
        }
    }
    match w.get("strategy").and_then(Value::as_str) {
        Some("tensor") => Ok(false),
        Some("channel") => Ok(true),
        _ => Err(field_error(
            &format!("{prefix}strategy"),
            format!(
                "= {} is not supported (\"tensor\" or \"channel\")",
                w.get("strategy").unwrap_or(&Value::Null)
            ),
        )),
    }
}
