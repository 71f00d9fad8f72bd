//! Soak: a small streamed MLP trained for many steps (forward, MSE against a
//! fixed target, backward through the pool, `CpuAdamW`), sampling host RSS
//! (`/proc/self/statm`) and device memory as it goes; what counts is the
//! growth from the first sample after warm-up to the last, which must stay
//! under a stated fraction (a leak of a few bytes a step shows over a long
//! run). `benches/soak.rs` runs it long (10,000 steps on CUDA, 1,200 on the CPU)
//! and writes `benches/results/soak-<device>.json`; the test here runs a
//! reduced form.
#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use std::time::Instant;
use streamer_autograd::{CpuAdamW, Train};
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

/// What to train and for how long.
#[derive(Clone, Debug)]
pub struct SoakOptions {
    pub steps: usize,
    /// Steps before the first sample that counts.
    pub warmup: usize,
    /// A sample every this many steps (and at the last step).
    pub sample_every: usize,
    pub width: usize,
    pub hidden: usize,
    pub blocks: usize,
    pub batch: usize,
}

impl SoakOptions {
    /// The defaults for `dev`: on CUDA 10,000 steps of 4 blocks w1024 h4096 at
    /// 4096 tokens (bf16 compute, f32 masters), the first 200 warm-up; on the
    /// CPU 1,200 steps of 4 blocks w256 h1024 at 32 rows (f32, 2.1 M
    /// parameters: masters, moments and gradients are most of the RSS, as in
    /// real training), the first 300
    /// warm-up (the allocator's footprint there settles after 100-250 steps).
    pub fn for_device(dev: &Device) -> Self {
        if dev.is_cuda() {
            Self {
                steps: 10_000,
                warmup: 200,
                sample_every: 50,
                width: 1024,
                hidden: 4096,
                blocks: 4,
                batch: 4096,
            }
        } else {
            Self {
                steps: 1200,
                warmup: 300,
                sample_every: 10,
                width: 256,
                hidden: 1024,
                blocks: 4,
                batch: 32,
            }
        }
    }
}

/// One sample of the run.
#[derive(Clone, Debug)]
pub struct Sample {
    pub step: usize,
    pub seconds: f64,
    pub loss: f32,
    /// Resident host memory of the process.
    pub host_rss_bytes: usize,
    /// Device memory in use as the driver sees it (CUDA's pool included).
    pub device_used_bytes: usize,
    /// Device memory held by live tensors (the pool's idle memory excluded).
    pub device_live_bytes: usize,
}

/// Growth of one measure over the counted samples.
#[derive(Clone, Debug)]
pub struct Growth {
    pub first: usize,
    pub last: usize,
    pub max: usize,
    /// `(last - first) / first` (0 when `first` is 0: nothing on that device).
    pub growth_frac: f64,
    /// `(max - first) / first`.
    pub peak_growth_frac: f64,
}

impl Growth {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "first_bytes": self.first, "last_bytes": self.last, "max_bytes": self.max,
            "growth_frac": self.growth_frac, "peak_growth_frac": self.peak_growth_frac,
        })
    }

    fn of(values: &[usize]) -> Self {
        let first = values.first().copied().unwrap_or(0);
        let last = values.last().copied().unwrap_or(0);
        let max = values.iter().copied().max().unwrap_or(0);
        let frac = |x: usize| {
            if first == 0 {
                0.0
            } else {
                (x as f64 - first as f64) / first as f64
            }
        };
        Self {
            first,
            last,
            max,
            growth_frac: frac(last),
            peak_growth_frac: frac(max),
        }
    }
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct SoakReport {
    pub steps: usize,
    pub warmup: usize,
    pub seconds: f64,
    pub host_rss: Growth,
    pub device_used: Growth,
    pub device_live: Growth,
    pub loss_first: f32,
    pub loss_last: f32,
    pub samples: Vec<Sample>,
}

