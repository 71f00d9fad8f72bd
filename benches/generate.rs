//! Batched generation throughput (`generate_batch`) of a streamed model, on
//! FlexGen's workload: prompts of `GEN_BENCH_PROMPT` tokens (512 on a GPU),
//! `GEN_BENCH_NEW` new tokens each (32), greedy. Each row runs twice as many
//! prompts as sequences in flight, so finished sequences hand their slots to
//! queued ones as in a long job. Rows: `benches/results/generate-<dev>.json`
//! (`system`, `model`, `format`, `batch`, `prompt_len`, `gen_len`,
//! `tokens_per_s` of generated tokens, `device_budget_gib`, `kv_place`,
//! `peak_device_gib`, the plan's estimate), each beside its bounds measured in
//! the same process: the PCIe bound (the copy stream's busy time, every
//! layer's weights once a step) and the compute bound (the run's FLOPs at the
//! rate of a dense bf16 GEMM of the layer's MLP shape on this GPU).
//!
//! `GEN_BENCH` (preset: `8b` = Llama 3.1 8B shapes, random init; default `8b`
//! on a GPU, `tiny` on the CPU) or `GEN_BENCH_MODEL=DIR` (a Hugging Face
//! folder, as the transformers peer `scripts/generate_torch.py --batches`
//! reads); `GEN_BENCH_BATCHES` (sequences in flight, default `1,64,256,1024`
//! on a GPU); `GEN_BENCH_STEP_ROWS` (`BatchLimits::step_rows`);
//! `GEN_BENCH_DEVICE_BUDGET_GIB` (a last row with the GPU capped at that much
//! and the most sequences the budget holds, `batch_plan::sequences_for_budget`).
//!
//!     GPU_ONLY=bench-generate bash gpu-bundle/run.sh benches
#[path = "common/mod.rs"]
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::time::Instant;
use streamer_core::StreamConfig;
use streamer_models::{
    generate_batch, init_weights, sequences_for_budget, BatchLimits, BatchMemory, BatchOutput,
    BatchRequest, BatchShape, BatchSink, Llama, LlamaConfig, Placement, SplitMix64,
    DEFAULT_STEP_ROWS,
};

