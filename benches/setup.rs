//! Benchmark: making a model's host masters from a safetensors file, as
//! `WeightSource::load_master` does (one pass over the mapped bytes by all
//! cores, converting to the master dtype), beside Candle's own path (read the
//! tensor on one thread, convert it on one thread, copy it into a variable:
//! what building masters did before). The weights are the model's shapes in
//! bf16 with a repeating pattern (values do not change the cost).
//!
//! ```text
//! cargo bench --bench setup                       # 1b shapes, f32 masters
//! SETUP_BENCH=8b SETUP_BENCH_DTYPE=bf16 cargo bench --bench setup
//! ```
//!
//! Environment: `SETUP_BENCH` (model shapes, `common::model_config`; default
//! `1b`), `SETUP_BENCH_DTYPE` (the masters' dtype: `f32`, the default, as
//! full fine-tuning keeps them, or `bf16`), `SETUP_BENCH_ROUNDS` (timed
//! rounds of each path, alternating; default 3), `SETUP_BENCH_DIR` (where
//! the file is written, default the system's temporary directory; it is
//! removed after), `SETUP_BENCH_QUANTIZE` (`nf4`, `int8`, ...: also build the
//! model streamed on the host over a base of random codes in that format and
//! report its masters' time, beside the time to dequantize every packed
//! weight on the host, which building a quantized model cost before 1588b5c).
//! Writes `setup-<device>.json` (`BENCH_RESULTS_DIR`).

mod common;

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{safetensors::MmapedSafetensors, DType, Device, Tensor, Var};
use candle_streamer::streamer_core::WeightSource;
use serde_json::json;

