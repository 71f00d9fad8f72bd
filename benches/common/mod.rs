//! Shared by the bench binaries: device choice, timing, results files and plots.
#![allow(dead_code)]
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, VarBuilder};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use streamer_core::DeviceCap;

/// `main` of a bench that measures CUDA code only: with `--features cuda` it
/// runs the bench's `cuda::run()`; without, it prints `$without` (what
/// needs the feature) and that there is nothing to measure.
#[allow(unused_macros)]
macro_rules! cuda_only_main {
    ($without:literal) => {
        #[cfg(not(feature = "cuda"))]
        fn main() -> anyhow::Result<()> {
            println!(concat!($without, "; nothing to measure"));
            Ok(())
        }

        #[cfg(feature = "cuda")]
        fn main() -> anyhow::Result<()> {
            cuda::run()
        }
    };
}
#[allow(unused_imports)]
pub(crate) use cuda_only_main;

/// The setting `key` from the environment as a count; `default` when it is
/// unset or not a number (benches/README.md lists the settings).
pub fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The model shapes a bench names: `8b` and `70b` (Llama 3.1), `14b`
/// (Qwen2.5-14B), or a preset (`tiny`, `1b`, ...).
pub fn model_config(name: &str) -> anyhow::Result<streamer_models::LlamaConfig> {
    use streamer_models::LlamaConfig;
    Ok(match name {
        "8b" => LlamaConfig::llama31_8b(),
        "70b" => LlamaConfig::llama31_70b(),
        "14b" => LlamaConfig::qwen25_14b(),
        other => LlamaConfig::preset(other)?,
    })
}

/// The quantized base the setting `key` asks for (`nf4`, `fp4`, `int8`,
/// `fp8`); `None` when it is unset (a dense base).
pub fn quant_scheme(key: &str) -> anyhow::Result<Option<streamer_quant::QuantScheme>> {
    std::env::var(key)
        .ok()
        .map(|s| streamer_quant::QuantScheme::parse(&s).map_err(|e| anyhow::anyhow!("{key}: {e}")))
        .transpose()
}

/// The first CUDA GPU when built with `cuda` and one is present, else the CPU.
pub fn device() -> Device {
    #[cfg(feature = "cuda")]
    if let Ok(d) = Device::new_cuda_with_stream(0) {
        return d;
    }
    Device::Cpu
}

/// A short tag for file names: on a GPU `BENCH_DEVICE_TAG` (the bundle's
/// run.sh sets it from the card's name, e.g. "h100"; "h200" when unset),
/// "cpu" otherwise.
pub fn device_tag(dev: &Device) -> String {
    if dev.is_cuda() {
        std::env::var("BENCH_DEVICE_TAG").unwrap_or_else(|_| "h200".into())
    } else {
        "cpu".into()
    }
}

/// Median seconds of `iters` runs of `f` after `warmup` runs, synchronizing the
/// device before each timer starts and stops.
pub fn time_median(
    dev: &Device,
    warmup: usize,
    iters: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters {
        dev.synchronize()?;
        let s = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Where a result file goes: `$BENCH_RESULTS_DIR` or `benches/results`.
pub fn results_path(name: &str) -> PathBuf {
    let dir = std::env::var("BENCH_RESULTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("benches")
                .join("results")
        });
    let _ = std::fs::create_dir_all(&dir);
    dir.join(name)
}

/// Writes the results `out` to `<stem>.json` and, given one, the plot to
/// `<stem>.svg` (both in [`results_path`]), and says where.
pub fn write_results(
    stem: &str,
    out: &serde_json::Value,
    plot: Option<String>,
) -> anyhow::Result<()> {
    let json = write_json(&format!("{stem}.json"), out)?;
    match plot {
        Some(svg) => {
            let path = results_path(&format!("{stem}.svg"));
            std::fs::write(&path, svg)?;
            println!("wrote {} and {}", json.display(), path.display());
        }
        None => println!("wrote {}", json.display()),
    }
    Ok(())
}

/// Writes `out` as pretty JSON to the results file `name`; returns its path.
pub fn write_json(name: &str, out: &serde_json::Value) -> anyhow::Result<PathBuf> {
    let path = results_path(name);
    std::fs::write(&path, serde_json::to_string_pretty(out)?)?;
    Ok(path)
}

/// The `results` rows of the results file `name` (a peer's, such as
/// PyTorch's), none when it is missing or unreadable.
pub fn result_rows(name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(results_path(name))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["results"].as_array().cloned())
        .unwrap_or_default()
}

