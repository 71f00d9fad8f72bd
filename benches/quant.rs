//! A quantized frozen weight's GEMM against the bf16 one: for each linear
//! layer shape of Llama 3.1 8B at 16,384 tokens, `x @ w^T` with `w` in bf16,
//! and with `w` kept on the GPU in NF4 (double-quantized absmax, as QLoRA
//! stores it), int8 rows or fp8 e4m3 and dequantized into bf16 right before
//! the same GEMM (the dequantization alone is timed too). The quantized
//! issue's bar: dequantization + GEMM at most 1.15x the bf16 GEMM. CUDA only.
//!
//!     cargo bench --bench quant --features cuda
//!
//! QUANT_BENCH_TOKENS (16384), QUANT_BENCH_REPS (10). Writes
//! `benches/results/quant-gemm-<device>.json`.
#[path = "common/mod.rs"]
mod common;

common::cuda_only_main!("quant: the GPU dequantization exists only with --features cuda");

#[cfg(feature = "cuda")]
mod cuda {
    use super::common;
    use anyhow::Result;
    use candle_core::{DType, Device, Tensor};
    use streamer_quant::{Dequantize, FourBit, FourBitType, Fp8, Int8Rows, Uploaded};

    /// Llama 3.1 8B's linear layers as (name, out, in).
    const SHAPES: [(&str, usize, usize); 4] = [
        ("q_proj/o_proj", 4096, 4096),
        ("k_proj/v_proj", 1024, 4096),
        ("gate_proj/up_proj", 14336, 4096),
        ("down_proj", 4096, 14336),
    ];

    /// The weight in each format, uploaded packed.
    fn formats(
        w: &[f32],
        (out, inp): (usize, usize),
        dev: &Device,
    ) -> Result<Vec<(&'static str, Uploaded, usize)>> {
        let nf4 = FourBit::quantize(w, &[out, inp], FourBitType::Nf4, 64, true)?;
        let int8 = Int8Rows::quantize(w, (out, inp))?;
        let fp8 = Fp8::quantize(w, (out, inp), true)?;
        Ok(vec![
            ("nf4", nf4.upload(dev)?, nf4.stored_bytes()),
            ("int8", int8.upload(dev)?, int8.stored_bytes()),
            ("fp8", fp8.upload(dev)?, fp8.stored_bytes()),
        ])
    }

    fn shape_rows(
        dev: &Device,
        (name, out, inp): (&str, usize, usize),
        tokens: usize,
        reps: usize,
    ) -> Result<Vec<serde_json::Value>> {
        let w32 = Tensor::randn(0f32, 0.02, (out, inp), &Device::Cpu)?;
        let host: Vec<f32> = w32.flatten_all()?.to_vec1()?;
        let w = w32.to_dtype(DType::BF16)?.to_device(dev)?;
        let x = Tensor::randn(0f32, 1.0, (tokens, inp), dev)?.to_dtype(DType::BF16)?;
        let bf16 = common::time_median(dev, 3, reps, || {
            x.matmul(&w.t()?)?;
            Ok(())
        })?;
        let flops = 2.0 * (tokens * out * inp) as f64;
        println!(
            "{name} {out}x{inp}, {tokens} tokens: bf16 GEMM {:.3} ms ({:.0} TFLOP/s)",
            bf16 * 1e3,
            flops / bf16 / 1e12
        );
        let mut rows = Vec::new();
        for (format, up, bytes) in formats(&host, (out, inp), dev)? {
            let dq = common::time_median(dev, 3, reps, || {
                up.dequantize()?;
                Ok(())
            })?;
            let both = common::time_median(dev, 3, reps, || {
                x.matmul(&up.dequantize()?.t()?)?;
                Ok(())
            })?;
            println!(
                "  {format}: dequantize {:.3} ms, dequantize + GEMM {:.3} ms = {:.3}x bf16 ({:.2} bytes a weight)",
                dq * 1e3,
                both * 1e3,
                both / bf16,
                bytes as f64 / (out * inp) as f64
            );
            rows.push(serde_json::json!({
                "layer": name, "out": out, "in": inp, "tokens": tokens, "format": format,
                "bytes_per_weight": bytes as f64 / (out * inp) as f64,
                "bf16_gemm_ms": bf16 * 1e3, "dequant_ms": dq * 1e3, "dequant_gemm_ms": both * 1e3,
                "ratio": both / bf16,
            }));
        }
        Ok(rows)
    }

    pub fn run() -> Result<()> {
        let dev = common::device();
        if !dev.is_cuda() {
            println!("quant: no CUDA device; nothing to measure");
            return Ok(());
        }
        // Freed memory stays in the pool between repetitions, as a streamed
        // model keeps it (`StreamConfig::retain_device_memory`): otherwise
        // every dequantized weight and GEMM output is mapped afresh.
        streamer_device::retain_freed_device_memory(&dev)?;
        let (tokens, reps) = (
            common::env_usize("QUANT_BENCH_TOKENS", 16384),
            common::env_usize("QUANT_BENCH_REPS", 10),
        );
        let mut rows = Vec::new();
        for shape in SHAPES {
            rows.extend(shape_rows(&dev, shape, tokens, reps)?);
        }
        let worst = rows
            .iter()
            .filter_map(|r| r["ratio"].as_f64())
            .fold(0.0, f64::max);
        println!("worst dequantize + GEMM against bf16: {worst:.3}x (bar: 1.15x)");
        let path = common::results_path(&format!("quant-gemm-{}.json", common::device_tag(&dev)));
        std::fs::write(&path, serde_json::to_string_pretty(&rows)?)?;
        println!("wrote {}", path.display());
        Ok(())
    }
}
