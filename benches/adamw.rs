//! Benchmark: `CpuAdamW` against candle-nn's `AdamW` on CPU, side by side, on
//! the same f32 parameters and gradients.
//!
//! ```text
//! cargo bench --bench adamw                      # small (2^23 params), quick
//! cargo bench --bench adamw -- --full            # 1e8 params (the issue's size)
//! ADAMW_BENCH_PARAMS=100000000 cargo bench --bench adamw
//! ```
//!
//! Environment: `ADAMW_BENCH_PARAMS` (total f32 params), `ADAMW_BENCH_SHAPE`
//! (matrix shape the params are split into, default `4096x16384`, plus one
//! bias vector per matrix), `ADAMW_BENCH_ITERS` (timed steps of `CpuAdamW`,
//! default 10), `ADAMW_BENCH_CANDLE_ITERS` (timed steps of candle-nn, default
//! 3; 0 skips it), `ADAMW_BENCH_WARMUP` (default 2), `ADAMW_BENCH_OUT` (JSON
//! path, default `$BENCH_RESULTS_DIR/adamw-<host>.json`, the directory
//! defaulting to `benches/results`), `ADAMW_TORCH_JSON` (a result of
//! `benches/adamw_torch.py` to show in the summary, default
//! `$BENCH_RESULTS_DIR/adamw_torch-<host>.json` if present). Threads: rayon's
//! (`RAYON_NUM_THREADS`, default all cores).
//!
//! Reported per optimizer: median and min seconds per step, seconds per 1e8
//! params, and GB/s against the 28 bytes per param a fused step must move
//! (read p, g, m, v; write p, m, v; 4 bytes each).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use candle_streamer::streamer_autograd::CpuAdamW;
use serde_json::json;

const BYTES_PER_PARAM: f64 = 28.0;
/// PyTorch fused CPU AdamW on the GPU machine's 16-core host (issue 4).
const TORCH_FUSED_S_PER_1E8: f64 = 0.0256;

fn env_usize(key: &str, default: usize) -> Result<usize> {
    match std::env::var(key) {
        Ok(v) => {
            let v = v.replace('_', "");
            // Accept 1e8-style values too.
            let x: f64 = v.parse().with_context(|| format!("{key}={v:?}"))?;
            Ok(x as usize)
        }
        Err(_) => Ok(default),
    }
}

fn host_name() -> String {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .unwrap_or_else(|| "unknown".into());
    let s: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "unknown".into()
    } else {
        s
    }
}

/// Splits `total` params into `(rows, cols)` matrices each followed by a
/// `rows` bias vector, then a last partial matrix and vector.
fn shapes(total: usize, rows: usize, cols: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut left = total;
    while left >= rows * cols + rows {
        out.push(vec![rows, cols]);
        out.push(vec![rows]);
        left -= rows * cols + rows;
    }
    if left >= cols {
        let r = left / cols;
        out.push(vec![r, cols]);
        left -= r * cols;
    }
    if left > 0 {
        out.push(vec![left]);
    }
    out
}

struct Timing {
    name: &'static str,
    samples: Vec<f64>,
}

impl Timing {
    fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            0.5 * (s[n / 2 - 1] + s[n / 2])
        }
    }
    fn min(&self) -> f64 {
        self.samples.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

fn time_steps<O: Optimizer>(
    name: &'static str,
    opt: &mut O,
    grads: &GradStore,
    warmup: usize,
    iters: usize,
) -> Result<Timing> {
    for _ in 0..warmup {
        opt.step(grads)?;
    }
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        opt.step(grads)?;
        let dt = t.elapsed().as_secs_f64();
        eprintln!("  {name} step {i}: {dt:.4} s");
        samples.push(dt);
    }
    Ok(Timing { name, samples })
}

