//! `streamer-models`: model definitions written the ordinary Candle way
//! (candle-nn layers over a `VarBuilder`, Hugging Face weight names) that run
//! resident or with their layers streamed from host memory.
//!
//! - [`Llama`] ([`llama`]): a Llama-family decoder: token embedding, RMSNorm,
//!   rotary embedding, grouped-query attention through `cqsa::attention`,
//!   SwiGLU MLP, final norm, tied or untied head. Each [`DecoderLayer`] is a
//!   `streamer_core::Block` taking `[cos, sin]` as extras, so the same layer
//!   code runs in a plain loop ([`Llama::resident`]) or as `StreamedSequential`
//!   blocks ([`Llama::streamed`], [`Llama::from_safetensors`]), trainable with
//!   [`Llama::into_trainable`].
//! - [`LlamaConfig`] ([`config`]): Hugging Face's `config.json` fields, presets
//!   `tiny`, `350m`, `1b`, `3b`.
//! - [`check_weights`], [`init_weights`] ([`checkpoint`]): strict checks of a
//!   checkpoint against a config (the error names the tensor and the config
//!   fields), seeded initial weights, byte budgets.
//! - [`Llama::from_pretrained`] ([`pretrained`]) and [`TextTokenizer`]
//!   ([`tokenizer`]): a Hugging Face model folder (`config.json`, weights,
//!   `tokenizer.json`) checked as a whole, then placed resident or streamed.
//! - [`QuantizationConfig`] ([`quantization_config`]), [`read_quantized`]
//!   ([`quantized_checkpoint`]) and [`save_bnb`] ([`bnb_save`]):
//!   transformers checkpoints with a `quantization_config` (bitsandbytes
//!   4-bit and 8-bit, fp8) read into `streamer_quant` host tensors by Hugging
//!   Face weight name, checked against a config ([`QuantizedCheckpoint::check`]),
//!   made from dense weights ([`QuantizedCheckpoint::quantize`],
//!   [`quantize_checkpoint`]) and written in bitsandbytes' layout.
//! - [`LmTrainer`], [`train_loop`], [`TokenCorpus`] ([`train`]): host AdamW over
//!   every master, checkpoints an interrupted save cannot break, resume.
//! - [`generate`] ([`sample`]): temperature and top-p sampling, feeding one token
//!   per step through the model's kv cache ([`Llama::forward_cached`]).
//! - [`FusedLinear`] ([`fused_linear`](mod@fused_linear)) and [`ops::fused`]: `Linear` with its bias
//!   and GELU in the GEMM's epilogue; RMSNorm and the rotary embedding through
//!   candle-nn's fused kernels with a backward of their own. [`FusedMlp`]
//!   ([`fused_mlp`](mod@fused_mlp)): the GELU MLP block whose streamed training backward is
//!   four cuBLASLt GEMMs with GELU' and the bias gradients in their epilogues.
//! - [`DevicePlan`] ([`device_plan`]) and [`MlpPlan`] ([`mlp_plan`]): what a
//!   streamed training step of a decoder or of `FusedMlp` blocks holds on the
//!   GPU, and the fastest settings whose step fits a device budget.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use streamer_core::StreamConfig;
//! use streamer_models::{init_weights, Llama, LlamaConfig};
//!
//! let cfg = LlamaConfig { max_position_embeddings: 16, ..LlamaConfig::bytes(32, 2, 4, 2) };
//! let weights = init_weights(&cfg, 0)?;
//! // Resident: the ordinary Candle way.
//! let vb = candle_nn::VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
//! let resident = Llama::resident(vb, &cfg)?;
//! // Streamed: at most two layers' weights on the device at a time.
//! let stream = StreamConfig { prefetch_ahead: 1, ..Default::default() };
//! let streamed = Llama::from_tensors(weights, &cfg, stream)?;
//! let tokens = Tensor::new(&[[72u32, 105, 33, 10]], &Device::Cpu)?;
//! let (a, b) = (resident.forward(&tokens)?, streamed.forward(&tokens)?);
//! assert_eq!(a.dims(), &[1, 4, 256]);
//! assert!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-4);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod batch_generate;
mod batch_kv;
pub mod batch_plan;
mod bnb_layout;
pub mod bnb_save;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
mod config_fields;
pub mod cross_entropy;
mod decoder_backward;
mod dequant_backend;
pub mod device_plan;
pub mod embedding;
mod fp8_config;
pub mod fused_linear;
pub mod fused_mlp;
mod host_kv;
pub mod host_plan;
mod host_rows;
mod kv_cache;
pub mod llama;
pub mod lora;
pub mod lora_plan;
mod lora_step;
pub mod mlp_plan;
pub mod ops;
mod outer_host;
pub mod pretrained;
pub mod prompt_file;
pub mod quantization_config;
pub mod quantize_checkpoint;
pub mod quantized_checkpoint;
pub mod quantized_weights;
mod resident_backward;
pub mod sample;
pub mod step_rates;
mod step_shape;
pub mod tokenizer;
pub mod train;