#[allow(unused_imports)]
pub use candle_streamer::report::svg_plot;

/// The benchmarks' block: `Linear(w,h), GELU, Linear(h,w)`, written with candle-nn.
pub fn mlp(vb: VarBuilder, w: usize, h: usize) -> candle_core::Result<impl Module> {
    let up = linear(w, h, vb.pp("up"))?;
    let down = linear(h, w, vb.pp("down"))?;
    Ok(move |x: &Tensor| down.forward(&up.forward(x)?.gelu()?))
}

/// The same block with each Linear's bias (and the GELU) fused into its GEMM
/// (`streamer_models::FusedLinear`: a cuBLASLt epilogue on CUDA).
pub fn mlp_fused(vb: VarBuilder, w: usize, h: usize) -> candle_core::Result<impl Module> {
    use streamer_models::{fused_linear, Epilogue};
    let up = fused_linear(w, h, Epilogue::BiasGelu, vb.pp("up"))?;
    let down = fused_linear(h, w, Epilogue::Bias, vb.pp("down"))?;
    Ok(move |x: &Tensor| down.forward(&up.forward(x)?))
}

/// `mlp` (`fused = false`) or `mlp_fused`, boxed so both fit one type.
pub fn mlp_block(
    vb: VarBuilder,
    w: usize,
    h: usize,
    fused: bool,
) -> candle_core::Result<impl Module> {
    let m: Box<dyn Module + Send + Sync> = if fused {
        Box::new(mlp_fused(vb, w, h)?)
    } else {
        Box::new(mlp(vb, w, h)?)
    };
    Ok(move |x: &Tensor| m.forward(x))
}

/// Random weights for `n` `mlp` blocks named `layers.{i}`, generated on `dev`
/// (fast on a GPU), returned on the host in `dtype`.
pub fn mlp_weights(
    dev: &Device,
    w: usize,
    h: usize,
    n: usize,
    dtype: DType,
) -> anyhow::Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    for i in 0..n {
        for (name, shape, std) in [
            ("up.weight", vec![h, w], 1.0 / (w as f32).sqrt()),
            ("up.bias", vec![h], 0.02),
            ("down.weight", vec![w, h], 1.0 / (h as f32).sqrt()),
            ("down.bias", vec![w], 0.02),
        ] {
            let t = Tensor::randn(0f32, std, shape, dev)?
                .to_dtype(dtype)?
                .to_device(&Device::Cpu)?;
            m.insert(format!("layers.{i}.{name}"), t);
        }
    }
    Ok(m)
}

/// Samples device memory in use on a side thread; returns the peak above `base`.
pub struct MemSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicUsize>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl MemSampler {
    pub fn start(dev: &Device) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicUsize::new(0));
        #[allow(unused_mut)]
        let mut handle = None;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = dev {
            let ctx = d.cuda_stream().context().clone();
            let (s, p) = (stop.clone(), peak.clone());
            handle = Some(std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Ok((free, total)) = ctx.mem_get_info() {
                        p.fetch_max(total - free, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            }));
        }
        let _ = dev;
        Self { stop, peak, handle }
    }

    pub fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

pub fn used_now(dev: &Device) -> usize {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        if let Ok((free, total)) = d.cuda_stream().context().mem_get_info() {
            return total - free;
        }
    }
    let _ = dev;
    0
}

/// Resident and peak resident host memory of this process (`VmRSS`, `VmHWM`), bytes.
pub fn host_rss() -> (usize, usize) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |key: &str| -> usize {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (get("VmRSS:"), get("VmHWM:"))
}

/// The learning rate of a training bench's `steps` steps: a linear warm-up to
/// `peak` over all of them (a bench runs too few steps for a decay to matter,
/// and without a warm-up the first AdamW steps at full rate make the printed
/// loss jump up before it falls).
pub fn bench_schedule(peak: f64, steps: usize) -> streamer_models::LrSchedule {
    streamer_models::LrSchedule {
        peak,
        warmup: steps,
        decay: streamer_models::Decay::Constant,
        steps,
    }
}

/// Holds back all of `dev`'s memory beyond `cap` bytes in use
/// (`streamer_core::DeviceCap`; nothing on the CPU, or with `cap` = None).
pub fn cap_device_memory(dev: &Device, cap: Option<usize>) -> anyhow::Result<DeviceCap> {
    Ok(match cap {
        Some(c) if dev.is_cuda() => DeviceCap::hold(dev, c)?,
        _ => DeviceCap::none(),
    })
}