fn main() -> Result<()> {
    let full = std::env::args().any(|a| a == "--full");
    let total = env_usize(
        "ADAMW_BENCH_PARAMS",
        if full { 100_000_000 } else { 1 << 23 },
    )?;
    let iters = env_usize("ADAMW_BENCH_ITERS", 10)?.max(1);
    let candle_iters = env_usize("ADAMW_BENCH_CANDLE_ITERS", 3)?;
    let warmup = env_usize("ADAMW_BENCH_WARMUP", 2)?;
    let shape = std::env::var("ADAMW_BENCH_SHAPE").unwrap_or_else(|_| "4096x16384".into());
    let Some((rows, cols)) = shape.split_once('x') else {
        bail!("ADAMW_BENCH_SHAPE={shape:?}: expected ROWSxCOLS")
    };
    let (rows, cols): (usize, usize) = (rows.parse()?, cols.parse()?);
    if total == 0 || rows == 0 || cols == 0 {
        bail!("empty benchmark: {total} params, shape {rows}x{cols}")
    }
    let host = host_name();
    // Same results directory as the other benches (`$BENCH_RESULTS_DIR`).
    let dir = std::env::var("BENCH_RESULTS_DIR").unwrap_or_else(|_| "benches/results".into());
    let out =
        std::env::var("ADAMW_BENCH_OUT").unwrap_or_else(|_| format!("{dir}/adamw-{host}.json"));
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));

    let shapes = shapes(total, rows, cols);
    eprintln!(
        "adamw bench: {total} f32 params in {} tensors (matrices {rows}x{cols} + biases), {threads} threads, host {host}",
        shapes.len()
    );
    let dev = Device::Cpu;
    let mut vars = Vec::with_capacity(shapes.len());
    let mut grads = GradStore::default();
    for s in &shapes {
        let p = Var::from_tensor(&Tensor::rand(-1f32, 1f32, s.as_slice(), &dev)?)?;
        let g = Tensor::rand(-1f32, 1f32, s.as_slice(), &dev)?;
        grads.insert(p.as_tensor(), g);
        vars.push(p);
    }
    let params = ParamsAdamW {
        lr: 1e-4,
        weight_decay: 0.01,
        ..Default::default()
    };

    // Both optimizers update the same vars with the same gradients: the values
    // do not matter for throughput, and it halves the memory at 1e8 params.
    let mut timings = Vec::new();
    let mut ours = CpuAdamW::new(vars.clone(), params.clone())?;
    timings.push(time_steps("CpuAdamW", &mut ours, &grads, warmup, iters)?);
    drop(ours);
    if candle_iters > 0 {
        let mut theirs = AdamW::new(vars.clone(), params)?;
        timings.push(time_steps(
            "candle-nn AdamW",
            &mut theirs,
            &grads,
            warmup.min(1),
            candle_iters,
        )?);
    }

    let per_1e8 = |t: f64| t * 1e8 / total as f64;
    let gbs = |t: f64| BYTES_PER_PARAM * total as f64 / t / 1e9;
    let ours_med = timings[0].median();
    let speedup = timings.get(1).map(|c| c.median() / ours_med);

    // An optional PyTorch result on the same host, for the summary.
    let torch_path = std::env::var("ADAMW_TORCH_JSON")
        .unwrap_or_else(|_| format!("{dir}/adamw_torch-{host}.json"));
    let torch: Option<serde_json::Value> = std::fs::read_to_string(&torch_path)
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let torch_s_per_1e8 = torch.as_ref().and_then(|t| t["s_per_1e8"].as_f64());

    let results: Vec<_> = timings
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "samples_s": t.samples,
                "median_s": t.median(),
                "min_s": t.min(),
                "s_per_1e8_params": per_1e8(t.median()),
                "gb_per_s": gbs(t.median()),
            })
        })
        .collect();
    let report = json!({
        "bench": "adamw",
        "host": host,
        "threads": threads,
        "params": total,
        "tensors": shapes,
        "dtype": "f32",
        "bytes_per_param": BYTES_PER_PARAM,
        "warmup": warmup,
        "results": results,
        "speedup_vs_candle_nn": speedup,
        "torch": torch,
        "target_s_per_1e8_torch_fused_16_cores": TORCH_FUSED_S_PER_1E8,
    });
    if let Some(dir) = std::path::Path::new(&out).parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
    }
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {out}"))?;

    println!();
    println!("AdamW step, {total} f32 params, {threads} threads, host {host}");
    println!(
        "{:<24} {:>10} {:>10} {:>12} {:>8}",
        "optimizer", "median s", "min s", "s per 1e8", "GB/s"
    );
    for t in &timings {
        let m = t.median();
        println!(
            "{:<24} {:>10.4} {:>10.4} {:>12.4} {:>8.1}",
            t.name,
            m,
            t.min(),
            per_1e8(m),
            gbs(m)
        );
    }
    if let Some(s) = torch_s_per_1e8 {
        println!(
            "{:<24} {:>10} {:>10} {:>12.4} {:>8.1}",
            "PyTorch (adamw_torch.py)",
            "",
            "",
            s,
            BYTES_PER_PARAM * 1e8 / s / 1e9
        );
    }
    if let Some(x) = speedup {
        println!("CpuAdamW speed-up over candle-nn AdamW: {x:.1}x (target >= 10x)");
    }
    println!(
        "CpuAdamW {:.4} s per 1e8 params; target <= {TORCH_FUSED_S_PER_1E8} (PyTorch fused, 16-core H200 host)",
        per_1e8(ours_med)
    );
    println!("results written to {out}");
    Ok(())
}
