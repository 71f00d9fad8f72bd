//! Soak: a small streamed MLP trained for many steps (forward, MSE against a
//! fixed target, backward through the pool, `CpuAdamW`, and a checkpoint of
//! weights and optimizer state every `checkpoint_every` steps), sampling host
//! RSS (`/proc/self/statm`) and device memory as it goes.
//!
//! What counts (the criterion): the growth, from the first sample after the
//! warm-up to the last, of host RSS and of the device memory held at a step
//! boundary (`device_live`: the driver's used memory minus the idle
//! reservation of CUDA's stream-ordered pool), each under a stated fraction;
//! a leak of a few bytes a step shows over a long run. Reported beside it and
//! not counted: the driver's used memory (`device_used`, the pool's idle
//! reservation included), the pool's reservation and, per sampling interval,
//! the pool's peak demand (the most bytes live allocations held at any
//! moment), and the growth of each over the warm-up. The pool's reservation is
//! a cache: `StreamConfig::retain_device_memory` sets its release threshold
//! to "never", so it is the high-water mark of demand plus the allocator's
//! fragmentation, and it can step up once, late, when a step first finds no
//! free block of the size it asks for (on the H200, +32 MiB, one (4096, 4096)
//! bf16 activation, at step 450 of 10,000), without any memory being held
//! longer. `benches/soak.rs` runs it long (10,000 steps on CUDA, 1,200 on the
//! CPU) and writes `benches/results/soak-<device>.json`; the test here runs a
//! reduced form.
#![allow(dead_code)]

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use std::time::Instant;
use streamer_autograd::{CpuAdamW, Train, TrainableSequential};
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
    /// A checkpoint (weights and optimizer state, saved atomically) after
    /// every this many steps; 0: none. Keep it at most the warm-up, so that
    /// the first save's allocations are in the baseline.
    pub checkpoint_every: usize,
}

