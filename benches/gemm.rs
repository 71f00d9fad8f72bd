//! Where the MLP block's training time goes, GEMM by GEMM: each of the six
//! GEMMs of a `FusedMlp` forward and backward (cuBLASLt, with and without its
//! epilogue) beside the same product through Candle's `matmul` (cuBLAS) and
//! PyTorch (benches/gemm_torch.py, run first in the same session; its rows are
//! merged here). CUDA only: on the CPU it says so and exits.
//!
//!     cargo bench --bench gemm --features cuda
//!
//! Writes `benches/results/gemm-<device>.json`.
#[path = "common/mod.rs"]
mod common;

use anyhow::Result;

#[cfg(not(feature = "cuda"))]
fn main() -> Result<()> {
    println!("gemm: the cuBLASLt GEMMs exist only with --features cuda; nothing to measure");
    Ok(())
}

#[cfg(feature = "cuda")]
fn main() -> Result<()> {
    cuda::run()
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::common;
    use anyhow::Result;
    use candle_core::{DType, Device, Tensor};
    use streamer_models::lt_probe::{input_grad, linear, weight_grad};

    type Op<'a> = Box<dyn Fn() -> candle_core::Result<()> + 'a>;

    fn randn(dev: &Device, shape: (usize, usize), scale: f32) -> Result<Tensor> {
        Ok(Tensor::randn(0f32, scale, shape, dev)?.to_dtype(DType::BF16)?)
    }

    /// The MLP block's products at one shape, each as (op, system, epilogue, f).
    fn cases<'a>(t: &'a [Tensor; 9]) -> Vec<(&'static str, &'static str, &'static str, Op<'a>)> {
        let [x, wu, bu, h, z, wd, bd, g, dz] = t;
        let sink = |r: candle_core::Result<(Tensor, Option<Tensor>)>| r.map(drop);
        vec![
            (
                "fwd_up",
                "cublaslt",
                "gelu_aux_bias",
                Box::new(move || sink(linear(x, wu, bu, true, true))),
            ),
            (
                "fwd_up",
                "cublaslt",
                "bias",
                Box::new(move || sink(linear(x, wu, bu, false, false))),
            ),
            (
                "fwd_up",
                "cublas",
                "none",
                Box::new(move || x.matmul(&wu.t()?).map(drop)),
            ),
            (
                "fwd_down",
                "cublaslt",
                "bias",
                Box::new(move || sink(linear(h, wd, bd, false, false))),
            ),
            (
                "fwd_down",
                "cublas",
                "none",
                Box::new(move || h.matmul(&wd.t()?).map(drop)),
            ),
            (
                "dw_down",
                "cublaslt",
                "bgradb",
                Box::new(move || sink(weight_grad(g, h, true))),
            ),
            (
                "dw_down",
                "cublaslt",
                "none",
                Box::new(move || sink(weight_grad(g, h, false))),
            ),
            (
                "dw_down",
                "cublas",
                "none",
                Box::new(move || g.t()?.matmul(h).map(drop)),
            ),
            (
                "dz",
                "cublaslt",
                "dgelu_bgrad",
                Box::new(move || sink(input_grad(g, wd, Some(z)))),
            ),
            (
                "dz",
                "cublaslt",
                "none",
                Box::new(move || sink(input_grad(g, wd, None))),
            ),
            (
                "dz",
                "cublas",
                "none",
                Box::new(move || g.matmul(wd).map(drop)),
            ),
            (
                "dw_up",
                "cublaslt",
                "none",
                Box::new(move || sink(weight_grad(dz, x, false))),
            ),
            (
                "dw_up",
                "cublas",
                "none",
                Box::new(move || dz.t()?.matmul(x).map(drop)),
            ),
            (
                "dx",
                "cublaslt",
                "none",
                Box::new(move || sink(input_grad(dz, wu, None))),
            ),
            (
                "dx",
                "cublas",
                "none",
                Box::new(move || dz.matmul(wu).map(drop)),
            ),
        ]
    }

    fn torch_rows(tag: &str) -> Vec<serde_json::Value> {
        let path = common::results_path(&format!("gemm-torch-{tag}.json"));
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
            .and_then(|v| v["results"].as_array().cloned())
            .unwrap_or_default()
    }

    pub fn run() -> Result<()> {
        let dev = common::device();
        if !dev.is_cuda() {
            println!("gemm: no CUDA device; nothing to measure");
            return Ok(());
        }
        let tag = common::device_tag(&dev);
        streamer_core::retain_freed_device_memory(&dev)?;
        let mut rows = torch_rows(&tag);
        for (d, hd, n) in [(4096usize, 16384usize, 32768usize), (8192, 32768, 32768)] {
            let s = 1.0 / (d as f32).sqrt();
            let t = [
                randn(&dev, (n, d), 1.0)?,
                randn(&dev, (hd, d), s)?,
                randn(&dev, (1, hd), s)?.squeeze(0)?,
                randn(&dev, (n, hd), 1.0)?,
                randn(&dev, (n, hd), 1.0)?,
                randn(&dev, (d, hd), s)?,
                randn(&dev, (1, d), s)?.squeeze(0)?,
                randn(&dev, (n, d), 1.0)?,
                randn(&dev, (n, hd), 1.0)?,
            ];
            let flops = 2.0 * (n * d * hd) as f64;
            for (op, system, epi, f) in cases(&t) {
                let secs = common::time_median(&dev, 3, 10, || Ok(f()?))?;
                let tflops = flops / secs / 1e12;
                println!(
                    "d{d} h{hd} n{n} {op:<9} {system:<9} {epi:<14} {:8.3} ms {tflops:6.1} TFLOP/s",
                    secs * 1e3
                );
                rows.push(serde_json::json!({
                    "system": system, "d": d, "h": hd, "n": n, "op": op, "epilogue": epi,
                    "ms": secs * 1e3, "tflops": tflops,
                }));
            }
        }
        let out = serde_json::json!({
            "device": tag, "dtype": "bf16",
            "ops": "the MLP block's GEMMs: fwd_up x W_up^T, fwd_down h W_down^T, dw_down g^T h, dz g W_down, dw_up dz^T x, dx dz W_up; FLOPs 2 n d h each",
            "statistic": "median of 10 after 3 warm-up, device synchronized around each call (includes output allocation)",
            "command": "GPU_ONLY=gemm bash gpu-bundle/run.sh benches",
            "results": rows,
        });
        let json = common::results_path(&format!("gemm-{tag}.json"));
        std::fs::write(&json, serde_json::to_string_pretty(&out)?)?;
        println!("wrote {}", json.display());
        Ok(())
    }
}