fn env_or(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The model, streamed with a window of two layers, and its name.
fn load(dev: &Device, dtype: DType) -> Result<(Llama, String)> {
    let stream = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        dtype,
        ..Default::default()
    };
    if let Ok(dir) = std::env::var("GEN_BENCH_MODEL") {
        let p = Llama::from_pretrained(&dir, Placement::Streamed(stream))
            .with_context(|| format!("GEN_BENCH_MODEL={dir}"))?;
        return Ok((p.model, dir));
    }
    let name = std::env::var("GEN_BENCH")
        .unwrap_or_else(|_| if dev.is_cuda() { "8b" } else { "tiny" }.into());
    let cfg = match name.as_str() {
        "8b" => LlamaConfig::llama31_8b(),
        other => LlamaConfig::preset(other)?,
    };
    let t = Instant::now();
    use rayon::prelude::*;
    let w: std::collections::HashMap<String, Tensor> = init_weights(&cfg, 0)?
        .into_par_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<candle_core::Result<_>>()?;
    let model = Llama::from_tensors(w, &cfg, stream)?;
    println!(
        "{name}: random init and host copies in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok((model, name))
}

/// FLOP/s of a dense GEMM at the MLP's shape (4096 rows) in `dtype`.
fn gemm_rate(dev: &Device, dtype: DType, cfg: &LlamaConfig) -> Result<f64> {
    let rows = if dev.is_cuda() { 4096 } else { 64 };
    let a = Tensor::randn(0f32, 1.0, (rows, cfg.hidden_size), dev)?.to_dtype(dtype)?;
    let b =
        Tensor::randn(0f32, 1.0, (cfg.hidden_size, cfg.intermediate_size), dev)?.to_dtype(dtype)?;
    let s = common::time_median(dev, 2, 7, || {
        a.matmul(&b)?;
        Ok(())
    })?;
    Ok(2.0 * (rows * cfg.hidden_size * cfg.intermediate_size) as f64 / s)
}

/// FLOPs of `n` sequences of `p` prompt and `g` new tokens: the layers'
/// GEMMs on every row fed, attention over each row's context, the head on
/// each sequence's last rows.
fn run_flops(cfg: &LlamaConfig, n: usize, (p, g): (usize, usize)) -> f64 {
    let rows = (p + g - 1) as f64;
    let layers = cfg.num_hidden_layers as f64;
    let width = (cfg.num_attention_heads * cfg.head_dim()) as f64;
    // Row i attends to i + 1 keys: q k^T and p v, 2 FLOPs a multiply-add.
    let context: f64 = (1..=p + g - 1).map(|i| i as f64).sum();
    let attention = 4.0 * layers * width * context;
    let head = 2.0 * (g * cfg.hidden_size * cfg.vocab_size) as f64;
    n as f64 * (2.0 * cfg.layer_params() as f64 * layers * rows + attention + head)
}

/// Counts tokens and steps.
#[derive(Default)]
struct Count {
    tokens: usize,
    steps: usize,
    failed: Vec<String>,
}

impl BatchSink for Count {
    fn done(&mut self, out: BatchOutput) -> candle_core::Result<()> {
        match out.result {
            Ok(g) => self.tokens += g.tokens.len(),
            Err(e) => self.failed.push(e),
        }
        Ok(())
    }
    fn step(&mut self, _: usize, _: usize) {
        self.steps += 1;
    }
}

/// Random prompts of `p` tokens, `g` new tokens each.
fn requests(n: usize, (p, g): (usize, usize), vocab: usize) -> Vec<BatchRequest> {
    let mut rng = SplitMix64::new(7);
    (0..n)
        .map(|id| {
            let prompt = (0..p).map(|_| rng.below(vocab) as u32).collect();
            BatchRequest::greedy(id, prompt, g)
        })
        .collect()
}

struct Setup<'a> {
    dev: &'a Device,
    model: &'a Llama,
    name: &'a str,
    dtype: DType,
    pg: (usize, usize),
    step_rows: usize,
    gemm: f64,
    budget_gib: Option<usize>,
}

/// One row: `batch` sequences in flight over `2 x batch` prompts.
fn row(s: &Setup, batch: usize) -> Result<serde_json::Value> {
    let cfg = s.model.config();
    let n = if batch == 1 { 1 } else { 2 * batch };
    let reqs = requests(n, s.pg, cfg.vocab_size);
    let limits = BatchLimits {
        sequences: batch,
        step_rows: s.step_rows,
    };
    let plan = BatchMemory::of(
        cfg,
        s.dtype,
        2,
        BatchShape {
            sequences: batch,
            capacity: s.pg.0 + s.pg.1,
            step_rows: s.step_rows,
        },
    );
    println!("batch {batch}, {n} prompts: plan {plan}");
    streamer_core::trim_device_memory(s.dev)?;
    let base = common::used_now(s.dev);
    let before = s.model.stats()?.unwrap_or_default();
    let sampler = common::MemSampler::start(s.dev);
    let mut count = Count::default();
    s.dev.synchronize()?;
    let t = Instant::now();
    generate_batch(s.model, reqs, limits, &[], &mut count)?;
    s.dev.synchronize()?;
    let wall = t.elapsed().as_secs_f64();
    let peak = common::MemSampler::finish(sampler);
    anyhow::ensure!(
        count.failed.is_empty(),
        "requests failed: {:?}",
        count.failed
    );
    let after = s.model.stats()?.unwrap_or_default();
    let h2d_s = after.h2d_seconds - before.h2d_seconds;
    let compute_s = run_flops(cfg, n, s.pg) / s.gemm;
    let bound_s = h2d_s.max(compute_s);
    let tps = count.tokens as f64 / wall;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let r = serde_json::json!({
        "system": "ours", "model": s.name, "format": format!("{:?}", s.dtype).to_lowercase(),
        "placement": "streamed, 2 layers on the device",
        "batch": batch, "prompts": n, "prompt_len": s.pg.0, "gen_len": s.pg.1,
        "step_rows": s.step_rows, "steps": count.steps, "generated": count.tokens,
        "wall_s": wall, "tokens_per_s": tps,
        "device_budget_gib": s.budget_gib, "kv_place": "device",
        "planned_device_gib": gib(plan.total()), "peak_device_gib": gib(peak.saturating_sub(base)),
        "h2d_gb": (after.h2d_bytes - before.h2d_bytes) as f64 / 1e9, "h2d_s": h2d_s,
        "compute_bound_s": compute_s, "gemm_tflops": s.gemm / 1e12,
        "bound_tokens_per_s": count.tokens as f64 / bound_s, "of_bound": bound_s / wall,
    });
    println!("  {r}");
    Ok(r)
}