impl SoakOptions {
    /// The defaults for `dev`: on CUDA 10,000 steps of 4 blocks w512 h2048
    /// at 1024 tokens (bf16 compute, f32 masters; small enough that a step
    /// is a few milliseconds, so the run takes a minute or two), the first
    /// 600 warm-up, a checkpoint every 500 steps; on the CPU 1,200 steps of 4
    /// blocks w256 h1024 at 32 rows (f32, 2.1 M parameters: masters, moments
    /// and gradients are most of the RSS, as in real training), the first 300
    /// warm-up (the allocator's footprint there settles after 100-250 steps),
    /// a checkpoint every 200 steps.
    pub fn for_device(dev: &Device) -> Self {
        if dev.is_cuda() {
            Self {
                steps: 10_000,
                warmup: 600,
                sample_every: 50,
                width: 512,
                hidden: 2048,
                blocks: 4,
                batch: 1024,
                checkpoint_every: 500,
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
                checkpoint_every: 200,
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
    /// Bytes CUDA's default pool has reserved (0 on the CPU).
    pub pool_reserved_bytes: usize,
    /// The most bytes the pool's live allocations held at any moment since the
    /// previous sample (0 on the CPU).
    pub pool_peak_bytes: usize,
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
    pub checkpoints: usize,
    /// From the first sample after the warm-up to the last (the criterion's
    /// span).
    pub host_rss: Growth,
    pub device_used: Growth,
    pub device_live: Growth,
    pub pool_reserved: Growth,
    pub pool_peak: Growth,
    /// The same measures over the warm-up: from the first sample to the
    /// first sample after it.
    pub warmup_growth: Vec<(&'static str, Growth)>,
    pub loss_first: f32,
    pub loss_last: f32,
    pub samples: Vec<Sample>,
}

/// The measures the criterion counts, and why the others are not counted.
pub const CRITERION: &str = "growth from the first sample after the warm-up to the last of host RSS and of device memory held at step boundaries (device_live: the driver's used memory minus the idle reservation of CUDA's stream-ordered pool); the driver's used memory (device_used) includes that reservation, a cache that retain_device_memory never releases and that can step up once to a new high-water mark of demand plus fragmentation: reported, with the pool's reservation and its peak demand per sampling interval, and not counted";

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
                    "pool_reserved_bytes": s.pool_reserved_bytes, "pool_peak_bytes": s.pool_peak_bytes,
                })
            })
            .collect();
        let warmup: serde_json::Map<String, serde_json::Value> = self
            .warmup_growth
            .iter()
            .map(|(k, g)| (k.to_string(), g.to_json()))
            .collect();
        serde_json::json!({
            "steps": self.steps, "warmup_steps": self.warmup, "seconds": self.seconds,
            "checkpoints": self.checkpoints,
            "criterion": CRITERION,
            "host_rss": self.host_rss.to_json(), "device_used": self.device_used.to_json(),
            "device_live": self.device_live.to_json(),
            "pool_reserved": self.pool_reserved.to_json(), "pool_peak_demand": self.pool_peak.to_json(),
            "warmup_growth": warmup,
            "worst_growth_frac": self.worst_growth(), "raw_worst_growth_frac": self.raw_worst_growth(),
            "loss_first": self.loss_first, "loss_last": self.loss_last, "samples": samples,
        })
    }

    /// The criterion: the larger growth (last over first, after the warm-up)
    /// of host RSS and of device memory held at step boundaries.
    pub fn worst_growth(&self) -> f64 {
        self.host_rss.growth_frac.max(self.device_live.growth_frac)
    }

    /// The largest growth of every measure, the driver's used memory and the
    /// pool's figures included (reported, not the criterion).
    pub fn raw_worst_growth(&self) -> f64 {
        [
            &self.host_rss,
            &self.device_used,
            &self.device_live,
            &self.pool_reserved,
            &self.pool_peak,
        ]
        .iter()
        .map(|g| g.growth_frac)
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

/// The streamed model and its optimizer (state named after the weights, as a
/// checkpoint needs).
fn model(dev: &Device, o: &SoakOptions, compute: DType) -> Result<(TrainableSequential, CpuAdamW)> {
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
    opt.set_param_names(model.parameters().into_iter().map(|(n, _)| n).collect())?;
    Ok((model, opt))
}

/// One sample at step `s`, after the step's tensors are gone and the device
/// is idle; resets the pool's peak so the next sample's is its interval's.
fn sample(dev: &Device, s: usize, seconds: f64, loss: f32) -> Result<Sample> {
    dev.synchronize()?;
    let (used, live) = device_bytes(dev)?;
    let pool = streamer_core::device_pool_stats(dev)?.unwrap_or_default();
    streamer_core::reset_device_pool_peaks(dev)?;
    Ok(Sample {
        step: s,
        seconds,
        loss,
        host_rss_bytes: host_rss_bytes(),
        device_used_bytes: used,
        device_live_bytes: live,
        pool_reserved_bytes: pool.reserved,
        pool_peak_bytes: pool.used_peak,
    })
}

/// Saves the weights and the optimizer state into `dir` (each atomically,
/// over the previous checkpoint), as a training run does.
fn checkpoint(model: &TrainableSequential, opt: &CpuAdamW, dir: &std::path::Path) -> Result<()> {
    model
        .inner()
        .save_safetensors(dir.join("model.safetensors"))?;
    opt.save(dir.join("optimizer.safetensors"))?;
    Ok(())
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
    let (model, mut opt) = model(dev, o, compute)?;
    let dir = std::env::temp_dir().join(format!("streamer-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let x = Tensor::randn(0f32, 1.0, (o.batch, o.width), dev)?.to_dtype(compute)?;
    let target = Tensor::randn(0f32, 0.5, (o.batch, o.width), dev)?;
    let t0 = Instant::now();
    let (mut samples, mut checkpoints) = (Vec::new(), 0);
    for s in 0..o.steps {
        let is_sample = s % o.sample_every == 0 || s + 1 == o.steps;
        // The step's tensors live in this block: gone before a sample.
        let loss = {
            let y = model.forward(&x)?.to_dtype(DType::F32)?;
            let loss = y.sub(&target)?.sqr()?.mean_all()?;
            let grads = model.backward(&loss)?;
            opt.step(&grads)?;
            model.zero_grad()?;
            if is_sample {
                loss.to_scalar::<f32>()?
            } else {
                f32::NAN
            }
        };
        if o.checkpoint_every > 0 && (s + 1) % o.checkpoint_every == 0 {
            checkpoint(&model, &opt, &dir)?;
            checkpoints += 1;
        }
        if is_sample {
            let sample = sample(dev, s, t0.elapsed().as_secs_f64(), loss)?;
            on_sample(&sample);
            samples.push(sample);
        }
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(report(o, t0.elapsed().as_secs_f64(), checkpoints, samples))
}

/// A measure of the samples, by name.
type Measure = (&'static str, fn(&Sample) -> usize);

/// The growth figures of a run's samples.
fn report(o: &SoakOptions, seconds: f64, checkpoints: usize, samples: Vec<Sample>) -> SoakReport {
    let counted: Vec<&Sample> = samples.iter().filter(|s| s.step >= o.warmup).collect();
    // The warm-up's span: the first sample to the first counted one.
    let warm: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.step <= counted.first().map_or(0, |c| c.step))
        .collect();
    let of = |set: &[&Sample], f: fn(&Sample) -> usize| {
        Growth::of(&set.iter().map(|s| f(s)).collect::<Vec<_>>())
    };
    let measures: [Measure; 5] = [
        ("host_rss", |s| s.host_rss_bytes),
        ("device_used", |s| s.device_used_bytes),
        ("device_live", |s| s.device_live_bytes),
        ("pool_reserved", |s| s.pool_reserved_bytes),
        ("pool_peak_demand", |s| s.pool_peak_bytes),
    ];
    let [rss, used, live, reserved, peak] = measures.map(|(_, f)| of(&counted, f));
    SoakReport {
        steps: o.steps,
        warmup: o.warmup,
        seconds,
        checkpoints,
        host_rss: rss,
        device_used: used,
        device_live: live,
        pool_reserved: reserved,
        pool_peak: peak,
        warmup_growth: measures.iter().map(|&(k, f)| (k, of(&warm, f))).collect(),
        loss_first: samples.first().map_or(f32::NAN, |s| s.loss),
        loss_last: samples.last().map_or(f32::NAN, |s| s.loss),
        samples,
    }
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
        checkpoint_every: 50,
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

/// The reduced soak CI runs, in a child process: 300 steps of a tiny model
/// with a checkpoint every 50, the 100 after a warm-up of 200 counted (the CPU
/// allocator's footprint settles after about 180 steps in a debug build), on
/// the CPU (and on CUDA under the same macro). Bounds in bytes, since the run
/// is short: host RSS grows under 256 KiB (a leak of 2.6 KiB a step breaks
/// it), the device memory held at step boundaries under 1 MiB; and the loss
/// falls (the run really trains).
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
    // v[1], the driver's used memory, includes the pool's idle reservation
    // (see the module docs): printed by the child, not bounded.
    ensure!(v[2] < (1 << 20) as f64, "device memory held grew: {line}");
    ensure!(v[4] < v[3], "the loss did not fall ({} -> {})", v[3], v[4]);
    Ok(())
}
candle_streamer::test_device!(soak_short_run_keeps_memory_flat);
