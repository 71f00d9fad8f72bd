//! Training-step benchmark: MLP blocks `Linear(w,h), GELU, Linear(h,w)` trained
//! streamed (f32 host masters, bf16 compute, CpuAdamW overlapped with backward)
//! against PyTorch training the same blocks resident (benches/training_torch.py,
//! run first by gpu-run.sh in the same device call; its rows are merged here).
//!
//! Rows of ours: `FusedMlp` blocks (hand-written backward, four cuBLASLt GEMMs)
//! with activations recomputed or kept, and candle-nn `Linear` blocks through
//! Candle autograd (recompute). Each `FusedMlp` case runs with the optimizer on
//! the host (`CpuAdamW` overlapped with backward) and on the device
//! (`DeviceAdamW` stepping the staged masters in `backward_step_device`);
//! `TRAINING_BENCH_OPTIMIZERS=host,device` picks them.
//!
//!     cargo bench --bench training [--features cuda]
//!
//! Writes `benches/results/training-<device>.json` and `.svg`.
#[path = "common/mod.rs"]
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use std::collections::HashMap;
use std::time::Instant;
use streamer_autograd::{ActivationPolicy, CpuAdamW, DeviceAdamW, Train, TrainableSequential};
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    FusedMlp,
    CandleLinear,
}

/// Where the optimizer steps the streamed weights.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    Host,
    Device,
}

/// The optimizer of one case, stepping inside its backward.
enum Stepper {
    Host(CpuAdamW),
    Device(DeviceAdamW),
}

impl Stepper {
    fn new(opt: Opt, model: &TrainableSequential, dev: &Device) -> Result<Self> {
        let params = ParamsAdamW {
            lr: 1e-4,
            ..Default::default()
        };
        let vars = model.trainable_vars()?;
        Ok(match opt {
            Opt::Host => Self::Host(CpuAdamW::new(vars, params)?),
            Opt::Device => Self::Device(DeviceAdamW::new(vars, params, dev)?),
        })
    }

    fn backward(&mut self, model: &TrainableSequential, loss: &Tensor) -> Result<()> {
        match self {
            Self::Host(o) => model.backward_step(loss, o)?,
            Self::Device(o) => model.backward_step_device(loss, o)?,
        };
        Ok(())
    }
}

struct Run {
    step_ms: f64,
    forward_ms: f64,
    optimizer_ms: f64,
    kept_blocks: usize,
    peak_device_gib: f64,
    stats: streamer_core::StreamStats,
}

/// Median overlapped training step (forward, backward with the optimizer
/// stepping on the host as gradients land).
#[allow(clippy::too_many_arguments)]
fn measure(
    dev: &Device,
    host: &HashMap<String, Tensor>,
    (w, h, n): (usize, usize, usize),
    (kind, opt, master): (Kind, Opt, DType),
    policy: ActivationPolicy,
    x: &Tensor,
    target: &Tensor,
    (warmup, iters): (usize, usize),
) -> Result<Run> {
    let blocks: Vec<BlockSpec> = (0..n)
        .map(|i| match kind {
            Kind::FusedMlp => BlockSpec::new(format!("layers.{i}"), move |vb| {
                streamer_models::fused_mlp(w, h, vb)
            }),
            Kind::CandleLinear => {
                BlockSpec::module(format!("layers.{i}"), move |vb| common::mlp(vb, w, h))
            }
        })
        .collect();
    // TRAINING_BENCH_TIMELINE=DIR writes each case's Chrome-trace timeline
    // (copies and per-block compute of the measured steps) into DIR.
    let timeline = std::env::var("TRAINING_BENCH_TIMELINE").ok();
    let cfg = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        dtype: DType::BF16,
        master_dtype: Some(master),
        timeline: timeline.is_some(),
        ..Default::default()
    };
    let model = StreamedSequential::from_tensors(host.clone(), blocks, cfg)?.train();
    model.set_activation_policy(policy)?;
    let mut stepper = Stepper::new(opt, &model, dev)?;
    let (mut total, mut fwd, mut opt_s) = (vec![], vec![], vec![]);
    let mut sampler = None;
    // The forward's time is taken in the warm-up steps, which synchronise
    // after it; a timed step synchronises only at its ends, as PyTorch's
    // events time its step, so the host can issue the backward while the
    // GPU still runs the forward.
    for it in 0..warmup + iters {
        let timed = it >= warmup;
        if it == warmup {
            model.inner().reset_stats()?;
            sampler = Some(common::MemSampler::start(dev));
        }
        dev.synchronize()?;
        let t0 = Instant::now();
        let y = model.forward(x)?;
        let t_loss = model.inner().timeline_on().then(Instant::now);
        // The mean in two stages: Candle 0.11 reduces `mean_all` of a large
        // tensor with one thread block (grid = one output element), which
        // for these 134M f32 squares is milliseconds of one SM on the compute
        // stream between the forward and the backward. Per-row means first
        // spread it over every SM (rows of equal length: the same mean).
        let loss = y
            .to_dtype(DType::F32)?
            .sub(target)?
            .sqr()?
            .mean(candle_core::D::Minus1)?
            .mean_all()?;
        if let Some(t) = t_loss {
            model
                .inner()
                .record_host_span("loss (issue)", t, Instant::now())?;
        }
        if !timed {
            dev.synchronize()?;
            fwd.push((t0.elapsed()).as_secs_f64() * 1e3);
        }
        stepper.backward(&model, &loss)?;
        model.zero_grad()?;
        let t_sync = model.inner().timeline_on().then(Instant::now);
        dev.synchronize()?;
        if let Some(t) = t_sync {
            model
                .inner()
                .record_host_span("step end synchronize", t, Instant::now())?;
        }
        if timed {
            total.push(t0.elapsed().as_secs_f64() * 1e3);
            opt_s.push(model.last_optimizer_seconds()? * 1e3);
        }
    }
    let peak = sampler.map_or(0, |s| s.finish());
    if let Some(dir) = timeline {
        let name =
            format!("training-timeline-w{w}x{n}-{kind:?}-{policy:?}-{opt:?}-{master:?}.json")
                .replace([' ', '{', '}', ':', ','], "");
        model
            .inner()
            .write_timeline(Some(&std::path::Path::new(&dir).join(name)))?;
    }
    Ok(Run {
        step_ms: median(total),
        forward_ms: median(fwd),
        optimizer_ms: median(opt_s),
        kept_blocks: model.kept_blocks()?,
        peak_device_gib: peak as f64 / (1u64 << 30) as f64,
        stats: model.stats()?,
    })
}