/// Every weight of `cfg` in bf16, filled from one repeating tile.
fn weights(cfg: &streamer_models::LlamaConfig) -> Result<HashMap<String, Tensor>> {
    let tile = Tensor::arange(0u32, 4096, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(1e-4, -0.2)?
        .to_dtype(DType::BF16)?;
    let mut all = cfg.outer_weights();
    for i in 0..cfg.num_hidden_layers {
        all.extend(cfg.layer_weights(i));
    }
    all.into_iter()
        .map(|(name, dims, _)| {
            let n: usize = dims.iter().product();
            let t = tile
                .repeat(n.div_ceil(4096))?
                .narrow(0, 0, n)?
                .reshape(dims)?;
            Ok((name, t))
        })
        .collect()
}

/// Seconds to make every master in `dtype` with `make`.
fn time_masters(names: &[String], make: impl Fn(&str) -> Result<Var>) -> Result<f64> {
    let t = Instant::now();
    let masters = names.iter().map(|n| make(n)).collect::<Result<Vec<_>>>()?;
    let s = t.elapsed().as_secs_f64();
    drop(masters);
    Ok(s)
}

/// A quantized model built streamed on the host (its masters' seconds), and
/// the work its construction no longer does: every packed weight
/// dequantized on the host.
fn quantized_rows(
    cfg: &streamer_models::LlamaConfig,
    name: &str,
    scheme: streamer_quant::QuantScheme,
) -> Result<Vec<serde_json::Value>> {
    use streamer_models::{init_weights_where, is_quantizable, Llama, QuantizedWeights};
    let q = QuantizedWeights::synthetic(cfg, scheme, 0, 0.05)?;
    let dense = init_weights_where(cfg, 0, |n| !is_quantizable(n))?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(DType::BF16)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    let stream = candle_streamer::streamer_core::StreamConfig {
        device: Device::Cpu,
        dtype: DType::BF16,
        ..Default::default()
    };
    let model = Llama::streamed_quantized(&WeightSource::Tensors(dense), &q, cfg, stream)?;
    let built = model
        .streamed_layers()
        .context("a streamed model")?
        .setup_times();
    drop(model);
    let t = Instant::now();
    let dense = q.dequantized()?;
    let dequant_s = t.elapsed().as_secs_f64();
    drop(dense);
    let packed_gb = q.packed_bytes() as f64 / 1e9;
    println!(
        "{name} {scheme:?} ({packed_gb:.2} GB packed): host masters {:.2} s; dequantizing every \
         packed weight on the host, as construction did before, {dequant_s:.2} s",
        built.masters_s
    );
    let row = |system: &str, s: f64| {
        json!({"system": system, "model": name, "format": format!("{scheme:?}"),
               "packed_gb": packed_gb, "seconds": s})
    };
    Ok(vec![
        row(
            "ours: Llama::streamed_quantized host masters (setup_times)",
            built.masters_s,
        ),
        row(
            "dequantize every packed weight on the host (construction before 1588b5c)",
            dequant_s,
        ),
    ])
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let name = std::env::var("SETUP_BENCH").unwrap_or_else(|_| "1b".into());
    let cfg = common::model_config(&name)?;
    let dtype = match std::env::var("SETUP_BENCH_DTYPE").as_deref() {
        Ok("bf16") => DType::BF16,
        Ok("f32") | Err(_) => DType::F32,
        Ok(other) => anyhow::bail!("SETUP_BENCH_DTYPE={other:?}: f32 or bf16"),
    };
    let rounds = common::env_usize("SETUP_BENCH_ROUNDS", 3).max(1);
    let dir = std::env::var("SETUP_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir())
        .join(format!("setup-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("{dir:?}"))?;
    let file = dir.join("model.safetensors");
    let w = weights(&cfg)?;
    candle_core::safetensors::save(&w, &file)?;
    let mut names: Vec<String> = w.keys().cloned().collect();
    names.sort();
    drop(w);
    let file_gb = std::fs::metadata(&file)?.len() as f64 / 1e9;
    let src = WeightSource::safetensors(&[&file])?;
    // SAFETY: the file was written above and is not changed while mapped.
    let st = unsafe { MmapedSafetensors::new(&file) }?;
    let candle = |n: &str| -> Result<Var> {
        let t = st.load(n, &Device::Cpu)?.to_dtype(dtype)?;
        Ok(Var::from_tensor(&t.contiguous()?.copy()?)?)
    };
    let ours = |n: &str| -> Result<Var> { Ok(src.load_master(n, dtype)?) };
    let (mut c, mut o) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        c.push(time_masters(&names, candle)?);
        o.push(time_masters(&names, ours)?);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let masters_gb = cfg.num_params() as f64 * dtype.size_in_bytes() as f64 / 1e9;
    let threads = rayon::current_num_threads();
    let row = |system: &str, s: f64, all: &[f64]| {
        json!({"system": system, "model": name, "file_gb": file_gb, "master_dtype":
               format!("{dtype:?}"), "masters_gb": masters_gb, "seconds": s, "rounds": all,
               "masters_gb_per_s": masters_gb / s, "threads": threads})
    };
    let (cs, os) = (median(c.clone()), median(o.clone()));
    println!(
        "{name}: {file_gb:.2} GB of bf16 -> {masters_gb:.2} GB of {dtype:?} masters, {threads} threads: \
         load_master {os:.2} s, Candle's path {cs:.2} s ({:.2}x)",
        cs / os
    );
    let mut rows = vec![
        row("ours (WeightSource::load_master)", os, &o),
        row("candle (load, to_dtype, copy, Var::from_tensor)", cs, &c),
    ];
    if let Some(scheme) = common::quant_scheme("SETUP_BENCH_QUANTIZE")? {
        rows.extend(quantized_rows(&cfg, &name, scheme)?);
    }
    // A host-only bench: named after the machine (the bundle's tag on the
    // GPU machine, "cpu" on the development machine).
    let tag = std::env::var("BENCH_DEVICE_TAG").unwrap_or_else(|_| "cpu".into());
    common::write_json(
        &format!("setup-{tag}.json"),
        &json!({"bench": "setup", "rows": rows}),
    )?;
    Ok(())
}
