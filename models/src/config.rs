//! Llama configuration in the layout of Hugging Face's `config.json`, presets,
//! and the weight names and shapes a configuration implies.
use candle_core::{bail, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// Rotary-embedding frequency scaling (`rope_scaling` in `config.json`): Llama
/// 3's `"llama3"` scheme, `"linear"` (every frequency divided by `factor`) and
/// `"default"` (no scaling).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// `"llama3"`, `"linear"` or `"default"` (older files call this field `type`).
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Context extension factor.
    #[serde(default = "one")]
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled fully.
    #[serde(default = "one")]
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    #[serde(default = "four")]
    pub high_freq_factor: f64,
    /// The context length the model was trained with before extension.
    #[serde(default = "default_original_max")]
    pub original_max_position_embeddings: usize,
}

/// An invalid or unsupported `config.json` field: "config field {field} {reason}".
fn field_error(field: impl Into<String>, reason: impl Into<String>) -> candle_core::Error {
    streamer_device::Error::Config {
        field: field.into(),
        reason: reason.into(),
    }
    .into()
}

fn one() -> f64 {
    1.0
}
fn four() -> f64 {
    4.0
}
fn default_original_max() -> usize {
    8192
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}
fn default_model_type() -> String {
    "llama".into()
}

/// The model families this decoder runs (`model_type` in `config.json`).
pub const MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

/// A Llama-family decoder's configuration. Field names are those of Hugging
/// Face's `config.json` for Llama, Mistral, Qwen2 and Qwen3 models; unknown
/// fields are ignored, missing optional ones take Hugging Face's defaults.
///
/// The family (`model_type`) decides what the fields cannot say: Qwen2 has
/// q/k/v biases (no `o_proj` bias), Qwen3 an RMSNorm over each query and key
/// head before the rotary embedding; Llama's `attention_bias` puts biases on
/// q/k/v/o.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Model family: `llama`, `mistral`, `qwen2` or `qwen3` ([`MODEL_TYPES`]).
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); `None` means `num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Head dimension; `None` means `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Vocabulary size (rows of the embedding and the head).
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// Base of the rotary embedding's frequencies.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Longest sequence the rotary tables are built for.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// The head reuses the embedding matrix (no `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Rotary frequency scaling (Llama 3.1+).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the q/k/v/o projections (Llama, Qwen3; Qwen2's q/k/v biases
    /// come with the family, Mistral has none).
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP projections (not supported: must be false).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Activation of the MLP gate (only `"silu"` is supported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// Sliding-window attention: a query sees the `sliding_window` most recent
    /// keys (itself included) in the layers `layer_types` marks
    /// `sliding_attention` (every layer when `layer_types` is empty); `None` is
    /// dense attention. Qwen's `use_sliding_window: false` reads as `None`.
    /// Attention applies it through cqsa's window mask.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Each layer's attention, `full_attention` or `sliding_attention`
    /// (transformers 5.x; Qwen 4.x files' `max_window_layers` is read into it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layer_types: Vec<String>,
}

