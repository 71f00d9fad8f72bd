//! A Hugging Face model folder as the unit: `config.json`, `model.safetensors`
//! (or `model.safetensors.index.json` and its shards) and, when the folder
//! has one, `tokenizer.json`, checked against each other before any weight is
//! loaded. Weights-only folders (a base whose tokenizer lives elsewhere) load
//! without a tokenizer.
use crate::checkpoint::{check_weights, layer_bytes, prefetch_for_budget, split_for_budget};
use crate::config::LlamaConfig;
use crate::llama::Llama;
use crate::quantization_config::QuantizationConfig;
use crate::quantized_checkpoint::read_quantized;
use crate::quantized_weights::QuantizedWeights;
use crate::tokenizer::TextTokenizer;
use candle_core::{bail, DType, Device, Result};
use std::path::{Path, PathBuf};
use streamer_core::{StreamConfig, WeightSource};

/// Where [`Llama::from_pretrained`] puts the model.
#[derive(Clone, Debug)]
pub enum Placement {
    /// Every weight on `device` in `dtype` ([`Llama::load_resident`]).
    Resident {
        /// Compute device.
        device: Device,
        /// Compute dtype (the checkpoint's values converted).
        dtype: DType,
    },
    /// Layers streamed from host masters as `StreamConfig` says
    /// ([`Llama::from_safetensors`]).
    Streamed(StreamConfig),
    /// The first `resident_layers` decoder layers on `stream.device`, the
    /// rest streamed as `stream` says ([`Llama::streamed_keeping`];
    /// inference only).
    Split {
        /// The streamed layers' settings (and the device and dtype of all).
        stream: StreamConfig,
        /// Decoder layers kept on the device, from the first.
        resident_layers: usize,
    },
    /// Resident when the decoder layers' weights fit in `budget` bytes of
    /// device memory, otherwise the first layers resident and the rest
    /// streamed through a window of two
    /// ([`crate::checkpoint::split_for_budget`]), their host masters in the
    /// compute dtype (a bf16 step copies bf16, not f32 staged for a cast).
    /// For inference: a model with resident layers does not train
    /// ([`Llama::into_trainable`]; a trainer loads [`Placement::Streamed`]
    /// with the master dtype it wants).
    Budget {
        /// Compute device.
        device: Device,
        /// Compute dtype.
        dtype: DType,
        /// Device bytes for decoder-layer weights.
        budget: usize,
    },
    /// Streamed as `stream` says, every linear weight of the decoder layers
    /// quantized on load with `scheme`, one tensor at a time
    /// ([`Llama::streamed_quantize_on_load`]):
    /// a frozen base for LoRA adapters, or for inference.
    Quantized {
        /// The streaming settings.
        stream: StreamConfig,
        /// How the linear weights are quantized.
        scheme: streamer_quant::QuantScheme,
    },
}

/// The files of a Hugging Face model folder.
#[derive(Clone, Debug)]
pub struct PretrainedFiles {
    /// `config.json`.
    pub config: PathBuf,
    /// `model.safetensors` or `model.safetensors.index.json`.
    pub weights: PathBuf,
    /// `tokenizer.json`, when the folder has one.
    pub tokenizer: Option<PathBuf>,
}

impl PretrainedFiles {
    /// The files of `dir`; a missing `config.json` or weights file is an error
    /// naming what was looked for. A folder without `tokenizer.json` has none.
    pub fn in_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            bail!("{}: not a model folder (no such directory)", dir.display());
        }
        let config = dir.join("config.json");
        if !config.is_file() {
            bail!(
                "{}: no such file (a model folder needs its config.json)",
                config.display()
            );
        }
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let weights = if single.is_file() {
            single
        } else if index.is_file() {
            index
        } else {
            bail!(
                "{}: no weights (neither model.safetensors nor model.safetensors.index.json)",
                dir.display()
            )
        };
        let tokenizer = dir.join("tokenizer.json");
        Ok(Self {
            config,
            weights,
            tokenizer: tokenizer.is_file().then_some(tokenizer),
        })
    }
}

/// A model folder loaded by [`Llama::from_pretrained`].
#[derive(Debug)]
pub struct Pretrained {
    /// The model, placed as asked.
    pub model: Llama,
    /// Its tokenizer (`None` for a folder without `tokenizer.json`).
    pub tokenizer: Option<TextTokenizer>,
    /// `eos_token_id` of `config.json` (the first, when it is a list).
    pub eos_token_id: Option<u32>,
    /// The files read.
    pub files: PretrainedFiles,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("model_type", &self.config().model_type)
            .field("layers", &self.config().num_hidden_layers)
            .field("streamed", &self.is_streamed())
            .finish()
    }
}

/// `eos_token_id` of a `config.json` text: a number or a list of numbers.
fn eos_token_id(config_text: &str) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_str(config_text).ok()?;
    let e = v.get("eos_token_id")?;
    let first = e.as_array().and_then(|a| a.first()).unwrap_or(e);
    first.as_u64().and_then(|n| u32::try_from(n).ok())
}