/// The comma-separated values of `key` (or `default`), each parsed by `parse`;
/// an unknown value is an error naming the variable and the value.
fn env_list<T>(key: &str, default: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>> {
    std::env::var(key)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|v| parse(v).ok_or_else(|| anyhow::anyhow!("{key}: unknown value {v:?}")))
        .collect()
}

/// PyTorch's rows of this device call, if its script ran (`training-torch-<tag>.json`).
fn torch_rows(tag: &str) -> Vec<serde_json::Value> {
    common::result_rows(&format!("training-torch-{tag}.json"))
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    let gpu = dev.is_cuda();
    streamer_core::retain_freed_device_memory(&dev)?;
    let configs: Vec<(usize, usize, usize, usize)> = if gpu {
        vec![(4096, 16384, 8, 32768), (8192, 32768, 4, 32768)]
    } else {
        vec![(128, 256, 4, 256)]
    };
    let reps = if gpu { (2, 5) } else { (1, 3) };
    let torch = torch_rows(&tag);
    let mut rows: Vec<serde_json::Value> = torch.clone();
    let mut bars = Vec::new();
    // TRAINING_BENCH_CONFIGS=w4096x8,... runs only those block shapes.
    let only = std::env::var("TRAINING_BENCH_CONFIGS").ok();
    let opts = env_list("TRAINING_BENCH_OPTIMIZERS", "host,device", |o| match o {
        "host" => Some(Opt::Host),
        "device" => Some(Opt::Device),
        _ => None,
    })?;
    // TRAINING_BENCH_MASTERS=f32,bf16: the host masters' dtype. bf16 masters
    // (stepped by DeviceAdamW only) hold the weights in the precision PyTorch's
    // bf16 model holds them, with f32 moments; f32 masters are more exact.
    let masters = env_list("TRAINING_BENCH_MASTERS", "f32", |m| match m {
        "f32" => Some(DType::F32),
        "bf16" => Some(DType::BF16),
        _ => None,
    })?;
    for (w, h, n, tokens) in configs {
        if let Some(only) = &only {
            if !only.split(',').any(|c| c == format!("w{w}x{n}")) {
                continue;
            }
        }
        let host = common::mlp_weights(&dev, w, h, n, DType::F32)?;
        let x = Tensor::randn(0f32, 1.0, (tokens, w), &dev)?.to_dtype(DType::BF16)?;
        let target = Tensor::randn(0f32, 1.0, (tokens, w), &dev)?;
        let blocks = format!("w{w}x{n}");
        let peer = torch
            .iter()
            .find(|r| r["blocks"] == blocks.as_str() && r["tokens"] == tokens)
            .and_then(|r| r["step_ms"].as_f64());
        let keep = ActivationPolicy::Auto { fraction: 0.8 };
        let mut cases = Vec::new();
        for &master in &masters {
            for &opt in &opts {
                // CpuAdamW steps f32 masters only.
                if master != DType::F32 && opt == Opt::Host {
                    continue;
                }
                let recompute = ActivationPolicy::Recompute;
                cases.push((Kind::FusedMlp, opt, master, "recompute", recompute));
                cases.push((Kind::FusedMlp, opt, master, "keep", keep));
            }
        }
        let recompute = ActivationPolicy::Recompute;
        cases.push((
            Kind::CandleLinear,
            Opt::Host,
            DType::F32,
            "recompute",
            recompute,
        ));
        let mut bar = Vec::new();
        for (k, (kind, opt, master, acts, policy)) in cases.into_iter().enumerate() {
            let r = measure(
                &dev,
                &host,
                (w, h, n),
                (kind, opt, master),
                policy,
                &x,
                &target,
                reps,
            )?;
            let vs = peer.map(|p| r.step_ms / p);
            let per = reps.1 as f64;
            println!(
                "{blocks} {tokens} tokens {kind:?} {acts} optimizer {opt:?} masters {master:?}: step {:.1} ms (forward {:.1}, host optimizer {:.1}), \
                 {} of {n} blocks kept, peak {:.1} GiB, stall {:.1} ms/step | PyTorch resident {} -> ratio {}",
                r.step_ms,
                r.forward_ms,
                r.optimizer_ms,
                r.kept_blocks,
                r.peak_device_gib,
                r.stats.stall_seconds * 1e3 / per,
                peer.map_or("not run".into(), |p| format!("{p:.1} ms")),
                vs.map_or("-".into(), |v| format!("{v:.3}")),
            );
            if let Some(v) = vs {
                bar.push(((k + 1) as f64, v));
            }
            rows.push(serde_json::json!({
                "system": "ours", "blocks": blocks, "w": w, "h": h, "n": n, "tokens": tokens,
                "mode": "streamed", "block_kind": format!("{kind:?}"), "activations": acts,
                "policy": format!("{policy:?}"), "kept_blocks": r.kept_blocks,
                "optimizer": match opt { Opt::Host => "host", Opt::Device => "device" },
                "master_dtype": format!("{master:?}").to_lowercase(),
                "step_ms": r.step_ms, "forward_ms": r.forward_ms, "vs_pytorch_resident": vs,
                "host_optimizer_ms": r.optimizer_ms,
                "peak_device_gib": r.peak_device_gib,
                "h2d_bytes_per_step": r.stats.h2d_bytes as f64 / per,
                "d2h_bytes_per_step": r.stats.d2h_bytes as f64 / per,
                "stall_ms_per_step": r.stats.stall_seconds * 1e3 / per,
                "reused_loads_per_step": r.stats.reused_loads as f64 / per,
                "stale_reuses": r.stats.stale_reuses,
            }));
        }
        bars.push((blocks, bar));
    }
    #[cfg(feature = "cuda")]
    let fallbacks = streamer_models::epilogue_fallbacks();
    #[cfg(not(feature = "cuda"))]
    let fallbacks = 0usize;
    let out = serde_json::json!({
        "device": tag, "compute_dtype": "bf16", "prefetch_ahead": 1,
        "ours": "streamed: f32 host masters (master_dtype bf16: bf16 masters, DeviceAdamW only), bf16 compute; optimizer host = CpuAdamW (f32 state, host) overlapped with backward, device = DeviceAdamW (f32 moments on the GPU) stepping the staged masters in backward_step_device",
        "pytorch": "resident bf16 weights, fused AdamW on the GPU (benches/training_torch.py, same device call)",
        "statistic": format!("median of {} steps after {} warm-up", reps.1, reps.0),
        "timing": "a step from a device synchronise to the next, with none inside it (the host runs ahead of the GPU, as under PyTorch's events); forward_ms from the warm-up steps, which synchronise after the forward",
        "cublaslt_epilogue_fallbacks": fallbacks,
        "command": "bash gpu-bundle/run.sh benches with GPU_ONLY=training (scripts/gpu-test.sh bundle)",
        "results": rows,
    });
    let plot = candle_streamer::report::svg_plot_axes(
        false,
        "streamed step / PyTorch resident (FusedMlp recompute, keep per optimizer; last: candle-nn)",
        "case",
        "ratio",
        &bars,
    );
    common::write_results(&format!("training-{tag}"), &out, Some(plot))
}
