//! Decoder training throughput: the Llama presets trained streamed (decoder
//! layers through a window of device slots, f32 masters and AdamW on the host,
//! optimizer step overlapped with backward) and, where they fit, resident
//! (plain Candle: a `VarMap` on the device, candle-nn AdamW there too). Both
//! compute in bf16 on a GPU, f32 on the CPU.
//!
//!     cargo bench --bench lm [--features cuda]
//!
//! `LM_BENCH=1b:both,3b:streamed` picks presets (or `8b`, `14b`, `70b`
//! shapes) and modes (GPU default; the CPU default is `tiny:both`), `LM_BENCH_BATCH` / `LM_BENCH_SEQ` the step's shape
//! (16 x 2048 on a GPU), `LM_BENCH_STEPS` the timed steps (after 2 warm-up
//! steps; `LM_BENCH_WARMUP` changes that), `LM_BENCH_WINDOW` the decoder layers
//! on the device (default 2), `LM_BENCH_LAYERS` a smaller layer count of the
//! same shapes (to profile a layer's kernels with `ncu`),
//! `LM_BENCH_ACTIVATIONS` the streamed runs' activation policies (default
//! `recompute,auto`), `LM_BENCH_NO_EVENT_TRACKING=1` turns cudarc's event
//! tracking off first (the opt-in `streamer_core::disable_cuda_event_tracking`).
//! Model FLOPs utilisation is `6 x parameters x tokens/s / 990 TFLOP/s` (the
//! H200's dense bf16 peak); the streamed run recomputes each layer's forward
//! in backward, which this convention does not count.
//!
//! Writes `benches/results/lm-<device>.json`.
#[path = "common/mod.rs"]
mod common;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use std::time::Instant;
use streamer_autograd::{ActivationPolicy, DeviceAdamW};
use streamer_core::StreamConfig;
use streamer_models::checkpoint::layer_bytes;
use streamer_models::{init_weights, ByteCorpus, Llama, LlamaConfig, LmTrainer, OptimizerPlace};

const PEAK_TFLOPS: f64 = 990.0;

struct Run {
    /// Decoder layers whose activations the last streamed forward kept.
    kept_layers: Option<usize>,
    step_s: Vec<f64>,
    loss: Vec<f32>,
    peak_device: usize,
    host_rss: usize,
}

