//! Write a Hugging Face model folder of random weights in the real layout, for
//! trying `generate --model` / `train_lm --model` at sizes no fixture has:
//! `config.json`, `model.safetensors` (or shards and their index) and a
//! `tokenizer.json` copied from `--tokenizer` (without it, a weights-only
//! folder: the same weights `train_lm --config config.json --seed S` starts from).
//!
//!     cargo run --release --example init_model -- --shape llama31-8b --tokenizer tok.json --out /tmp/8b
//!     cargo run --release --example init_model -- --config config.json --tokenizer tok.json --out DIR
//!
//! `--shape llama31-8b` is Llama 3.1 8B's configuration (32 layers of 4096,
//! vocabulary 128256, llama3 rope); presets (`tiny`, `350m`, `1b`, `3b`) work
//! too. Weights are `init_weights` (seeded normals, 0.02) in `--dtype`.
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_streamer::cli;
use clap::Parser;
use std::collections::HashMap;
use std::path::PathBuf;
use streamer_models::{init_weights, LlamaConfig, TextTokenizer};

#[derive(Parser, Debug)]
#[command(about = "Write a Hugging Face model folder of random weights in the real layout")]
struct Args {
    /// A config.json to use.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A named shape instead: llama31-8b, or a preset (tiny, 350m, 1b, 3b).
    #[arg(long)]
    shape: Option<String>,
    /// The tokenizer.json to copy in (checked against vocab_size); without
    /// it the folder holds the config and weights only.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output folder (must not exist yet).
    #[arg(long)]
    out: PathBuf,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Largest shard in bytes ("5GB"); 0 writes one model.safetensors.
    #[arg(long, default_value = "5GB")]
    shard_size: String,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// Writes `weights` as shards of at most `max` bytes and their index (one
/// `model.safetensors` when `max` is 0 or everything fits).
fn write_weights(
    out: &std::path::Path,
    weights: HashMap<String, Tensor>,
    max: usize,
) -> Result<()> {
    let mut names: Vec<String> = weights.keys().cloned().collect();
    names.sort();
    let bytes = |n: &String| weights[n].elem_count() * weights[n].dtype().size_in_bytes();
    let mut shards: Vec<Vec<String>> = vec![Vec::new()];
    let mut size = 0;
    for n in names {
        if max > 0 && size > 0 && size + bytes(&n) > max {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes(&n);
        shards.last_mut().context("a shard")?.push(n);
    }
    if shards.len() == 1 {
        streamer_core::save_atomic(&weights, &out.join("model.safetensors"))?;
        return Ok(());
    }
    let mut map = serde_json::Map::new();
    let total: usize = weights.keys().map(bytes).sum();
    for (i, names) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
        let part: HashMap<String, Tensor> = names
            .iter()
            .map(|n| (n.clone(), weights[n].clone()))
            .collect();
        streamer_core::save_atomic(&part, &out.join(&file))?;
        for n in names {
            map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    streamer_device::write_atomic(
        &out.join("model.safetensors.index.json"),
        &serde_json::to_string_pretty(&index)?,
    )?;
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    let cfg = match (&a.config, a.shape.as_deref()) {
        (Some(c), None) => LlamaConfig::from_json_file(c)?,
        (None, Some("llama31-8b")) => LlamaConfig::llama31_8b(),
        (None, Some(p)) => LlamaConfig::preset(p)?,
        _ => bail!("give --config or --shape"),
    };
    let dtype = cli::parse_dtype(&a.dtype)?;
    let max = streamer_models::parse_bytes(&a.shard_size)?;
    let tok = a
        .tokenizer
        .as_ref()
        .map(TextTokenizer::from_file)
        .transpose()?;
    if let Some(t) = &tok {
        t.check_vocab(
            &cfg,
            a.config
                .as_deref()
                .unwrap_or(std::path::Path::new("--shape")),
        )?;
    }
    if a.out.exists() {
        bail!("{} exists: give a new folder", a.out.display());
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    eprintln!("{} parameters in {dtype:?} ...", cfg.num_params());
    let weights = init_weights(&cfg, a.seed)?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    write_weights(&a.out, weights, max)?;
    streamer_device::write_atomic(&a.out.join("config.json"), &cfg.to_json()?)?;
    if let Some(t) = &tok {
        std::fs::copy(t.path(), a.out.join("tokenizer.json"))?;
    }
    println!("wrote {}", a.out.display());
    Ok(())
}