impl LlamaConfig {
    /// A decoder for byte-level text (vocabulary 256) with the given sizes;
    /// `intermediate_size` is 8/3 of the width rounded up to a multiple of 128.
    pub fn bytes(hidden: usize, layers: usize, heads: usize, kv_heads: usize) -> Self {
        Self {
            model_type: default_model_type(),
            hidden_size: hidden,
            intermediate_size: (hidden * 8 / 3).div_ceil(128) * 128,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv_heads),
            head_dim: None,
            vocab_size: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            rope_scaling: None,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: Some("silu".into()),
            sliding_window: None,
            layer_types: Vec::new(),
        }
    }

    /// `tiny`: about 0.85 M parameters, 4 layers of width 128, 4 query / 2
    /// key-value heads of 32; trains on a 2-core CPU in 2-3 minutes.
    pub fn tiny() -> Self {
        Self {
            max_position_embeddings: 512,
            ..Self::bytes(128, 4, 4, 2)
        }
    }

    /// `350m`: about 0.35 B parameters, 30 layers of width 1024 (16 heads of 64,
    /// 8 key-value heads), MLP 2816.
    pub fn llama_350m() -> Self {
        Self::bytes(1024, 30, 16, 8)
    }

    /// `1b`: the layer shapes of Llama 3.2 1B (16 layers of width 2048, 32 heads
    /// of 64, 8 key-value heads, MLP 8192; about 0.97 B parameters in the
    /// layers), byte-level vocabulary, tied embeddings.
    pub fn llama_1b() -> Self {
        Self {
            intermediate_size: 8192,
            rope_theta: 500_000.0,
            tie_word_embeddings: true,
            ..Self::bytes(2048, 16, 32, 8)
        }
    }

    /// `3b`: the layer shapes of Llama 3.2 3B (28 layers of width 3072, 24 heads
    /// of 128, 8 key-value heads, MLP 8192; about 2.8 B parameters in the
    /// layers), byte-level vocabulary, tied embeddings.
    pub fn llama_3b() -> Self {
        Self {
            intermediate_size: 8192,
            rope_theta: 500_000.0,
            tie_word_embeddings: true,
            ..Self::bytes(3072, 28, 24, 8)
        }
    }

    /// Llama 3.1 8B's shapes (random-weight benchmarks and model folders): 32
    /// layers of width 4096, 32 heads of 128 over 8 key-value heads, MLP
    /// 14336, vocabulary 128256, llama3 rope scaling, untied head.
    pub fn llama31_8b() -> Self {
        Self {
            intermediate_size: 14336,
            vocab_size: 128256,
            rope_theta: 500_000.0,
            max_position_embeddings: 131072,
            rope_scaling: Some(RopeScaling {
                rope_type: "llama3".into(),
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            ..Self::bytes(4096, 32, 32, 8)
        }
    }

    /// Llama 3.1 70B's shapes (random-weight benchmarks, quantized bases): 80
    /// layers of width 8192, 64 heads of 128 over 8 key-value heads, MLP
    /// 28672, vocabulary 128256, llama3 rope scaling, untied head; 70.6 B
    /// parameters.
    pub fn llama31_70b() -> Self {
        Self {
            intermediate_size: 28672,
            ..Self {
                hidden_size: 8192,
                num_hidden_layers: 80,
                num_attention_heads: 64,
                num_key_value_heads: Some(8),
                ..Self::llama31_8b()
            }
        }
    }

    /// Qwen2.5 14B's shapes (random-weight benchmarks): 48 layers of width
    /// 5120, 40 heads of 128 over 8 key-value heads, q/k/v biases, MLP 13824,
    /// vocabulary 152064, untied head; 14.77 B parameters.
    pub fn qwen25_14b() -> Self {
        Self {
            model_type: "qwen2".into(),
            intermediate_size: 13824,
            vocab_size: 152064,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            max_position_embeddings: 32768,
            ..Self::bytes(5120, 48, 40, 8)
        }
    }

    /// A preset by name: `tiny`, `350m`, `1b` or `3b`.
    pub fn preset(name: &str) -> Result<Self> {
        Ok(match name {
            "tiny" => Self::tiny(),
            "350m" => Self::llama_350m(),
            "1b" => Self::llama_1b(),
            "3b" => Self::llama_3b(),
            _ => bail!("unknown preset {name:?} (tiny, 350m, 1b or 3b)"),
        })
    }

    /// The name of the preset this configuration is (`tiny`, `350m`, `1b`, `3b`).
    pub fn preset_name(&self) -> Option<&'static str> {
        ["tiny", "350m", "1b", "3b"]
            .into_iter()
            .find(|n| Self::preset(n).is_ok_and(|p| &p == self))
    }

    /// The `config.json` fields in which `self` and `other` differ, each as
    /// `"field: <self's value> vs <other's>"` (empty when they are equal).
    pub fn differences(&self, other: &Self) -> Result<Vec<String>> {
        let a = serde_json::to_value(self).map_err(candle_core::Error::wrap)?;
        let b = serde_json::to_value(other).map_err(candle_core::Error::wrap)?;
        let (Value::Object(a), Value::Object(b)) = (a, b) else {
            bail!("a LlamaConfig did not serialise to a JSON object")
        };
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        let show = |v: Option<&Value>| v.map_or("(none)".to_string(), Value::to_string);
        Ok(keys
            .into_iter()
            .filter(|k| a.get(*k) != b.get(*k))
            .map(|k| format!("{k}: {} vs {}", show(a.get(k)), show(b.get(k))))
            .collect())
    }

    /// Parses a `config.json` text and validates it.
    ///
    /// Reads the layouts of Hugging Face transformers 4.x (top-level `rope_theta`
    /// and `rope_scaling`) and 5.x (`rope_parameters`, `layer_types`); both give
    /// the same configuration. `model_type` must be `llama` (or absent),
    /// `mistral`, `qwen2` or `qwen3`. A field that would change the math and
    /// that this decoder does not implement is an error naming the field and
    /// its value; other unknown fields are ignored.
    pub fn from_json(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("invalid Llama config.json: {e}")))?;
        let Value::Object(mut o) = v else {
            bail!("invalid Llama config.json: expected a JSON object, got {v}")
        };
        hf_layout::normalize(&mut o)?;
        let cfg: Self = serde_json::from_value(Value::Object(o))
            .map_err(|e| candle_core::Error::Msg(format!("invalid Llama config.json: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and validates a `config.json` file.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| streamer_device::Error::Checkpoint {
                path: path.to_path_buf(),
                reason: format!("cannot read: {e}"),
            })?;
        Self::from_json(&text).map_err(|e| streamer_device::Error::prefixed(e, path.display()))
    }

    /// The configuration as `config.json` text (with `architectures` so
    /// Hugging Face tools recognise it, and Qwen's `use_sliding_window`).
    pub fn to_json(&self) -> Result<String> {
        let mut v = serde_json::to_value(self).map_err(candle_core::Error::wrap)?;
        if let Some(o) = v.as_object_mut() {
            let arch = match self.model_type.as_str() {
                "mistral" => "MistralForCausalLM",
                "qwen2" => "Qwen2ForCausalLM",
                "qwen3" => "Qwen3ForCausalLM",
                _ => "LlamaForCausalLM",
            };
            o.insert("architectures".into(), serde_json::json!([arch]));
            if self.is_qwen() {
                let on = self.sliding_window.is_some();
                o.insert("use_sliding_window".into(), serde_json::json!(on));
                // Every layer by `layer_types`: max_window_layers plays no part.
                o.insert("max_window_layers".into(), serde_json::json!(0));
            }
        }
        serde_json::to_string_pretty(&v).map_err(candle_core::Error::wrap)
    }

    fn is_qwen(&self) -> bool {
        self.model_type == "qwen2" || self.model_type == "qwen3"
    }

    /// Whether the q, k and v projections have biases (Qwen2, or `attention_bias`).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.model_type == "qwen2"
    }

    /// Whether the output projection has a bias (`attention_bias`).
    pub fn o_bias(&self) -> bool {
        self.attention_bias
    }

    /// Whether each query and key head is RMS-normalised before the rotary
    /// embedding (`q_norm`, `k_norm` of shape `(head_dim,)`: Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    /// The attention window of layer `i` (keys a query sees, itself included),
    /// `None` for dense attention.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match self.layer_types.get(i).map(String::as_str) {
            None | Some("sliding_attention") => Some(w),
            Some(_) => None,
        }
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Head dimension.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rejects configurations this decoder cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        self.validate_sizes()?;
        self.validate_heads()?;
        self.validate_eps_and_theta()?;
        self.validate_family()?;
        self.validate_mlp()?;
        self.validate_rope_scaling()
    }

    /// Every size is positive and within this decoder's limits.
    fn validate_sizes(&self) -> Result<()> {
        // Upper bounds far above any published model (Llama 3.1 405B: hidden
        // 16384, intermediate 53248, 126 layers, 128 heads, vocabulary 128256)
        // so that a corrupt file is an error here, not an hours-long
        // `weight_shapes` or an overflowing `num_params`.
        for (field, v, max) in [
            ("hidden_size", self.hidden_size, 1 << 17),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 12),
            ("num_attention_heads", self.num_attention_heads, 1 << 12),
            ("num_key_value_heads", self.num_kv_heads(), 1 << 12),
            ("vocab_size", self.vocab_size, 1 << 22),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1 << 27,
            ),
        ] {
            if v == 0 {
                return Err(field_error(field, "must be positive, got 0"));
            }
            if v > max {
                return Err(field_error(
                    field,
                    format!("= {v} is beyond this decoder's limit of {max}"),
                ));
            }
        }
        Ok(())
    }

    /// The heads divide the hidden size and each other, and the head
    /// dimension is one the attention kernels and the rotary embedding take.
    fn validate_heads(&self) -> Result<()> {
        if self.head_dim.is_none() && self.hidden_size % self.num_attention_heads != 0 {
            return Err(field_error(
                "hidden_size",
                format!(
                    "= {} is not a multiple of num_attention_heads = {} (and no head_dim is given)",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        if self.num_attention_heads % self.num_kv_heads() != 0 {
            return Err(field_error(
                "num_attention_heads",
                format!(
                    "= {} is not a multiple of num_key_value_heads = {}",
                    self.num_attention_heads,
                    self.num_kv_heads()
                ),
            ));
        }
        let d = self.head_dim();
        if d == 0 || d % 2 == 1 || d > cqsa::MAX_HEAD_DIM {
            return Err(field_error(
                "head_dim",
                format!(
                    "(head dimension {d}, or hidden_size / num_attention_heads) must be even \
                     and at most {}",
                    cqsa::MAX_HEAD_DIM
                ),
            ));
        }
        Ok(())
    }

    /// The norm's epsilon and the rotary base are usable numbers (not NaN:
    /// every comparison with NaN is false, so it is checked first).
    fn validate_eps_and_theta(&self) -> Result<()> {
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(field_error(
                "rms_norm_eps",
                format!("must be positive, got {}", self.rms_norm_eps),
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 1.0 {
            return Err(field_error(
                "rope_theta",
                format!("must be above 1, got {}", self.rope_theta),
            ));
        }
        Ok(())
    }

    /// The MLP is the one this decoder implements: no biases, SiLU.
    fn validate_mlp(&self) -> Result<()> {
        if self.mlp_bias {
            return Err(field_error(
                "mlp_bias",
                "= true is not supported (no MLP biases yet)",
            ));
        }
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(field_error(
                    "hidden_act",
                    format!("= {act:?} is not supported (only \"silu\")"),
                ));
            }
        }
        Ok(())
    }

    /// The rotary scaling, if any, is of a supported kind with usable factors.
    fn validate_rope_scaling(&self) -> Result<()> {
        if let Some(s) = &self.rope_scaling {
            if !["llama3", "linear", "default"].contains(&s.rope_type.as_str()) {
                return Err(field_error(
                    "rope_scaling.rope_type",
                    format!(
                        "= {:?} is not supported (\"default\", \"linear\" or \"llama3\")",
                        s.rope_type
                    ),
                ));
            }
            if s.factor.is_nan()
                || s.factor <= 0.0
                || (s.rope_type == "llama3"
                    && s.high_freq_factor.partial_cmp(&s.low_freq_factor)
                        != Some(std::cmp::Ordering::Greater))
            {
                return Err(field_error("rope_scaling", format!("needs factor > 0 (and for llama3 high_freq_factor > low_freq_factor), got {s:?}")));
            }
        }
        Ok(())
    }

    /// The family and the fields that depend on it: `model_type`, biases a
    /// family has none of, the sliding window and `layer_types`.
    fn validate_family(&self) -> Result<()> {
        if !MODEL_TYPES.contains(&self.model_type.as_str()) {
            return Err(field_error(
                "model_type",
                format!(
                    "= {:?} is not supported (one of {MODEL_TYPES:?})",
                    self.model_type
                ),
            ));
        }
        if self.attention_bias && (self.model_type == "mistral" || self.model_type == "qwen2") {
            return Err(field_error(
                "attention_bias",
                format!(
                    "= true is not supported for model_type {:?} (its \
                 attention biases are fixed by the family)",
                    self.model_type
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(field_error(
                "sliding_window",
                "must be positive or null, got 0",
            ));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_hidden_layers {
            return Err(field_error(
                "layer_types",
                format!(
                    "has {} entries but num_hidden_layers = {}",
                    self.layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        for (i, t) in self.layer_types.iter().enumerate() {
            if t != "full_attention" && t != "sliding_attention" {
                return Err(field_error(
                    format!("layer_types[{i}]"),
                    format!(
                        "= {t:?} is not supported (\"full_attention\" or \"sliding_attention\")"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The rotary inverse frequencies, `head_dim / 2` of them, with
    /// `rope_scaling` applied.
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim();
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        match &self.rope_scaling {
            Some(s) if s.rope_type == "llama3" => {
                let old = s.original_max_position_embeddings as f64;
                let low_wavelen = old / s.low_freq_factor;
                let high_wavelen = old / s.high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / s.factor
                        } else {
                            let smooth = (old / wavelen - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    })
                    .collect()
            }
            Some(s) if s.rope_type == "linear" => base.into_iter().map(|f| f / s.factor).collect(),
            _ => base,
        }
    }

    /// The weights of layer `i`: `(name, shape, config fields the shape comes from)`.
    pub fn layer_weights(&self, i: usize) -> Vec<(String, Vec<usize>, &'static str)> {
        let (h, m) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_kv_heads() * self.head_dim();
        let p = format!("model.layers.{i}");
        let attn = "hidden_size, num_attention_heads, head_dim";
        let kv_f = "hidden_size, num_key_value_heads, head_dim";
        let mlp = "hidden_size, intermediate_size";
        let norm = |name: &str| (format!("{p}.{name}.weight"), vec![h], "hidden_size");
        let mut w = vec![
            norm("input_layernorm"),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h], attn),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], kv_f),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], kv_f),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q], attn),
        ];
        if self.qkv_bias() {
            let why = "model_type or attention_bias";
            w.push((format!("{p}.self_attn.q_proj.bias"), vec![q], why));
            w.push((format!("{p}.self_attn.k_proj.bias"), vec![kv], why));
            w.push((format!("{p}.self_attn.v_proj.bias"), vec![kv], why));
        }
        if self.o_bias() {
            w.push((
                format!("{p}.self_attn.o_proj.bias"),
                vec![h],
                "attention_bias",
            ));
        }
        if self.qk_norm() {
            let why = "model_type qwen3, head_dim";
            let d = self.head_dim();
            w.push((format!("{p}.self_attn.q_norm.weight"), vec![d], why));
            w.push((format!("{p}.self_attn.k_norm.weight"), vec![d], why));
        }
        w.extend([
            norm("post_attention_layernorm"),
            (format!("{p}.mlp.gate_proj.weight"), vec![m, h], mlp),
            (format!("{p}.mlp.up_proj.weight"), vec![m, h], mlp),
            (format!("{p}.mlp.down_proj.weight"), vec![h, m], mlp),
        ]);
        w
    }

    /// The weights outside the layers: embedding, final norm and (unless tied) head.
    pub fn outer_weights(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut w = vec![
            (
                "model.embed_tokens.weight".to_string(),
                vec![v, h],
                "vocab_size, hidden_size",
            ),
            ("model.norm.weight".to_string(), vec![h], "hidden_size"),
        ];
        if !self.tie_word_embeddings {
            w.push((
                "lm_head.weight".to_string(),
                vec![v, h],
                "vocab_size, hidden_size",
            ));
        }
        w
    }

    /// Every weight the configuration implies, in Hugging Face's names.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>, &'static str)> {
        let mut w = self.outer_weights();
        for i in 0..self.num_hidden_layers {
            w.extend(self.layer_weights(i));
        }
        w
    }

    /// Parameters of one decoder layer.
    pub fn layer_params(&self) -> usize {
        self.layer_weights(0)
            .iter()
            .map(|(_, s, _)| s.iter().product::<usize>())
            .sum()
    }

    /// Parameters of the whole model (a tied matrix counted once).
    pub fn num_params(&self) -> usize {
        self.weight_shapes()
            .iter()
            .map(|(_, s, _)| s.iter().product::<usize>())
            .sum()
    }

    /// Parameters outside the decoder layers: the embedding, the final norm
    /// and an untied head.
    pub fn outer_params(&self) -> usize {
        self.num_params() - self.layer_params() * self.num_hidden_layers
    }
}

/// Reading the `config.json` layouts of Hugging Face transformers 4.x and 5.x
/// into the one layout [`LlamaConfig`] deserialises (top-level `rope_theta` and
/// `rope_scaling`), refusing every field whose math this decoder lacks.
mod hf_layout {
    use super::{field_error, RopeScaling};
    use candle_core::Result;
    use serde_json::{Map, Value};

    type Obj = Map<String, Value>;

    /// transformers' default `sliding_window` for Mistral when the file has none.
    const MISTRAL_DEFAULT_WINDOW: u64 = 4096;
    /// transformers' default `head_dim` for Qwen3 when the file has none.
    const QWEN3_DEFAULT_HEAD_DIM: u64 = 128;
    /// transformers' default `max_window_layers` for Qwen2 and Qwen3.
    const QWEN_DEFAULT_MAX_WINDOW_LAYERS: u64 = 28;

    /// Checks the model family and the fields that change the math, fills the
    /// family's defaults that differ from Llama's, reads the sliding window
    /// into `sliding_window` and `layer_types`, and rewrites a 5.x
    /// `rope_parameters` (or a 4.x `rope_scaling`) into `rope_theta` plus a
    /// normalised `rope_scaling`.
    pub(super) fn normalize(o: &mut Obj) -> Result<()> {
        let family = model_type(o)?;
        if family == "qwen3" && o.get("head_dim").is_none_or(Value::is_null) {
            o.insert("head_dim".into(), Value::from(QWEN3_DEFAULT_HEAD_DIM));
        }
        let window = sliding_window(o, &family)?;
        let types = layer_types(o, &family, window)?;
        o.insert("model_type".into(), Value::from(family));
        o.insert(
            "sliding_window".into(),
            window.map_or(Value::Null, Value::from),
        );
        o.insert("layer_types".into(), Value::from(types));
        check_zero(o, "attention_dropout")?;
        normalize_rope(o)
    }

    /// The family: `llama` (also when absent), `mistral`, `qwen2` or `qwen3`.
    fn model_type(o: &Obj) -> Result<String> {
        match o.get("model_type") {
            None | Some(Value::Null) => Ok("llama".into()),
            Some(Value::String(t)) if super::MODEL_TYPES.contains(&t.as_str()) => Ok(t.clone()),
            Some(t) => Err(field_error(
                "model_type",
                format!("= {t} is not supported (one of {:?})", super::MODEL_TYPES),
            )),
        }
    }

    fn is_qwen(family: &str) -> bool {
        family == "qwen2" || family == "qwen3"
    }

    /// The attention window as transformers reads it: Mistral's defaults to
    /// 4096 when absent; Qwen's counts only with `use_sliding_window: true`
    /// (its default is false); `null` is dense attention.
    fn sliding_window(o: &Obj, family: &str) -> Result<Option<u64>> {
        let w = match o.get("sliding_window") {
            None if family == "mistral" => Some(MISTRAL_DEFAULT_WINDOW),
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(w) if w > 0 => Some(w),
                _ => {
                    return Err(field_error(
                        "sliding_window",
                        format!("= {v} is not a positive integer or null"),
                    ))
                }
            },
        };
        if !is_qwen(family) {
            return Ok(w);
        }
        match o.get("use_sliding_window") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            Some(Value::Bool(true)) => Ok(w),
            Some(v) => Err(field_error(
                "use_sliding_window",
                format!("= {v} is not a boolean"),
            )),
        }
    }

    /// Each layer's attention type: the file's `layer_types` (5.x), checked; for
    /// Qwen 4.x files with a window, layers from `max_window_layers` on slide;
    /// empty (every layer alike) otherwise, and always without a window.
    fn layer_types(o: &Obj, family: &str, window: Option<u64>) -> Result<Vec<String>> {
        let layers = o.get("num_hidden_layers").and_then(Value::as_u64);
        let types: Vec<String> = match o.get("layer_types") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(types)) => {
                if let Some(n) = layers.filter(|n| types.len() as u64 != *n) {
                    return Err(field_error(
                        "layer_types",
                        format!("has {} entries but num_hidden_layers = {n}", types.len()),
                    ));
                }
                let mut out = Vec::with_capacity(types.len());
                for (i, t) in types.iter().enumerate() {
                    match t.as_str() {
                        Some(s @ ("full_attention" | "sliding_attention")) => {
                            out.push(s.to_string())
                        }
                        _ => {
                            return Err(field_error(
                                format!("layer_types[{i}]"),
                                format!(
                                    "= {t} is not supported \
                             (\"full_attention\" or \"sliding_attention\")"
                                ),
                            ))
                        }
                    }
                }
                out
            }
            Some(v) => return Err(field_error("layer_types", format!("= {v} is not a list"))),
        };
        if window.is_none() {
            return Ok(Vec::new());
        }
        if types.is_empty() && is_qwen(family) {
            let first = match o.get("max_window_layers") {
                None | Some(Value::Null) => QWEN_DEFAULT_MAX_WINDOW_LAYERS,
                Some(v) => v.as_u64().ok_or_else(|| {
                    field_error(
                        "max_window_layers",
                        format!("= {v} is not a non-negative integer"),
                    )
                })?,
            };
            let n = layers.unwrap_or(0);
            return Ok((0..n)
                .map(|i| {
                    if i >= first {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .map(String::from)
                .collect());
        }
        Ok(types)
    }

    /// A numeric field that must be 0 when present (the decoder has no such term).
    fn check_zero(o: &Obj, field: &str) -> Result<()> {
        match o.get(field) {
            None | Some(Value::Null) => Ok(()),
            Some(v) if v.as_f64() == Some(0.0) => Ok(()),
            Some(v) => Err(field_error(
                field,
                format!("= {v} is not supported (must be 0)"),
            )),
        }
    }

    /// A number field of a rope object, `None` when absent.
    fn number(r: &Obj, field: &str, key: &str) -> Result<Option<f64>> {
        match r.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(field_error(
                    format!("{field}.{key}"),
                    format!("= {v} is not a finite number"),
                )),
            },
        }
    }

    /// The rotary scaling a rope object describes (4.x `rope_scaling` or 5.x
    /// `rope_parameters`, named by `field` in errors): `None` for `default`.
    pub(super) fn parse_rope(field: &str, r: &Obj) -> Result<Option<RopeScaling>> {
        let ty = match (r.get("rope_type"), r.get("type")) {
            (Some(a), Some(b)) if a != b => {
                return Err(field_error(
                    format!("{field}.rope_type"),
                    format!("= {a} disagrees with its type = {b}"),
                ));
            }
            (Some(t), _) | (None, Some(t)) => match t.as_str() {
                Some(s) => s.to_string(),
                None => {
                    return Err(field_error(
                        format!("{field}.rope_type"),
                        format!("= {t} is not a string"),
                    ))
                }
            },
            (None, None) => "default".to_string(),
        };
        if let Some(p) = number(r, field, "partial_rotary_factor")? {
            if p != 1.0 {
                return Err(field_error(
                    format!("{field}.partial_rotary_factor"),
                    format!("= {p} is not supported (must be 1)"),
                ));
            }
        }
        match ty.as_str() {
            "default" => Ok(None),
            "linear" => Ok(Some(RopeScaling {
                rope_type: ty,
                factor: number(r, field, "factor")?.unwrap_or(1.0),
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: super::default_original_max(),
            })),
            "llama3" => {
                let orig = match r.get("original_max_position_embeddings") {
                    None | Some(Value::Null) => super::default_original_max(),
                    Some(v) => match v.as_u64() {
                        Some(n) => n as usize,
                        None => {
                            return Err(field_error(
                                format!("{field}.original_max_position_embeddings"),
                                format!("= {v} is not a non-negative integer"),
                            ))
                        }
                    },
                };
                Ok(Some(RopeScaling {
                    rope_type: ty,
                    factor: number(r, field, "factor")?.unwrap_or(1.0),
                    low_freq_factor: number(r, field, "low_freq_factor")?.unwrap_or(1.0),
                    high_freq_factor: number(r, field, "high_freq_factor")?.unwrap_or(4.0),
                    original_max_position_embeddings: orig,
                }))
            }
            other => Err(field_error(
                format!("{field}.rope_type"),
                format!("= {other:?} is not supported (\"default\", \"linear\" or \"llama3\")"),
            )),
        }
    }

    /// 5.x may key `rope_parameters` by layer type (`{"full_attention": {...}}`);
    /// with one rope for every layer type that is the rope, otherwise an error.
    fn single_rope(rp: Obj) -> Result<Obj> {
        let nested = !rp.is_empty() && rp.values().all(Value::is_object);
        if !nested {
            return Ok(rp);
        }
        let mut it = rp.iter();
        let Some((first_key, first)) = it.next() else {
            return Ok(rp);
        };
        for (k, v) in it {
            if v != first {
                return Err(field_error(
                    "rope_parameters",
                    format!(
                        "gives layer types {first_key:?} and {k:?} different \
                     rotary embeddings ({first} vs {v}); per-layer-type ropes are not supported"
                    ),
                ));
            }
        }
        match first {
            Value::Object(o) => Ok(o.clone()),
            _ => Ok(rp),
        }
    }

    /// Writes `rope_theta` and `rope_scaling` from `rope_parameters` (5.x) or
    /// from the 4.x fields, after checking that the two layouts, when both are
    /// present, agree.
    fn normalize_rope(o: &mut Obj) -> Result<()> {
        let top_theta = number(o, "config", "rope_theta")?;
        let top_scaling = match o.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(Value::Object(r)) => parse_rope("rope_scaling", r)?,
            Some(v) => {
                return Err(field_error(
                    "rope_scaling",
                    format!("= {v} is not an object or null"),
                ))
            }
        };
        let (theta, scaling) = match o.remove("rope_parameters") {
            None | Some(Value::Null) => (top_theta, top_scaling),
            Some(Value::Object(rp)) => {
                let rp = single_rope(rp)?;
                let theta = number(&rp, "rope_parameters", "rope_theta")?;
                let scaling = parse_rope("rope_parameters", &rp)?;
                if let (Some(a), Some(b)) = (top_theta, theta) {
                    if a != b {
                        return Err(field_error(
                            "rope_parameters.rope_theta",
                            format!("= {b} disagrees with rope_theta = {a}"),
                        ));
                    }
                }
                if o.get("rope_scaling").is_some_and(|v| !v.is_null()) && top_scaling != scaling {
                    return Err(field_error(
                        "rope_parameters",
                        format!("= {scaling:?} disagrees with rope_scaling = {top_scaling:?}"),
                    ));
                }
                (theta.or(top_theta), scaling)
            }
            Some(v) => {
                return Err(field_error(
                    "rope_parameters",
                    format!("= {v} is not an object or null"),
                ))
            }
        };
        o.remove("rope_theta");
        if let Some(t) = theta {
            o.insert("rope_theta".into(), Value::from(t));
        }
        let scaling = match scaling {
            Some(s) => serde_json::to_value(s).map_err(candle_core::Error::wrap)?,
            None => Value::Null,
        };
        o.insert("rope_scaling".into(), scaling);
        Ok(())
    }
}

/// A decoder layer's weight name `model.layers.{i}.{local}` split into
/// `(i, local)`; `None` for any other name.
pub(crate) fn split_layer_name(name: &str) -> Option<(usize, &str)> {
    let (i, local) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((i.parse().ok()?, local))
}