fn env_or(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn corpus() -> ByteCorpus {
    // The shipped corpus when run from the repository root, random bytes otherwise
    // (throughput does not depend on the text).
    ByteCorpus::from_file("data/corpus.txt").unwrap_or_else(|_| {
        let mut rng = streamer_models::SplitMix64::new(7);
        ByteCorpus::new((0..1 << 20).map(|_| (rng.next_u64() >> 56) as u8).collect())
    })
}

/// Times `steps` training steps after 2 warm-up steps; `step` takes the
/// batch and the step's learning rate and returns the loss.
fn time_steps(
    dev: &Device,
    data: &ByteCorpus,
    batch: usize,
    seq: usize,
    steps: usize,
    peak_lr: f64,
    mut step: impl FnMut(&Tensor, &Tensor, f64) -> Result<f32>,
) -> Result<Run> {
    streamer_core::trim_device_memory(dev)?;
    let base = common::used_now(dev);
    let sampler = common::MemSampler::start(dev);
    let mut step_s = Vec::new();
    let mut loss = Vec::new();
    let warmup = env_or("LM_BENCH_WARMUP", 2);
    let schedule = common::bench_schedule(peak_lr, steps + warmup);
    for s in 0..steps + warmup {
        let (x, y) = data.batch(0, s as u64, batch, seq, dev)?;
        dev.synchronize()?;
        let t = Instant::now();
        let l = step(&x, &y, schedule.at(s))?;
        dev.synchronize()?;
        if dev.is_cuda() {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            let idle = streamer_core::pooled_idle_bytes(dev)?;
            println!(
                "  step {s}: {:.3} s, device in use {:.1} GiB ({:.1} GiB of it idle in the pool)",
                t.elapsed().as_secs_f64(),
                gib(common::used_now(dev)),
                gib(idle)
            );
        }
        if s >= warmup {
            step_s.push(t.elapsed().as_secs_f64());
        }
        loss.push(l);
    }
    Ok(Run {
        kept_layers: None,
        step_s,
        loss,
        peak_device: common::MemSampler::finish(sampler).saturating_sub(base),
        host_rss: common::host_rss().0,
    })
}

/// The resident rows' activation label: every activation kept, through the
/// hand-written layer backward unless LM_BENCH_RESIDENT_BACKWARD=autograd.
fn resident_label() -> String {
    match std::env::var("LM_BENCH_RESIDENT_BACKWARD").as_deref() {
        Ok("autograd") => "keep (Candle autograd)".into(),
        _ => "keep (hand-written backward)".into(),
    }
}

/// One optimizer step over a `GradStore` at a learning rate.
type StepFn = Box<dyn FnMut(&candle_core::backprop::GradStore, f64) -> candle_core::Result<()>>;

fn resident(
    cfg: &LlamaConfig,
    dev: &Device,
    dtype: DType,
    adam: &ParamsAdamW,
    shape: (usize, usize, usize),
) -> Result<Run> {
    let (batch, seq, steps) = shape;
    let varmap = VarMap::new();
    {
        let mut data = varmap.data().lock().expect("fresh varmap");
        for (k, t) in init_weights(cfg, 0)? {
            data.insert(k, Var::from_tensor(&t.to_dtype(dtype)?.to_device(dev)?)?);
        }
    }
    let model = Llama::resident(VarBuilder::from_varmap(&varmap, dtype, dev), cfg)?;
    // LM_BENCH_RESIDENT_BACKWARD=autograd measures plain Candle autograd.
    let fused = std::env::var("LM_BENCH_RESIDENT_BACKWARD").map_or(true, |v| v != "autograd");
    model.set_fused_backward(fused)?;
    println!(
        "  resident backward: {}",
        if fused {
            "hand-written"
        } else {
            "Candle autograd"
        }
    );
    // LM_BENCH_RESIDENT_OPTIMIZER=candle measures candle-nn's AdamW (a dozen
    // element-wise ops per weight) instead of DeviceAdamW's one fused pass.
    let mut opt: StepFn = match std::env::var("LM_BENCH_RESIDENT_OPTIMIZER").as_deref() {
        Ok("candle") => {
            let mut o = AdamW::new(varmap.all_vars(), adam.clone())?;
            Box::new(move |g, lr| {
                o.set_learning_rate(lr);
                o.step(g)
            })
        }
        _ => {
            let mut o = DeviceAdamW::new(varmap.all_vars(), adam.clone(), dev)?;
            Box::new(move |g, lr| {
                o.set_learning_rate(lr);
                o.step(g)
            })
        }
    };
    time_steps(dev, &corpus(), batch, seq, steps, adam.lr, |x, y, lr| {
        let loss = model.loss(x, y)?;
        opt(&model.backward(&loss)?, lr)?;
        Ok(loss.to_scalar::<f32>()?)
    })
}

/// `LM_BENCH_OPTIMIZER`: where the streamed rows' AdamW runs (`host`, the
/// default: `CpuAdamW` overlapped with backward; `device`: `DeviceAdamW`).
fn streamed_optimizer() -> Result<OptimizerPlace> {
    Ok(match std::env::var("LM_BENCH_OPTIMIZER").as_deref() {
        Err(_) | Ok("host") => OptimizerPlace::Host,
        Ok("device") => OptimizerPlace::Device,
        Ok(other) => anyhow::bail!("LM_BENCH_OPTIMIZER: unknown {other:?} (host or device)"),
    })
}

fn resident_optimizer() -> &'static str {
    match std::env::var("LM_BENCH_RESIDENT_OPTIMIZER").as_deref() {
        Ok("candle") => "candle-nn AdamW",
        _ => "DeviceAdamW",
    }
}

