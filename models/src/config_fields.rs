//! Reading a `quantization_config` object strictly: typed fields, and an
//! error naming any field whose math is not implemented (refused rather
//! than ignored). Shared by the bitsandbytes and fp8 parsers.
use candle_core::Result;
use serde_json::{Map, Value};

/// A JSON object.
pub(crate) type Obj = Map<String, Value>;

/// A `quantization_config` field error: "config field
/// quantization_config.{field} {reason}".
pub(crate) fn field_error(field: &str, reason: impl Into<String>) -> candle_core::Error {
    streamer_device::Error::Config {
        field: format!("quantization_config.{field}"),
        reason: reason.into(),
    }
    .into()
}

/// Errors for every key of `o` not in `known` (a field whose math is not
/// implemented here: refused rather than ignored).
pub(crate) fn only_known(o: &Obj, prefix: &str, known: &[&str]) -> Result<()> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => Err(field_error(
            &format!("{prefix}{k}"),
            format!("= {} is not supported (known fields: {known:?})", o[k]),
        )),
    }
}

/// A boolean field (`default` when absent or null).
pub(crate) fn flag(o: &Obj, field: &str, default: bool) -> Result<bool> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(field_error(field, format!("= {v} is not a boolean"))),
    }
}

/// A field that must be `want` when present.
pub(crate) fn require(o: &Obj, field: &str, want: &Value) -> Result<()> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v == want => Ok(()),
        Some(v) => Err(field_error(
            field,
            format!("= {v} is not supported (must be {want})"),
        )),
    }
}

/// A list of module names (`null` is `None`).
pub(crate) fn names(o: &Obj, field: &str) -> Result<Option<Vec<String>>> {
    let bad = |v: &Value| field_error(field, format!("= {v} is not a list of module names"));
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(String::from).ok_or_else(|| bad(s)))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(v) => Err(bad(v)),
    }
}
