//! Sample text from a Llama-style checkpoint with temperature and top-p, byte-level.
//!
//!     cargo run --release --example generate -- --checkpoint runs/train_lm/checkpoint
//!     cargo run --release --example generate -- --weights model.safetensors --config config.json --streamed
//!     cargo run --release --features cuda --example generate -- --checkpoint runs/3b/checkpoint --gpu-weight-budget 4GiB
//!
//!     cargo run --release --example generate -- --preset 350m     # the untrained model (train_lm's seeded init)
//!
//! The model runs resident unless `--streamed` is given or its decoder layers'
//! weights exceed `--gpu-weight-budget`; then the layers stream from host memory
//! through a window of as many layers as the budget holds.
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use candle_streamer::cli;
use clap::Parser;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use streamer_core::StreamConfig;
use streamer_models::checkpoint::layer_bytes;
use streamer_models::{
    generate, init_weights, parse_bytes, prefetch_for_budget, ByteCorpus, CheckpointFiles, Llama,
    LlamaConfig,
};

#[derive(Parser, Debug)]
#[command(about = "Sample text from a Llama-style checkpoint (byte-level tokens)")]
struct Args {
    /// A folder written by train_lm (its checkpoint.json names the files).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Safetensors weights (or a model.safetensors.index.json); needs --config.
    #[arg(long, num_args = 1..)]
    weights: Vec<PathBuf>,
    /// No checkpoint: the freshly initialised model of a train_lm preset (tiny,
    /// 350m, 1b, 3b) with `--init-seed`, what train_lm starts from.
    #[arg(long)]
    preset: Option<String>,
    /// Seed of the initial weights with `--preset` (train_lm's `--seed`).
    #[arg(long, default_value_t = 0)]
    init_seed: u64,
    /// A Hugging Face Llama config.json (default: the checkpoint's).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Text to continue.
    #[arg(long, default_value = "Mr. Phileas Fogg")]
    prompt: String,
    /// Bytes to generate.
    #[arg(long, default_value_t = 300)]
    max_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stream the decoder layers from host memory even if they would fit.
    #[arg(long)]
    streamed: bool,
    /// Device memory for decoder-layer weights (bytes, "2GiB", "1.5G"); a model
    /// whose layers exceed it is streamed with as many layers as fit.
    #[arg(long)]
    gpu_weight_budget: Option<String>,
    /// Layers loaded ahead when streamed without a budget (default 1).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Compute dtype: f32, bf16 or f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    dtype: Option<String>,
    /// Device: cpu or cuda (default: cuda when built with it and present).
    #[arg(long)]
    device: Option<String>,
}

/// The flags that do not depend on the model, checked before anything loads.
fn check_args(a: &Args) -> Result<()> {
    cli::count("--max-tokens", a.max_tokens, 1 << 24)?;
    cli::non_negative("--temperature", a.temperature)?;
    cli::fraction("--top-p", a.top_p)?;
    if a.prompt.is_empty() {
        bail!("--prompt is empty: give at least one byte to continue");
    }
    if let Some(b) = &a.gpu_weight_budget {
        parse_bytes(b)?;
    }
    Ok(())
}

/// Prints the prompt and the sampled bytes as they come, then the speed.
fn run(a: &Args, model: &Llama) -> Result<()> {
    let prompt = ByteCorpus::encode(&a.prompt);
    let mut out = std::io::stdout().lock();
    out.write_all(a.prompt.as_bytes())?;
    let mut err = None;
    let started = std::time::Instant::now();
    let new = generate(
        model,
        &prompt,
        a.max_tokens,
        a.temperature,
        a.top_p,
        a.seed,
        |t| {
            // Raw bytes: a multi-byte character is complete once all its bytes are
            // out. Ids past 255 (a config with a larger vocabulary) print as '?'.
            let b = u8::try_from(t).unwrap_or(b'?');
            if let Err(e) = out.write_all(&[b]).and_then(|_| out.flush()) {
                err.get_or_insert(e);
            }
        },
    )?;
    let secs = started.elapsed().as_secs_f64();
    writeln!(out)?;
    if let Some(e) = err {
        return Err(e.into());
    }
    eprintln!(
        "{} tokens in {secs:.2} s ({:.1} tokens/s; the time includes the {}-token prompt)",
        new.len(),
        new.len() as f64 / secs,
        prompt.len()
    );
    if let Some(s) = model.stats()? {
        eprintln!("{s}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    check_args(&a)?;
    let dev = cli::device(a.device.as_deref())?;
    let dtype = match a.dtype.as_deref() {
        Some(s) => cli::parse_dtype(s)?,
        None if dev.is_cuda() => DType::BF16,
        None => DType::F32,
    };
    // Where the weights come from: files, or a preset's seeded initialisation.
    enum From {
        Files(Vec<PathBuf>),
        Init(HashMap<String, Tensor>),
    }
    let (from, cfg) = match (&a.checkpoint, a.weights.is_empty(), &a.preset) {
        (Some(dir), true, None) => {
            let f = CheckpointFiles::read(dir)?;
            let config = a.config.clone().unwrap_or(f.config);
            (
                From::Files(vec![f.weights]),
                LlamaConfig::from_json_file(&config)?,
            )
        }
        (None, false, None) => {
            let config = a.config.clone().context("--weights needs --config")?;
            (
                From::Files(a.weights.clone()),
                LlamaConfig::from_json_file(&config)?,
            )
        }
        (None, true, Some(p)) => {
            let cfg = LlamaConfig::preset(p)?;
            (From::Init(init_weights(&cfg, a.init_seed)?), cfg)
        }
        _ => bail!("give one of --checkpoint, --weights (with --config) or --preset"),
    };
    if cfg.vocab_size < 256 {
        bail!(
            "byte-level tokens need vocab_size >= 256, the config has {}",
            cfg.vocab_size
        );
    }
    let layers_bytes = layer_bytes(&cfg, dtype) * cfg.num_hidden_layers;
    let budget = a
        .gpu_weight_budget
        .as_deref()
        .map(parse_bytes)
        .transpose()?;
    let streamed = a.streamed || budget.is_some_and(|b| layers_bytes > b);
    let model = if streamed {
        let prefetch = match budget {
            Some(b) => prefetch_for_budget(&cfg, dtype, b)?,
            None => cli::prefetch("--prefetch", a.prefetch, cfg.num_hidden_layers)?,
        };
        eprintln!(
            "streamed: {} layers of {:.1} MiB, window {} on {:?}",
            cfg.num_hidden_layers,
            layer_bytes(&cfg, dtype) as f64 / 1048576.0,
            prefetch + 1,
            dev.location()
        );
        let stream = StreamConfig {
            device: dev.clone(),
            prefetch_ahead: prefetch,
            dtype,
            ..Default::default()
        };
        match from {
            From::Files(w) => Llama::from_safetensors(&w, &cfg, stream)?,
            From::Init(t) => Llama::from_tensors(t, &cfg, stream)?,
        }
    } else {
        eprintln!(
            "resident: {:.1} MiB of layer weights on {:?}",
            layers_bytes as f64 / 1048576.0,
            dev.location()
        );
        match from {
            From::Files(w) => Llama::load_resident(&w, &cfg, dtype, &dev)?,
            From::Init(t) => Llama::resident(VarBuilder::from_tensors(t, dtype, &dev), &cfg)?,
        }
    };
    run(&a, &model)
}
