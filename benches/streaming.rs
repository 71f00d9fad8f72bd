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
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

/// Where a block's time goes in plain Candle (no streaming): each op of
/// `Linear(w,h), GELU, Linear(h,w)` timed alone, bf16, and the whole block.
/// `STREAMING_PROFILE=w,h,tokens[;w,h,tokens...]` (e.g. `1024,2560,8192`).
fn profile(dev: &Device, spec: &str, pool: &str) -> Result<Vec<serde_json::Value>> {
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
            "profile w{w} h{h} tokens {t} ({pool}): {name:<40} {ms:8.4} ms  {:7.1} TFLOP/s",
            flops / ms / 1e9
        );
        rows.push(serde_json::json!({
            "w": w, "h": h, "tokens": t, "pool": pool, "op": name, "ms": ms, "tflops": flops / ms / 1e9,
        }));
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
    let block = common::mlp(vb.clone(), w, h)?;
    time("whole block (candle-nn Linear, GELU, Linear)", &mut || {
        block.forward(&x)
    })?;
    let fused = common::mlp_fused(vb, w, h)?;
    time(
        "whole block fused (cuBLASLt bias/GELU epilogues)",
        &mut || fused.forward(&x),
    )?;
    Ok(rows)
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    let gpu = dev.is_cuda();
    if let Ok(spec) = std::env::var("STREAMING_PROFILE") {
        // Once with CUDA's default pool (freed memory handed back at every
        // synchronisation), once keeping it, as the streamed model does.
        // Several shapes separated by ';'.
        let mut rows = Vec::new();
        for one in spec.split(';') {
            rows.extend(profile(&dev, one, "default pool")?);
        }
        streamer_core::retain_freed_device_memory(&dev)?;
        for one in spec.split(';') {
            rows.extend(profile(&dev, one, "retained pool")?);
        }
        let out = common::results_path(&format!("streaming-profile-{tag}.json"));
        std::fs::write(&out, serde_json::to_string_pretty(&rows)?)?;
        println!("wrote {}", out.display());
        return Ok(());
    }
    // Resident and streamed runs use the same allocator setting: freed device
    // memory stays in CUDA's pool (StreamConfig::retain_device_memory, on by
    // default). STREAMING_RETAIN=0 measures both with CUDA's default instead.
    let retain = std::env::var("STREAMING_RETAIN").map_or(true, |v| v != "0");
    if retain {
        streamer_core::retain_freed_device_memory(&dev)?;
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

    // Block code: candle-nn's Linear + GELU, and/or the fused variant
    // (STREAMING_BLOCKS=candle,fused; both by default).
    let kinds: Vec<bool> = std::env::var("STREAMING_BLOCKS")
        .unwrap_or_else(|_| "candle,fused".into())
        .split(',')
        .map(|k| match k.trim() {
            "candle" => Ok(false),
            "fused" => Ok(true),
            other => anyhow::bail!("STREAMING_BLOCKS: unknown block {other:?} (candle, fused)"),
        })
        .collect::<Result<_>>()?;
    let mut rows = Vec::new();
    let mut series = Vec::new();
    for (w, h, n, tokens) in configs {
        let host = common::mlp_weights(&dev, w, h, n, DType::BF16)?;
        let bytes: usize = host.values().map(|t| t.elem_count() * 2).sum();
        for &fused in &kinds {
            let kind = if fused { "fused" } else { "candle" };
            let blocks: Vec<BlockSpec> = (0..n)
                .map(|i| {
                    BlockSpec::module(format!("layers.{i}"), move |vb| {
                        common::mlp_block(vb, w, h, fused)
                    })
                })
                .collect();
            streamer_core::trim_device_memory(&dev)?;
            let base = common::used_now(&dev);
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
                        .map(|i| common::mlp_block(vb.pp(format!("layers.{i}")), w, h, fused))
                        .collect::<candle_core::Result<_>>()?;
                    streamer_core::trim_device_memory(&dev)?;
                    let sampler = common::MemSampler::start(&dev);
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
                    // SAFETY: the bench never changes the masters.
                    prefetch_across_calls: Some(unsafe {
                        streamer_core::AcrossCalls::promise_masters_unchanged()
                    }),
                    retain_device_memory: retain,
                    ..Default::default()
                };
                streamer_core::trim_device_memory(&dev)?;
                let model = StreamedSequential::from_tensors(host.clone(), blocks.clone(), cfg)?;
                let sampler = common::MemSampler::start(&dev);
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
                "{kind:<6} w{w} h{h} x{n} ({:.0} MiB) tokens {t:>6}: resident {resident_ms:8.3} ms  streamed {streamed_ms:8.3} ms  \
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
                "block": kind, "w": w, "h": h, "blocks": n, "tokens": t, "weight_bytes": bytes,
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
            series.push((format!("{kind} w{w} h{h} x{n}"), points));
        }
    }
    let out = serde_json::json!({
        "device": tag, "dtype": "bf16", "prefetch_ahead": 1, "prefetch_across_calls": true,
        "iterations": iters, "statistic": "median after 3 warm-up calls",
        "allocator": if retain { "freed device memory kept in CUDA's pool (both runs)" } else { "CUDA default pool: freed memory released at each synchronisation (both runs)" },
        "h2d_gbps_pinned": h2d_gbps, "command": "cargo bench --bench streaming --features cuda (scripts/gpu-test.sh bundle)",
        "peak_memory_note": "device memory taken (cuMemGetInfo, so memory the pool keeps counts) sampled every 200 us on a side thread, above the baseline before the run, pool trimmed before each run (0 on CPU)",
        "results": rows,
    });
    let plot = common::svg_plot(
        "streamed / resident time (bf16, prefetch 1)",
        "tokens",
        "ratio",
        &series,
    );
    common::write_results(&format!("streaming-{tag}"), &out, Some(plot))
}