/// GEN_BENCH_BATCHES: the rows' sequences in flight (may be empty).
fn batches(dev: &Device) -> Result<Vec<usize>> {
    let default = if dev.is_cuda() {
        "1,64,256,1024"
    } else {
        "1,4"
    };
    std::env::var("GEN_BENCH_BATCHES")
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter(|b| !b.trim().is_empty())
        .map(|b| b.trim().parse().context("GEN_BENCH_BATCHES"))
        .collect()
}

fn main() -> Result<()> {
    let dev = common::device();
    let dtype = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let (p, g) = if dev.is_cuda() { (512, 32) } else { (24, 6) };
    let pg = (env_or("GEN_BENCH_PROMPT", p), env_or("GEN_BENCH_NEW", g));
    let step_rows = env_or("GEN_BENCH_STEP_ROWS", DEFAULT_STEP_ROWS);
    let budget_gib = std::env::var("GEN_BENCH_DEVICE_BUDGET_GIB")
        .ok()
        .map(|v| v.parse::<usize>().context("GEN_BENCH_DEVICE_BUDGET_GIB"))
        .transpose()?;
    let (model, name) = load(&dev, dtype)?;
    let cfg = model.config().clone();
    let batches = batches(&dev)?;
    let gemm = gemm_rate(&dev, dtype, &cfg)?;
    println!("dense {dtype:?} GEMM: {:.0} TFLOP/s", gemm / 1e12);
    // Warm-up: kernels loaded, the outer weights' path exercised.
    let warm = requests(2, (8, 2), cfg.vocab_size);
    generate_batch(&model, warm, 2, &[], &mut Count::default())?;
    let mut setup = Setup {
        dev: &dev,
        model: &model,
        name: &name,
        dtype,
        pg,
        step_rows,
        gemm,
        budget_gib: None,
    };
    let mut rows = batches
        .iter()
        .map(|&b| row(&setup, b))
        .collect::<Result<Vec<_>>>()?;
    if let Some(b) = budget_gib {
        // Last: the cap holds back the GPU's memory beyond the budget (what
        // the model holds already included) for the rest of the process.
        let most = (pg.0 + pg.1, step_rows, 1 << 14);
        let n = sequences_for_budget(&cfg, dtype, 2, most, b << 30)?;
        streamer_core::trim_device_memory(&dev)?;
        let _cap = common::cap_device_memory(&dev, Some(b << 30))?;
        setup.budget_gib = Some(b);
        rows.push(row(&setup, n)?);
    }
    let out = serde_json::json!({
        "bench": "generate", "device": common::device_tag(&dev),
        "command": "GPU_ONLY=bench-generate bash gpu-bundle/run.sh benches",
        "rows": rows,
    });
    let path = common::results_path(&format!("generate-{}.json", common::device_tag(&dev)));
    std::fs::write(&path, serde_json::to_string_pretty(&out)?)?;
    println!("wrote {}", path.display());
    Ok(())
}
