//! `FusedLinear` (cuBLASLt bias/GELU epilogue on CUDA) against an f64 reference
//! computed with plain loops, and its gradients against Candle autograd through
//! candle-nn's `Linear` and `Tensor::gelu`.
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use streamer_models::{Epilogue, FusedLinear};

fn gelu_tanh(z: f64) -> f64 {
    let u = (2.0 / std::f64::consts::PI).sqrt() * (z + 0.044715 * z * z * z);
    0.5 * z * (1.0 + u.tanh())
}

fn max_rel_err(got: &Tensor, want: &[f64]) -> Result<f64> {
    let got: Vec<f64> = got.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    crate::common::rel_err_vals(&got, want)
}

fn fused_linear_matches_f64_reference(dev: &Device) -> Result<()> {
    // Odd sizes (not tile multiples), a rank-3 input, both epilogues, each dtype.
    let (b, t, k, n) = (2, 37, 72, 53);
    let x64 = Tensor::randn(0f64, 1.0, (b, t, k), &Device::Cpu)?;
    let w64 = Tensor::randn(0f64, 0.2, (n, k), &Device::Cpu)?;
    let b64 = Tensor::randn(0f64, 0.5, n, &Device::Cpu)?;
    let (xv, wv, bv): (Vec<f64>, Vec<f64>, Vec<f64>) = (
        x64.flatten_all()?.to_vec1()?,
        w64.flatten_all()?.to_vec1()?,
        b64.to_vec1()?,
    );
    for ep in [Epilogue::Bias, Epilogue::BiasGelu] {
        let mut want = vec![0f64; b * t * n];
        for r in 0..b * t {
            for o in 0..n {
                let z: f64 = (0..k).map(|i| xv[r * k + i] * wv[o * k + i]).sum::<f64>() + bv[o];
                want[r * n + o] = if ep == Epilogue::BiasGelu {
                    gelu_tanh(z)
                } else {
                    z
                };
            }
        }
        // Stated tolerances, relative to the output's largest magnitude.
        for (dt, tol) in [
            (DType::F32, 1e-5),
            (DType::BF16, 1.5e-2),
            (DType::F16, 2e-3),
        ] {
            let to = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(dev)?) };
            let lin = FusedLinear::new(to(&w64)?, to(&b64)?, ep)?;
            let y = lin.forward(&to(&x64)?)?;
            ensure!(
                y.dims() == [b, t, n] && y.dtype() == dt,
                "{:?} {:?}",
                y.dims(),
                y.dtype()
            );
            let err = max_rel_err(&y, &want)?;
            ensure!(
                err <= tol,
                "{ep:?} {dt:?} on {:?}: error {err:.2e} > {tol:.0e}",
                dev.location()
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(fused_linear_matches_f64_reference);

fn fused_linear_gradients_match_candle_autograd(dev: &Device) -> Result<()> {
    let (rows, k, n) = (45, 64, 40);
    for (dt, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, k), dev)?.to_dtype(dt)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.2, (n, k), dev)?.to_dtype(dt)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 0.5, n, dev)?.to_dtype(dt)?)?;
        let up = Tensor::randn(0f32, 1.0, (rows, n), dev)?.to_dtype(dt)?;
        // Reference: candle-nn Linear then Tensor::gelu, differentiated by Candle.
        let lin = candle_nn::Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
        let ref_loss = (lin.forward(x.as_tensor())?.gelu()? * &up)?
            .to_dtype(DType::F32)?
            .sum_all()?;
        let g_ref = ref_loss.backward()?;
        let fused = FusedLinear::new(
            w.as_tensor().clone(),
            b.as_tensor().clone(),
            Epilogue::BiasGelu,
        )?;
        let loss = (fused.forward(x.as_tensor())? * &up)?
            .to_dtype(DType::F32)?
            .sum_all()?;
        let g = loss.backward()?;
        for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
            let want = g_ref.get(v.as_tensor()).expect("reference gradient");
            let got = g.get(v.as_tensor()).expect("fused gradient");
            crate::common::ensure_close(&format!("grad of {name} {dt:?}"), got, want, tol)?;
        }
    }
    Ok(())
}
candle_streamer::test_device!(fused_linear_gradients_match_candle_autograd);

fn fused_linear_rejects_bad_input(dev: &Device) -> Result<()> {
    let w = Tensor::zeros((4, 3), DType::F32, dev)?;
    let err = FusedLinear::new(
        w.clone(),
        Tensor::zeros(5, DType::F32, dev)?,
        Epilogue::Bias,
    )
    .expect_err("bias of the wrong length");
    ensure!(err.to_string().contains("bias must be (4,)"), "{err}");
    let lin = FusedLinear::new(w, Tensor::zeros(4, DType::F32, dev)?, Epilogue::Bias)?;
    let err = lin
        .forward(&Tensor::zeros((2, 5), DType::F32, dev)?)
        .expect_err("wrong in-features");
    ensure!(err.to_string().contains("in-features 3"), "{err}");
    let wrong_dtype = lin.forward(&Tensor::zeros((2, 3), DType::F64, dev)?);
    crate::common::expect_err(wrong_dtype, &["F64"])?;
    Ok(())
}
candle_streamer::test_device!(fused_linear_rejects_bad_input);
