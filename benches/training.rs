//! Training-step benchmark: bf16 MLP blocks `Linear(w,h), GELU, Linear(h,w)`
//! trained streamed (f32 or bf16 host masters, bf16 compute, CpuAdamW on the host, with
//! and without the overlapped step) against all-resident Candle training
//! (bf16 weights and candle-nn AdamW on the device).
//!
//!     cargo bench --bench training [--features cuda]
//!
//! Writes `benches/results/training-<device>.json` and `.svg`.
#[path = "common/mod.rs"]
mod common;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder};
use std::time::Instant;
use streamer_autograd::{CpuAdamW, Train};
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let dev = common::device();
    let tag = common::device_tag(&dev);
    let gpu = dev.is_cuda();
    // Resident and streamed runs share one allocator setting: freed device memory
    // stays pooled (what StreamConfig does by default), from the first run on.
    streamer_core::retain_freed_device_memory(&dev)?;
    // (w, h, blocks, tokens, master dtype): f32 masters are the mixed-precision
    // default; bf16 masters stream half the bytes, like the resident baseline's
    // bf16 weights (the optimizer state stays f32 either way).
    let configs: Vec<(usize, usize, usize, usize, DType)> = if gpu {
        vec![
            (4096, 16384, 8, 32768, DType::F32),
            (4096, 16384, 8, 32768, DType::BF16),
            (8192, 32768, 4, 32768, DType::F32),
        ]
    } else {
        vec![(128, 256, 4, 256, DType::F32)]
    };
    let (warmup, iters) = if gpu { (2, 5) } else { (1, 3) };
    let params = ParamsAdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let mut rows = Vec::new();
    let mut bars = Vec::new();
    for (w, h, n, tokens, master) in configs {
        let host = common::mlp_weights(&dev, w, h, n, DType::F32)?;
        let nparams: usize = host.values().map(|t| t.elem_count()).sum();
        let blocks: Vec<BlockSpec> = (0..n)
            .map(|i| BlockSpec::module(format!("layers.{i}"), move |vb| common::mlp(vb, w, h)))
            .collect();
        let x = Tensor::randn(0f32, 1.0, (tokens, w), &dev)?.to_dtype(DType::BF16)?;
        let target = Tensor::randn(0f32, 1.0, (tokens, w), &dev)?;
        let sync = |d: &Device| d.synchronize();

        // Resident Candle: bf16 weights and candle-nn AdamW on the device.
        let resident_ms = {
            let vars: Vec<(String, Var)> = host
                .iter()
                .map(|(k, v)| {
                    Ok((
                        k.clone(),
                        Var::from_tensor(&v.to_dtype(DType::BF16)?.to_device(&dev)?)?,
                    ))
                })
                .collect::<Result<_>>()?;
            let vb = VarBuilder::from_tensors(
                vars.iter()
                    .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                    .collect(),
                DType::BF16,
                &dev,
            );
            let mods: Vec<_> = (0..n)
                .map(|i| common::mlp(vb.pp(format!("layers.{i}")), w, h))
                .collect::<candle_core::Result<_>>()?;
            let mut opt = candle_nn::AdamW::new(
                vars.iter().map(|(_, v)| v.clone()).collect(),
                params.clone(),
            )?;
            let mut times = Vec::new();
            for it in 0..warmup + iters {
                sync(&dev)?;
                let t = Instant::now();
                let mut y = x.clone();
                for m in &mods {
                    y = m.forward(&y)?;
                }
                let loss = y.to_dtype(DType::F32)?.sub(&target)?.sqr()?.mean_all()?;
                opt.backward_step(&loss)?;
                sync(&dev)?;
                if it >= warmup {
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            median(times)
        };
        dev.synchronize()?;

        let cfg = StreamConfig {
            device: dev.clone(),
            prefetch_ahead: 1,
            dtype: DType::BF16,
            master_dtype: Some(master),
            ..Default::default()
        };
        let model = StreamedSequential::from_tensors(host, blocks, cfg)?.train();
        let mut opt = CpuAdamW::new(model.trainable_vars()?, params.clone())?;
        // Plain: forward, backward, then the optimizer on the host.
        let (mut fwd, mut bwd, mut optm, mut total) = (vec![], vec![], vec![], vec![]);
        for it in 0..warmup + iters {
            if it == warmup {
                model.inner().reset_stats()?;
            }
            sync(&dev)?;
            let t0 = Instant::now();
            let y = model.forward(&x)?;
            let loss = y.to_dtype(DType::F32)?.sub(&target)?.sqr()?.mean_all()?;
            sync(&dev)?;
            let t1 = Instant::now();
            let grads = model.backward(&loss)?;
            sync(&dev)?;
            let t2 = Instant::now();
            opt.step(&grads)?;
            model.zero_grad()?;
            let t3 = Instant::now();
            if it >= warmup {
                fwd.push((t1 - t0).as_secs_f64() * 1e3);
                bwd.push((t2 - t1).as_secs_f64() * 1e3);
                optm.push((t3 - t2).as_secs_f64() * 1e3);
                total.push((t3 - t0).as_secs_f64() * 1e3);
            }
        }
        let st = model.stats()?;
        // Overlapped: the optimizer steps each block's weights as their gradients land.
        let mut overlapped = vec![];
        let mut opt_thread = vec![];
        for it in 0..warmup + iters {
            sync(&dev)?;
            let t0 = Instant::now();
            let y = model.forward(&x)?;
            let loss = y.to_dtype(DType::F32)?.sub(&target)?.sqr()?.mean_all()?;
            model.backward_step(&loss, &mut opt)?;
            model.zero_grad()?;
            sync(&dev)?;
            if it >= warmup {
                overlapped.push(t0.elapsed().as_secs_f64() * 1e3);
                opt_thread.push(model.last_optimizer_seconds()? * 1e3);
            }
        }
        let (fwd, bwd, optm, total, overlapped) = (
            median(fwd),
            median(bwd),
            median(optm),
            median(total),
            median(overlapped),
        );
        let no_opt = fwd + bwd;
        let per = iters as f64;
        println!(
            "w{w} h{h} x{n} ({:.2} G params) tokens {tokens} masters {master:?}: resident {resident_ms:.1} ms | streamed {total:.1} ms \
             (fwd {fwd:.1}, bwd {bwd:.1}, opt {optm:.1}) ratio {:.3} | overlapped {overlapped:.1} ms ratio {:.3}, \
             optimizer adds {:.1}% over fwd+bwd | per step: D2H {:.1} ms, H2D {:.1} ms, stall {:.1} ms, peak resident blocks {}",
            nparams as f64 / 1e9,
            total / resident_ms,
            overlapped / resident_ms,
            100.0 * (overlapped - no_opt) / no_opt,
            st.d2h_seconds * 1e3 / per,
            st.h2d_seconds * 1e3 / per,
            st.stall_seconds * 1e3 / per,
            st.peak_resident_blocks,
        );
        bars.push((
            format!("w{w} x{n} {master:?} masters"),
            vec![(1.0, total / resident_ms), (2.0, overlapped / resident_ms)],
        ));
        rows.push(serde_json::json!({
            "master_dtype": format!("{master:?}"), "w": w, "h": h, "blocks": n, "tokens": tokens, "params": nparams,
            "resident_step_ms": resident_ms,
            "streamed_step_ms": total, "streamed_ratio": total / resident_ms,
            "forward_ms": fwd, "backward_ms": bwd, "optimizer_ms": optm,
            "overlapped_step_ms": overlapped, "overlapped_ratio": overlapped / resident_ms,
            "optimizer_thread_ms": median(opt_thread),
            "optimizer_overhead_vs_fwd_bwd": (overlapped - no_opt) / no_opt,
            "d2h_ms_per_step": st.d2h_seconds * 1e3 / per, "d2h_bytes_per_step": st.d2h_bytes as f64 / per,
            "h2d_ms_per_step": st.h2d_seconds * 1e3 / per, "h2d_bytes_per_step": st.h2d_bytes as f64 / per,
            "stall_ms_per_step": st.stall_seconds * 1e3 / per,
            "peak_resident_blocks": st.peak_resident_blocks, "peak_resident_bytes": st.peak_resident_bytes,
        }));
    }
    let out = serde_json::json!({
        "device": tag, "compute_dtype": "bf16",  "prefetch_ahead": 1,
        "resident": "bf16 device weights, candle-nn AdamW on the device",
        "streamed": "host masters (f32 or bf16, see master_dtype), bf16 compute, CpuAdamW with f32 state on the host (16 threads on the H200 host)",
        "statistic": format!("median of {iters} steps after {warmup} warm-up"),
        "command": "cargo bench --bench training --features cuda (scripts/gpu-test.sh bundle)",
        "allocator": "freed device memory kept in CUDA's pool (both runs)",
        "results": rows,
    });
    let json = common::results_path(&format!("training-{tag}.json"));
    std::fs::write(&json, serde_json::to_string_pretty(&out)?)?;
    let svg = common::results_path(&format!("training-{tag}.svg"));
    std::fs::write(
        &svg,
        candle_streamer::report::svg_plot_axes(
            false,
            "training step / resident (1 = plain, 2 = overlapped step)",
            "mode",
            "ratio",
            &bars,
        ),
    )?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(())
}