fn streamed(
    cfg: &LlamaConfig,
    dev: &Device,
    dtype: DType,
    adam: &ParamsAdamW,
    shape: (usize, usize, usize),
    window: usize,
    policy: ActivationPolicy,
) -> Result<Run> {
    let (batch, seq, steps) = shape;
    let stream = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: window - 1,
        dtype,
        master_dtype: Some(DType::F32),
        slot_budget_bytes: Some(layer_bytes(cfg, dtype)),
        ..Default::default()
    };
    let model = Llama::from_tensors(init_weights(cfg, 0)?, cfg, stream)?;
    let mut trainer = LmTrainer::new_on(model, adam.clone(), streamed_optimizer()?)?;
    trainer.set_overlap(true);
    let layers = trainer
        .model()
        .trainable_layers()
        .expect("a trainable streamed model");
    layers.set_activation_policy(policy)?;
    println!(
        "  activations {policy:?}; device memory free before: {:.1} GiB",
        streamer_core::free_device_memory(dev)?.unwrap_or(0) as f64 / (1u64 << 30) as f64
    );
    let mut run = time_steps(dev, &corpus(), batch, seq, steps, adam.lr, |x, y, lr| {
        trainer.set_learning_rate(lr);
        Ok(trainer.step(x, y)?)
    })?;
    let layers = trainer
        .model()
        .trainable_layers()
        .expect("a trainable streamed model");
    run.kept_layers = Some(layers.kept_blocks()?);
    if let Some(st) = trainer.model().stats()? {
        println!("  streamed layers: {st}");
    }
    Ok(run)
}

/// What one row of the bench runs.
struct Bench<'a> {
    preset: &'a str,
    cfg: &'a LlamaConfig,
    dev: &'a Device,
    dtype: DType,
    adam: &'a ParamsAdamW,
    shape: (usize, usize, usize),
    window: usize,
}