impl Llama {
    /// Loads a Hugging Face model folder: `config.json`, the weights
    /// (`model.safetensors` or the sharded index) and `tokenizer.json` when
    /// there is one, placed as `placement` says. Everything is checked before
    /// any weight is loaded: the config's fields, the tokenizer's ids against
    /// `vocab_size` (an error naming both files and sizes), and every tensor's
    /// name and shape.
    pub fn from_pretrained(dir: impl AsRef<Path>, placement: Placement) -> Result<Pretrained> {
        let files = PretrainedFiles::in_dir(dir)?;
        let text = std::fs::read_to_string(&files.config).map_err(|e| {
            candle_core::Error::Msg(format!("cannot read {}: {e}", files.config.display()))
        })?;
        let cfg = LlamaConfig::from_json(&text)
            .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", files.config.display())))?;
        let tokenizer = match &files.tokenizer {
            Some(path) => {
                let t = TextTokenizer::from_file(path)?;
                t.check_vocab(&cfg, &files.config)?;
                Some(t)
            }
            None => None,
        };
        let model = match QuantizationConfig::from_config_json(&text)? {
            Some(qc) => place_quantized(&files.weights, &cfg, &qc, placement)?,
            None => {
                let src = WeightSource::safetensors(&[&files.weights])?;
                check_weights(&src, &cfg).map_err(|e| {
                    candle_core::Error::Msg(format!("{}: {e}", files.weights.display()))
                })?;
                place(&files.weights, &cfg, placement)?
            }
        };
        Ok(Pretrained {
            model,
            tokenizer,
            eos_token_id: eos_token_id(&text),
            files,
        })
    }
}

fn place(weights: &Path, cfg: &LlamaConfig, placement: Placement) -> Result<Llama> {
    match placement {
        Placement::Resident { device, dtype } => {
            Llama::load_resident(&[weights], cfg, dtype, &device)
        }
        Placement::Streamed(stream) => Llama::from_safetensors(&[weights], cfg, stream),
        Placement::Split {
            stream,
            resident_layers,
        } => {
            // Checked against the config by `from_pretrained` already.
            let src = WeightSource::safetensors(&[weights])?;
            Llama::streamed_keeping(&src, cfg, stream, resident_layers)
        }
        Placement::Budget {
            device,
            dtype,
            budget,
        } => {
            if layer_bytes(cfg, dtype) * cfg.num_hidden_layers <= budget {
                return Llama::load_resident(&[weights], cfg, dtype, &device);
            }
            let (prefetch_ahead, keep) = split_for_budget(cfg, dtype, budget)?;
            let stream = StreamConfig {
                device,
                prefetch_ahead,
                dtype,
                ..Default::default()
            };
            // Checked against the config by `from_pretrained` already.
            Llama::streamed_keeping(&WeightSource::safetensors(&[weights])?, cfg, stream, keep)
        }
        Placement::Quantized { stream, scheme } => Llama::streamed_quantize_on_load(
            &WeightSource::safetensors(&[weights])?,
            scheme,
            cfg,
            stream,
        ),
    }
}

/// A folder whose `config.json` has a `quantization_config` (bitsandbytes
/// 4-bit or 8-bit, fp8): its quantized weights become the packed masters of
/// a streamed model ([`Llama::streamed_quantized`]), the rest loads dense.
/// Such a model streams: a resident placement, or quantizing it again, is an
/// error naming the field.
fn place_quantized(
    weights: &Path,
    cfg: &LlamaConfig,
    qc: &QuantizationConfig,
    placement: Placement,
) -> Result<Llama> {
    let stream = match placement {
        Placement::Streamed(stream) => stream,
        Placement::Budget {
            device,
            dtype,
            budget,
        } => StreamConfig {
            device,
            // Dense layer sizes: the packed layers are smaller, so the window fits.
            prefetch_ahead: prefetch_for_budget(cfg, dtype, budget)?,
            dtype,
            master_dtype: Some(dtype),
            ..Default::default()
        },
        Placement::Resident { .. } => {
            return Err(quantized_placement(
                "a resident placement (quantized weights stream)",
            ))
        }
        Placement::Split { .. } => {
            return Err(quantized_placement(
                "keeping layers resident (quantized weights stream)",
            ))
        }
        Placement::Quantized { .. } => {
            return Err(quantized_placement("quantizing again on load (--quantize)"))
        }
    };
    let ckpt = read_quantized(&[weights], qc)?;
    ckpt.check(cfg)?;
    let quant = QuantizedWeights::from_host(ckpt.quantized)?;
    Llama::streamed_quantized(&WeightSource::Tensors(ckpt.dense), &quant, cfg, stream)
}

pub(crate) fn quantized_placement(what: &str) -> candle_core::Error {
    streamer_device::Error::Config {
        field: "quantization_config".into(),
        reason: format!("the folder is already quantized; {what} is not supported"),
    }
    .into()
}
