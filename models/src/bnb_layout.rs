//! bitsandbytes' serialized layout of a quantized `Linear` weight, as its
//! `Linear4bit._save_to_state_dict` (`QuantState.as_dict(packed=True)`) and
//! `Linear8bitLt._save_to_state_dict` write it and `QuantState.from_dict`
//! reads it: the tensor names beside `<module>.weight` and the JSON blob of
//! the 4-bit quant state. Shared by the reader and the writer so the two
//! cannot drift.
use candle_core::Result;
use serde::{Deserialize, Serialize};

/// What a 4-bit weight's quant-state tensor name ends with, before the
/// quant type (`<module>.weight.quant_state.bitsandbytes__nf4`).
pub(crate) const QUANT_STATE: &str = ".quant_state.bitsandbytes__";

/// The names of a 4-bit weight's tensors (`weight` is `<module>.weight`,
/// which holds the packed bytes, `[(n + 1) / 2, 1]` uint8).
pub(crate) struct FourBitNames {
    /// f32 `[blocks]`, or uint8 `[blocks]` when nested.
    pub absmax: String,
    /// f32 `[16]`: the code values.
    pub quant_map: String,
    /// f32 `[ceil(blocks / nested_blocksize)]`.
    pub nested_absmax: String,
    /// f32 `[256]`: the map the nested codes index.
    pub nested_quant_map: String,
    /// uint8 `[len]`: the [`QuantStateJson`] text.
    pub quant_state: String,
}

impl FourBitNames {
    /// The names beside `weight` for quant type `quant_type` (`nf4`).
    pub fn new(weight: &str, quant_type: &str) -> Self {
        Self {
            absmax: format!("{weight}.absmax"),
            quant_map: format!("{weight}.quant_map"),
            nested_absmax: format!("{weight}.nested_absmax"),
            nested_quant_map: format!("{weight}.nested_quant_map"),
            quant_state: format!("{weight}{QUANT_STATE}{quant_type}"),
        }
    }

    /// Every name, the packed weight's first.
    pub fn all(&self, weight: &str) -> [String; 6] {
        [
            weight.to_string(),
            self.absmax.clone(),
            self.quant_map.clone(),
            self.nested_absmax.clone(),
            self.nested_quant_map.clone(),
            self.quant_state.clone(),
        ]
    }
}

/// The module of an 8-bit weight `<module>.weight`: its row absmax is
/// `<module>.SCB` (f32 `[rows]`) and `<module>.weight_format` a uint8
/// scalar (0: row-major, the only layout bitsandbytes still writes).
pub(crate) fn int8_names(weight: &str) -> (String, String) {
    let module = weight.strip_suffix(".weight").unwrap_or(weight);
    (format!("{module}.SCB"), format!("{module}.weight_format"))
}

/// The non-tensor part of a 4-bit quant state, stored as the UTF-8 bytes of
/// its JSON (bitsandbytes' `pack_dict_to_tensor`), fields in bitsandbytes'
/// order. Unknown fields are refused, as `QuantState.from_dict` refuses
/// them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct QuantStateJson {
    /// `nf4` or `fp4`.
    pub quant_type: String,
    /// Elements per absmax.
    pub blocksize: usize,
    /// The dtype bitsandbytes dequantizes to (`bfloat16`).
    pub dtype: String,
    /// The weight's shape.
    pub shape: Vec<usize>,
    /// Nested absmax codes per scale (256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nested_blocksize: Option<usize>,
    /// The nested scales' dtype (`float32`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nested_dtype: Option<String>,
    /// Added to every dequantized absmax (an f32 written as a Python float).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nested_offset: Option<f64>,
}

impl QuantStateJson {
    /// The state from its stored bytes; `tensor` names it in errors.
    pub fn parse(tensor: &str, bytes: &[u8]) -> std::result::Result<Self, String> {
        serde_json::from_slice(bytes)
            .map_err(|e| format!("{tensor}: not a bitsandbytes quant state ({e})"))
    }

    /// The bytes bitsandbytes stores: Python's `json.dumps` spacing
    /// (`", "` and `": "`).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonSpacing);
        self.serialize(&mut ser)
            .map_err(|e| candle_core::Error::Msg(format!("quant state: {e}")))?;
        Ok(out)
    }
}

/// serde_json's compact output with the separators of Python's `json.dumps`.
struct PythonSpacing;

impl serde_json::ser::Formatter for PythonSpacing {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(w, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        comma(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// Python's item separator `", "` before every item but the first.
fn comma<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        w.write_all(b", ")
    }
}