impl SoakReport {
    pub fn to_json(&self) -> serde_json::Value {
        let samples: Vec<serde_json::Value> = self
            .samples
            .iter()
            .map(|s| {
                serde_json::json!({
                    "step": s.step, "seconds": s.seconds, "loss": s.loss,
                    "host_rss_bytes": s.host_rss_bytes, "device_used_bytes": s.device_used_bytes,
                    "device_live_bytes": s.device_live_bytes,
                })
            })
            .collect();
        serde_json::json!({
            "steps": self.steps, "warmup_steps": self.warmup, "seconds": self.seconds,
            "host_rss": self.host_rss.to_json(), "device_used": self.device_used.to_json(),
            "device_live": self.device_live.to_json(), "worst_growth_frac": self.worst_growth(),
            "loss_first": self.loss_first, "loss_last": self.loss_last, "samples": samples,
        })
    }

    /// The largest growth (last over first) of host RSS and device memory.
    pub fn worst_growth(&self) -> f64 {
        [
            self.host_rss.growth_frac,
            self.device_used.growth_frac,
            self.device_live.growth_frac,
        ]
        .into_iter()
        .fold(f64::MIN, f64::max)
    }
}

/// Resident bytes of this process: the second field of `/proc/self/statm`
/// (pages) times the OS page size; 0 where there is no `/proc`.
pub fn host_rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * streamer_core::pages::page_size())
}

/// `(used as the driver sees it, held by live tensors)` on `dev`; zeros on the CPU.
pub fn device_bytes(dev: &Device) -> Result<(usize, usize)> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let (free, total) = d.cuda_stream().context().mem_get_info()?;
        let available = streamer_core::free_device_memory(dev)?.unwrap_or(free);
        return Ok((total - free, total.saturating_sub(available)));
    }
    let _ = dev;
    Ok((0, 0))
}

fn weights(o: &SoakOptions, dtype: DType) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    let (w, h) = (o.width, o.hidden);
    for i in 0..o.blocks {
        for (name, shape, std) in [
            ("up.weight", vec![h, w], 1.0 / (w as f32).sqrt()),
            ("up.bias", vec![h], 0.02),
            ("down.weight", vec![w, h], 1.0 / (h as f32).sqrt()),
            ("down.bias", vec![w], 0.02),
        ] {
            let t = Tensor::randn(0f32, std, shape, &Device::Cpu)?.to_dtype(dtype)?;
            m.insert(format!("layers.{i}.{name}"), t);
        }
    }
    Ok(m)
}

/// Trains as `o` says on `dev`, sampling memory; `on_sample` sees each sample.
pub fn run(
    dev: &Device,
    o: &SoakOptions,
    mut on_sample: impl FnMut(&Sample),
) -> Result<SoakReport> {
    ensure!(
        o.steps > o.warmup,
        "soak: {} steps do not outlast a warm-up of {}",
        o.steps,
        o.warmup
    );
    let compute = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let (w, h) = (o.width, o.hidden);
    let blocks = (0..o.blocks)
        .map(|i| {
            BlockSpec::module(format!("layers.{i}"), move |vb: VarBuilder| {
                let up = linear(w, h, vb.pp("up"))?;
                let down = linear(h, w, vb.pp("down"))?;
                Ok(move |x: &Tensor| down.forward(&up.forward(x)?.gelu()?))
            })
        })
        .collect();
    let cfg = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: 1,
        dtype: compute,
        master_dtype: Some(DType::F32),
        ..Default::default()
    };
    let model = StreamedSequential::from_tensors(weights(o, DType::F32)?, blocks, cfg)?.train();
    let params = ParamsAdamW {
        lr: 1e-3,
        ..Default::default()
    };
    let mut opt = CpuAdamW::new(model.trainable_vars()?, params)?;
    let x = Tensor::randn(0f32, 1.0, (o.batch, w), dev)?.to_dtype(compute)?;
    let target = Tensor::randn(0f32, 0.5, (o.batch, w), dev)?;
    let t0 = Instant::now();
    let mut samples = Vec::new();
    for s in 0..o.steps {
        let y = model.forward(&x)?.to_dtype(DType::F32)?;
        let loss = y.sub(&target)?.sqr()?.mean_all()?;
        let grads = model.backward(&loss)?;
        opt.step(&grads)?;
        model.zero_grad()?;
        if s % o.sample_every == 0 || s + 1 == o.steps {
            let loss = loss.to_scalar::<f32>()?;
            dev.synchronize()?;
            let (used, live) = device_bytes(dev)?;
            let sample = Sample {
                step: s,
                seconds: t0.elapsed().as_secs_f64(),
                loss,
                host_rss_bytes: host_rss_bytes(),
                device_used_bytes: used,
                device_live_bytes: live,
            };
            on_sample(&sample);
            samples.push(sample);
        }
    }
    let counted: Vec<&Sample> = samples.iter().filter(|s| s.step >= o.warmup).collect();
    let of =
        |f: fn(&Sample) -> usize| Growth::of(&counted.iter().map(|s| f(s)).collect::<Vec<_>>());
    Ok(SoakReport {
        steps: o.steps,
        warmup: o.warmup,
        seconds: t0.elapsed().as_secs_f64(),
        host_rss: of(|s| s.host_rss_bytes),
        device_used: of(|s| s.device_used_bytes),
        device_live: of(|s| s.device_live_bytes),
        loss_first: samples.first().map_or(f32::NAN, |s| s.loss),
        loss_last: samples.last().map_or(f32::NAN, |s| s.loss),
        samples,
    })
}

