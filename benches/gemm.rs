//! Where the MLP block's training time goes, GEMM by GEMM: each of the six
//! GEMMs of a `FusedMlp` forward and backward (cuBLASLt, with and without its
//! epilogue) beside the same product through Candle's `matmul` (cuBLAS) and
//! PyTorch (benches/gemm_torch.py, run first in the same device call; its rows are
//! merged here). Then a decoder layer's q/k/v projections as three GEMMs or
//! one over concatenated weights. CUDA only: on the CPU it says so and exits.
//!
//!     cargo bench --bench gemm --features cuda
//!
//! Writes `benches/results/gemm-<device>.json`.
#[path = "common/mod.rs"]
mod common;

common::cuda_only_main!("gemm: the cuBLASLt GEMMs exist only with --features cuda");

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

    /// A decoder layer's q/k/v projections at one shape (hidden, q width, k/v
    /// width), as the layer runs them (three products, and two adds for the
    /// input gradient) and as one product over the concatenated weights, with
    /// and without copying q, k, v out of the joint output (the layer's
    /// kernels take contiguous projections). Issue 11 asks for the single GEMM
    /// only if it is faster: these rows decide.
    fn qkv_cases<'a>(t: &'a [Tensor; 9]) -> Vec<(&'static str, &'static str, Op<'a>)> {
        // g is the joint gradient, gq/gk/gv the layer's three (separate) ones.
        let [x, wq, wk, wv, wqkv, g, gq, gk, gv] = t;
        let (q, kv) = (wq.dim(0).unwrap_or(0), wk.dim(0).unwrap_or(0));
        let parts = move |y: &Tensor| -> candle_core::Result<Vec<Tensor>> {
            [(0, q), (q, kv), (q + kv, kv)]
                .iter()
                .map(|&(o, w)| y.narrow(1, o, w)?.contiguous())
                .collect()
        };
        vec![
            (
                "qkv_fwd",
                "three",
                Box::new(move || {
                    for w in [wq, wk, wv] {
                        x.matmul(&w.t()?)?;
                    }
                    Ok(())
                }),
            ),
            (
                "qkv_fwd",
                "one",
                Box::new(move || x.matmul(&wqkv.t()?).map(drop)),
            ),
            (
                "qkv_fwd",
                "one_split",
                Box::new(move || parts(&x.matmul(&wqkv.t()?)?).map(drop)),
            ),
            (
                "qkv_dx",
                "three",
                Box::new(move || {
                    let a = gq.matmul(wq)?;
                    let b = gk.matmul(wk)?;
                    let c = gv.matmul(wv)?;
                    ((a + b)? + c).map(drop)
                }),
            ),
            ("qkv_dx", "one", Box::new(move || g.matmul(wqkv).map(drop))),
            (
                "qkv_dw",
                "three",
                Box::new(move || {
                    for gi in [gq, gk, gv] {
                        gi.t()?.matmul(x)?;
                    }
                    Ok(())
                }),
            ),
            (
                "qkv_dw",
                "one",
                Box::new(move || g.t()?.matmul(x).map(drop)),
            ),
        ]
    }

    /// The q/k/v rows at the `1b` and `3b` presets' shapes, 32,768 tokens.
    fn qkv_rows(dev: &Device, rows: &mut Vec<serde_json::Value>) -> Result<()> {
        for (preset, d, q, kv) in [
            ("1b", 2048usize, 2048usize, 512usize),
            ("3b", 3072, 3072, 1024),
        ] {
            let n = 32768usize;
            let s = 1.0 / (d as f32).sqrt();
            let (wq, wk, wv) = (
                randn(dev, (q, d), s)?,
                randn(dev, (kv, d), s)?,
                randn(dev, (kv, d), s)?,
            );
            let wqkv = Tensor::cat(&[&wq, &wk, &wv], 0)?;
            let g = randn(dev, (n, q + 2 * kv), 1.0)?;
            let split = |o: usize, w: usize| g.narrow(1, o, w)?.contiguous();
            let (gq, gk, gv) = (split(0, q)?, split(q, kv)?, split(q + kv, kv)?);
            let t = [randn(dev, (n, d), 1.0)?, wq, wk, wv, wqkv, g, gq, gk, gv];
            let flops = 2.0 * (n * d * (q + 2 * kv)) as f64;
            for (op, variant, f) in qkv_cases(&t) {
                let secs = common::time_median(dev, 3, 10, || Ok(f()?))?;
                let tflops = flops / secs / 1e12;
                println!(
                    "{preset} q/k/v {op:<8} {variant:<10} {:8.3} ms {tflops:6.1} TFLOP/s",
                    secs * 1e3
                );
                rows.push(serde_json::json!({
                    "system": "cublas", "preset": preset, "d": d, "q": q, "kv": kv, "n": n,
                    "op": op, "variant": variant, "ms": secs * 1e3, "tflops": tflops,
                }));
            }
        }
        Ok(())
    }

    fn torch_rows(tag: &str) -> Vec<serde_json::Value> {
        common::result_rows(&format!("gemm-torch-{tag}.json"))
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
        qkv_rows(&dev, &mut rows)?;
        let out = serde_json::json!({
            "device": tag, "dtype": "bf16",
            "ops": "the MLP block's GEMMs: fwd_up x W_up^T, fwd_down h W_down^T, dw_down g^T h, dz g W_down, dw_up dz^T x, dx dz W_up; FLOPs 2 n d h each. Rows with `preset`: a decoder layer's q/k/v projections as three GEMMs (`three`; the input gradient with its two adds) or one over the concatenated weights (`one`; `one_split` also copies q, k, v out), FLOPs 2 n d (q + 2 kv)",
            "statistic": "median of 10 after 3 warm-up, device synchronized around each call (includes output allocation)",
            "command": "GPU_ONLY=gemm bash gpu-bundle/run.sh benches",
            "results": rows,
        });
        common::write_results(&format!("gemm-{tag}"), &out, None)
    }
}