/// Runs one (mode, activation policy) and returns its row; a failure is a row
/// with the error (the bench goes on).
fn bench_one(
    b: &Bench<'_>,
    mode: &str,
    policy: Option<(String, ActivationPolicy)>,
    tps: &mut std::collections::HashMap<String, f64>,
) -> serde_json::Value {
    let (batch, seq, steps) = b.shape;
    let params = b.cfg.num_params();
    let tokens = batch * seq;
    let name = policy.as_ref().map_or(resident_label(), |p| p.0.clone());
    println!(
        "{} ({:.2} B params, {} layers) {mode}, activations {name}: {batch} x {seq} tokens per step, {steps} timed steps",
        b.preset,
        params as f64 / 1e9,
        b.cfg.num_hidden_layers
    );
    let run = match &policy {
        None => resident(b.cfg, b.dev, b.dtype, b.adam, b.shape),
        Some((_, p)) => streamed(b.cfg, b.dev, b.dtype, b.adam, b.shape, b.window, *p),
    };
    let run = match run {
        Ok(r) => r,
        Err(e) => {
            println!("  {mode} failed: {e}");
            return serde_json::json!({ "system": "ours", "preset": b.preset, "mode": mode, "activation_policy": name, "error": e.to_string() });
        }
    };
    let mut sorted = run.step_s.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let tok_s = tokens as f64 / median;
    let mfu = 6.0 * params as f64 * tok_s / (PEAK_TFLOPS * 1e12);
    let best = tps.entry(mode.to_string()).or_insert(0.0);
    *best = best.max(tok_s);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!(
        "  step {median:.3} s (median), {tok_s:.0} tokens/s, MFU {:.1} %, peak device {:.2} GiB, host RSS {:.2} GiB, kept layers {:?}, loss {:?}",
        mfu * 100.0,
        gib(run.peak_device),
        gib(run.host_rss),
        run.kept_layers,
        run.loss
    );
    serde_json::json!({
        "system": "ours", "activation_policy": name, "kept_layers": run.kept_layers,
        "peak_device_gib": gib(run.peak_device),
        "preset": b.preset, "mode": mode, "params": params, "layers": b.cfg.num_hidden_layers,
        "batch": batch, "seq": seq, "tokens_per_step": tokens,
        "window_layers": if mode == "streamed" { Some(b.window) } else { None },
        "optimizer": if mode == "streamed" {
            match streamed_optimizer() { Ok(OptimizerPlace::Device) => "DeviceAdamW", _ => "CpuAdamW" }
        } else {
            resident_optimizer()
        },
        "step_s": run.step_s, "median_step_s": median, "tokens_per_s": tok_s, "mfu": mfu,
        "peak_device_bytes": run.peak_device, "host_rss_bytes": run.host_rss, "losses": run.loss,
    })
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    let gpu = dev.is_cuda();
    streamer_core::retain_freed_device_memory(&dev)?;
    if std::env::var("LM_BENCH_NO_EVENT_TRACKING").is_ok_and(|v| v == "1") {
        // SAFETY: this bench's only streams are Candle's and the pool's, which
        // order themselves with explicit events.
        unsafe { streamer_core::disable_cuda_event_tracking(&dev)? };
        println!("cudarc event tracking off (LM_BENCH_NO_EVENT_TRACKING=1)");
    }
    let spec = std::env::var("LM_BENCH").unwrap_or_else(|_| {
        if gpu {
            "1b:both,3b:streamed"
        } else {
            "tiny:both"
        }
        .into()
    });
    let batch = env_or("LM_BENCH_BATCH", if gpu { 16 } else { 2 });
    let seq = env_or("LM_BENCH_SEQ", if gpu { 2048 } else { 64 });
    let steps = env_or("LM_BENCH_STEPS", if gpu { 5 } else { 2 });
    let window = env_or("LM_BENCH_WINDOW", 2).max(1);
    // Compute dtype of both runs: bf16 on a GPU, f32 on the CPU.
    let dtype = if gpu { DType::BF16 } else { DType::F32 };
    let adam = ParamsAdamW {
        lr: 3e-4,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut rows = Vec::new();
    for item in spec.split(',') {
        let (preset, modes) = item.split_once(':').unwrap_or((item, "both"));
        let mut cfg = common::model_config(preset)?;
        // Fewer layers of the same shapes (for profiling one layer's kernels).
        if let Ok(l) = std::env::var("LM_BENCH_LAYERS") {
            cfg.num_hidden_layers = l.parse()?;
        }
        let policies =
            std::env::var("LM_BENCH_ACTIVATIONS").unwrap_or_else(|_| "recompute,auto".into());
        let policies = policies
            .split(',')
            .map(|p| p.parse::<ActivationPolicy>().map(|v| (p.to_string(), v)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let runs: Vec<(&str, Option<(String, ActivationPolicy)>)> = match modes {
            "both" | "resident" | "streamed" => {
                let mut v = vec![];
                if modes != "streamed" {
                    v.push(("resident", None));
                }
                if modes != "resident" {
                    v.extend(policies.iter().cloned().map(|p| ("streamed", Some(p))));
                }
                v
            }
            m => bail!("LM_BENCH: unknown mode {m:?} (both, resident, streamed)"),
        };
        let mut tps = std::collections::HashMap::new();
        for (mode, policy) in runs {
            let what = Bench {
                preset,
                cfg: &cfg,
                dev: &dev,
                dtype,
                adam: &adam,
                shape: (batch, seq, steps),
                window,
            };
            let row = bench_one(&what, mode, policy, &mut tps);
            rows.push(row);
        }
        if let (Some(r), Some(s)) = (tps.get("resident"), tps.get("streamed")) {
            println!("{preset}: streamed / resident tokens/s = {:.3}", s / r);
            rows.push(serde_json::json!({ "preset": preset, "streamed_over_resident_tokens_per_s": s / r }));
        }
    }
    // transformers' rows of this device call (benches/lm_torch.py, run first by gpu-run.sh).
    let torch_path = common::results_path(&format!("lm-torch-{tag}.json"));
    if let Some(v) = std::fs::read_to_string(torch_path)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
    {
        rows.extend(v["results"].as_array().cloned().unwrap_or_default());
    }
    let out = serde_json::json!({
        "device": tag,
        "command": "cargo bench --bench lm --features cuda (scripts/gpu-test.sh bundle)",
        "mfu_convention": format!("6 x all parameters x tokens/s / {PEAK_TFLOPS} TFLOP/s; recompute and attention FLOPs not counted"),
        "compute_dtype": format!("{dtype:?}"),
        "streamed": "f32 host masters; CpuAdamW on the host overlapped with backward, or (LM_BENCH_OPTIMIZER=device, the row's optimizer field) DeviceAdamW stepping the staged masters on the GPU",
        "resident": "VarMap in the compute dtype on the device, DeviceAdamW (fused, f32 moments) on the device (LM_BENCH_RESIDENT_OPTIMIZER=candle: candle-nn AdamW), the decoder layers' hand-written backward (LM_BENCH_RESIDENT_BACKWARD=autograd: Candle autograd)",
        "peak_device_note": "cuMemGetInfo sampled every 200 us above the level before the run, pool trimmed first",
        "results": rows,
    });
    common::write_results(&format!("lm-{tag}"), &out, None)
}