/// Set in the child's environment: the device the reduced soak runs on.
const CHILD_DEVICE: &str = "STREAMER_SOAK_CHILD_DEVICE";
/// This module's child-mode test, as libtest names it.
const CHILD_TEST: &str = "soak::soak_child_mode";

fn reduced() -> SoakOptions {
    SoakOptions {
        steps: 300,
        warmup: 200,
        sample_every: 10,
        width: 32,
        hidden: 64,
        blocks: 4,
        batch: 16,
    }
}

/// Child mode: does nothing unless `STREAMER_SOAK_CHILD_DEVICE` is set. Then it
/// runs the reduced soak on that device (`cpu` or `cuda`) alone in its process
/// (RSS is per process; the other tests' allocations would blur it) and prints
/// `SOAK-RESULT <host RSS growth> <device used growth> <device live growth>
/// <first loss> <last loss>` (bytes).
#[test]
fn soak_child_mode() -> Result<()> {
    let Ok(which) = std::env::var(CHILD_DEVICE) else {
        return Ok(());
    };
    let dev = match which.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => candle_streamer::test_utils::cuda_device()?,
        "cpu" => Device::Cpu,
        other => anyhow::bail!("{CHILD_DEVICE}={other:?}: not a device of this build"),
    };
    let r = run(&dev, &reduced(), |_| {})?;
    let grew = |g: &Growth| g.last as i64 - g.first as i64;
    println!(
        "SOAK-RESULT {} {} {} {} {}",
        grew(&r.host_rss),
        grew(&r.device_used),
        grew(&r.device_live),
        r.loss_first,
        r.loss_last
    );
    Ok(())
}

/// The reduced soak CI runs, in a child process: 300 steps of a tiny model,
/// the 100 after a warm-up of 200 counted (the CPU allocator's footprint
/// settles after about 180 steps in a debug build), on the CPU (and on CUDA
/// under the same macro). Bounds in bytes, since the run is short: host RSS
/// grows under 256 KiB (a leak of 2.6 KiB a step breaks it), device memory
/// under 1 MiB; and the loss falls (the run really trains).
fn soak_short_run_keeps_memory_flat(dev: &Device) -> Result<()> {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(&exe)
        .args([
            CHILD_TEST,
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env(CHILD_DEVICE, if dev.is_cuda() { "cuda" } else { "cpu" })
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find_map(|l| l.strip_prefix("SOAK-RESULT "));
    let Some(line) = line else {
        anyhow::bail!(
            "the soak child printed no result (status {}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let v: Vec<f64> = line
        .split_whitespace()
        .map(|x| x.parse::<f64>())
        .collect::<std::result::Result<_, _>>()?;
    ensure!(v.len() == 5, "soak result {line:?}");
    ensure!(
        v[0] < (256 << 10) as f64,
        "host RSS grew {} bytes over 100 steps",
        v[0]
    );
    ensure!(
        v[1] < (1 << 20) as f64 && v[2] < (1 << 20) as f64,
        "device memory grew: {line}"
    );
    ensure!(v[4] < v[3], "the loss did not fall ({} -> {})", v[3], v[4]);
    Ok(())
}
candle_streamer::test_device!(soak_short_run_keeps_memory_flat);
