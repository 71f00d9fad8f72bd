//! Streaming benchmark: bf16 MLP blocks `Linear(w,h), GELU, Linear(h,w)` run
//! streamed (prefetch_ahead = 1) against all-resident Candle, plus the pinned
//! H2D bandwidth measured in the same run.
//!
//!     cargo bench --bench streaming [--features cuda]
//!
//! Writes `benches/results/streaming-<device>.json` and `.svg` (streamed/resident
//! ratio against tokens). On the CPU it runs small shapes only, as a smoke test.
#[path = "common/mod.rs"]
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

/// Samples device memory in use on a side thread; returns the peak above `base`.
struct MemSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicUsize>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl MemSampler {
    fn start(dev: &Device) -> Self {
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

    fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

fn used_now(dev: &Device) -> usize {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        if let Ok((free, total)) = d.cuda_stream().context().mem_get_info() {
            return total - free;
        }
    }
    let _ = dev;
    0
}

/// Where a block's time goes in plain Candle (no streaming): each op of
/// `Linear(w,h), GELU, Linear(h,w)` timed alone, bf16, plus a Chrome trace of a
/// streamed call. `STREAMING_PROFILE=w,h,tokens` (e.g. `1024,2560,8192`).
fn profile(dev: &Device, tag: &str, spec: &str) -> Result<()> {
    let v: Vec<usize> = spec
        .split(',')
        .map(|x| x.trim().parse())
        .collect::<Result<_, _>>()?;
    let (w, h, t) = (v[0], v[1], v[2]);
    let bf = |shape: &[usize], std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, shape, dev)?.to_dtype(DType::BF16)?)
    };
    let (x, w1, b1, w2) = (
        bf(&[t, w], 1.0)?,
        bf(&[h, w], 0.03)?,
        bf(&[h], 0.02)?,
        bf(&[w, h], 0.02)?,
    );
    let w1t = w1.t()?.contiguous()?;
    let y1 = x.matmul(&w1.t()?)?;
    let g = y1.gelu()?;
    let mut rows = Vec::new();
    let mut time = |name: &str, f: &mut dyn FnMut() -> candle_core::Result<Tensor>| -> Result<()> {
        let ms = common::time_median(dev, 5, 50, || {
            f()?;
            Ok(())
        })? * 1e3;
        let flops = if name.contains("matmul") {
            2.0 * (t * w * h) as f64
        } else {
            0.0
        };
        println!(
            "profile w{w} h{h} tokens {t}: {name:<40} {ms:8.4} ms  {:7.1} TFLOP/s",
            flops / ms / 1e9
        );
        rows.push(serde_json::json!({ "op": name, "ms": ms, "tflops": flops / ms / 1e9 }));
        Ok(())
    };
    time("matmul x @ w1^T (transposed view)", &mut || {
        x.matmul(&w1.t()?)
    })?;
    time("matmul x @ w1t (contiguous)", &mut || x.matmul(&w1t))?;
    time("broadcast_add bias", &mut || y1.broadcast_add(&b1))?;
    time("gelu", &mut || y1.gelu())?;
    time("matmul g @ w2^T (transposed view)", &mut || {
        g.matmul(&w2.t()?)
    })?;
    let vb = VarBuilder::from_tensors(
        [
            ("up.weight", w1.clone()),
            ("up.bias", b1.clone()),
            ("down.weight", w2.clone()),
            ("down.bias", bf(&[w], 0.02)?),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
        DType::BF16,
        dev,
    );
    let block = common::mlp(vb, w, h)?;
    time("whole block (candle-nn Linear, GELU, Linear)", &mut || {
        block.forward(&x)
    })?;
    let out = common::results_path(&format!("streaming-profile-{tag}.json"));
    std::fs::write(
        &out,
        serde_json::to_string_pretty(
            &serde_json::json!({ "w": w, "h": h, "tokens": t, "ops": rows }),
        )?,
    )?;
    println!("wrote {}", out.display());
    Ok(())
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    let gpu = dev.is_cuda();
    if let Ok(spec) = std::env::var("STREAMING_PROFILE") {
        return profile(&dev, &tag, &spec);
    }
    // (w, h, blocks, token counts)
    let configs: Vec<(usize, usize, usize, Vec<usize>)> = if gpu {
        vec![
            (1024, 2560, 6, vec![32, 2048, 8192, 32768]),
            (4096, 16384, 8, vec![32, 2048, 8192, 32768]),
            (8192, 32768, 4, vec![32768]),
        ]
    } else {
        vec![(128, 256, 4, vec![32, 256]), (256, 512, 3, vec![64])]
    };
    let iters = if gpu { 15 } else { 5 };
    let bw_bytes = if gpu { 512 << 20 } else { 64 << 20 };
    let h2d_gbps = streamer_core::measure_h2d_gbps(&dev, bw_bytes, 10)?;
    println!(
        "device {tag}: pinned H2D bandwidth {h2d_gbps:.1} GB/s ({} MiB copies)",
        bw_bytes >> 20
    );

    let mut rows = Vec::new();
    let mut series = Vec::new();
    for (w, h, n, tokens) in configs {
        let host = common::mlp_weights(&dev, w, h, n, DType::BF16)?;
        let bytes: usize = host.values().map(|t| t.elem_count() * 2).sum();
        let blocks: Vec<BlockSpec> = (0..n)
            .map(|i| BlockSpec::module(format!("layers.{i}"), move |vb| common::mlp(vb, w, h)))
            .collect();
        let base = used_now(&dev);
        let mut points = Vec::new();
        for &t in &tokens {
            let x = Tensor::randn(0f32, 1.0, (t, w), &dev)?.to_dtype(DType::BF16)?;
            // All-resident Candle: weights on the device, the same block code.
            let (resident_ms, resident_peak) = {
                let on_dev: HashMap<String, Tensor> = host
                    .iter()
                    .map(|(k, v)| Ok((k.clone(), v.to_device(&dev)?)))
                    .collect::<Result<_>>()?;
                let vb = VarBuilder::from_tensors(on_dev, DType::BF16, &dev);
                let mods: Vec<_> = (0..n)
                    .map(|i| common::mlp(vb.pp(format!("layers.{i}")), w, h))
                    .collect::<candle_core::Result<_>>()?;
                let sampler = MemSampler::start(&dev);
                let s = common::time_median(&dev, 3, iters, || {
                    let mut y = x.clone();
                    for m in &mods {
                        y = m.forward(&y)?;
                    }
                    Ok(())
                })?;
                (s * 1e3, sampler.finish().saturating_sub(base))
            };
            dev.synchronize()?;
            let cfg = StreamConfig {
                device: dev.clone(),
                prefetch_ahead: 1,
                dtype: DType::BF16,
                prefetch_across_calls: true,
                ..Default::default()
            };
            let model = StreamedSequential::from_tensors(host.clone(), blocks.clone(), cfg)?;
            let sampler = MemSampler::start(&dev);
            let streamed_ms = common::time_median(&dev, 3, iters, || {
                model.forward(&x)?;
                Ok(())
            })? * 1e3;
            let streamed_peak = sampler.finish().saturating_sub(base);
            model.reset_stats()?;
            model.forward(&x)?;
            let st = model.stats()?;
            let isolated_ms = bytes as f64 / (h2d_gbps * 1e9) * 1e3;
            let ratio = streamed_ms / resident_ms;
            let overlap = 1.0 - (streamed_ms - resident_ms) / isolated_ms;
            let achieved = bytes as f64 / (streamed_ms / 1e3) / 1e9;
            println!(
                "w{w} h{h} x{n} ({:.0} MiB) tokens {t:>6}: resident {resident_ms:8.3} ms  streamed {streamed_ms:8.3} ms  \
                 ratio {ratio:5.3}  H2D floor {isolated_ms:7.3} ms (streamed/floor {:.3})  achieved {achieved:5.1} GB/s  \
                 overlap {overlap:5.3}  stall {:.3} ms  peak mem resident {:.0} MiB / streamed {:.0} MiB",
                bytes as f64 / 1048576.0,
                streamed_ms / isolated_ms,
                st.stall_seconds * 1e3,
                resident_peak as f64 / 1048576.0,
                streamed_peak as f64 / 1048576.0,
            );
            points.push((t as f64, ratio));
            rows.push(serde_json::json!({
                "w": w, "h": h, "blocks": n, "tokens": t, "weight_bytes": bytes,
                "resident_ms": resident_ms, "streamed_ms": streamed_ms, "ratio": ratio,
                "h2d_floor_ms": isolated_ms, "streamed_over_floor": streamed_ms / isolated_ms,
                "achieved_h2d_gbps": achieved, "overlap_score": overlap,
                "stall_ms_per_call": st.stall_seconds * 1e3,
                "peak_device_bytes_resident": resident_peak, "peak_device_bytes_streamed": streamed_peak,
                "slot_bytes": st.slot_bytes,
            }));
            drop(model);
            dev.synchronize()?;
        }
        series.push((format!("w{w} h{h} x{n}"), points));
    }
    let out = serde_json::json!({
        "device": tag, "dtype": "bf16", "prefetch_ahead": 1, "prefetch_across_calls": true,
        "iterations": iters, "statistic": "median after 3 warm-up calls",
        "h2d_gbps_pinned": h2d_gbps, "command": "cargo bench --bench streaming --features cuda (scripts/gpu-test.sh bundle)",
        "peak_memory_note": "device memory in use sampled every 200 us on a side thread, above the baseline before the run (0 on CPU)",
        "results": rows,
    });
    let json = common::results_path(&format!("streaming-{tag}.json"));
    std::fs::write(&json, serde_json::to_string_pretty(&out)?)?;
    let svg = common::results_path(&format!("streaming-{tag}.svg"));
    std::fs::write(
        &svg,
        common::svg_plot(
            "streamed / resident time (bf16, prefetch 1)",
            "tokens",
            "ratio",
            &series,
        ),
    )?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(())
}