pub use batch_generate::{
    generate_batch, BatchLimits, BatchOutput, BatchRequest, BatchSink, Finish, Generated,
    DEFAULT_STEP_ROWS,
};
pub use batch_plan::{
    kv_bytes_per_sequence, plan_batch, request_flops, sequences_for_budget, BatchMemory,
    BatchPlacement, BatchPlan, BatchRun, BatchShape, DecodeRates, LayerFootprint, PlacementChoice,
    STEP_COMPUTE_SHARE,
};
pub use bnb_save::save_bnb;
pub use chat_template::{ChatMessage, ChatTemplate};
pub use checkpoint::{
    check_weights, init_weights, init_weights_where, parse_bytes, prefetch_for_budget,
    split_for_budget, SplitMix64,
};
pub use config::{LlamaConfig, RopeScaling};
pub use cross_entropy::cross_entropy;
pub use device_plan::{DevicePlan, Expectation, PlanChoices, PlanLimits, StepSettings};
pub use embedding::embedding;
pub use fp8_config::Fp8Layout;
pub use fused_linear::{fused_linear, Epilogue, FusedLinear};
pub use fused_mlp::{fused_mlp, FusedMlp};
pub use host_plan::{streamed_masters_bytes, HostPlan, TrainSetup};
pub use llama::{apply_rope, apply_rope_unfused, DecoderLayer, Llama, LossChunk, RmsNorm, Rope};
pub use lora::{LoraAdapters, LoraConfig, LORA_TARGETS};
pub use lora_plan::{LoraPlan, LoraStep};
pub use mlp_plan::{MlpPlan, MlpSettings, MlpShape};
#[cfg(feature = "cuda")]
pub use ops::lt::epilogue_fallbacks;
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use ops::lt::{
    cached_handles as cached_cublaslt_handles, handle_probe as cublaslt_handle_probe,
};
pub use quantization_config::{QuantMethod, QuantizationConfig};
pub use quantized_checkpoint::{read_quantized, QuantizedCheckpoint};
pub use step_rates::StepRates;
pub use step_shape::StepShape;
/// The raw cuBLASLt GEMMs behind `FusedLinear` and `FusedMlp`, for
/// `benches/gemm.rs` (which times each against cuBLAS and PyTorch).
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub mod lt_probe {
    pub use crate::ops::lt::{input_grad, linear, weight_grad};
}
pub use pretrained::{Placement, Pretrained, PretrainedFiles};
pub use quantized_weights::{is_quantizable, QuantizedWeights, QUANTIZABLE};
pub use sample::{generate, sample_rows, sample_token, Sampling};
/// Where [`LmTrainer`]'s AdamW runs (re-exported from streamer-autograd).
pub use streamer_autograd::{OptimizerPlace, StateDtype};
pub use tokenizer::TextTokenizer;
pub use train::{
    train_loop, ByteCorpus, CheckpointFiles, Decay, LmTrainer, LoopOptions, LrSchedule, StepReport,
    TokenCorpus,
};
