//! RMSNorm and the rotary embedding through candle-nn's fused kernels
//! (`streamer_models::ops::fused`): values against f64 loops, gradients against
//! Candle autograd through the same operations in plain ops
//! (`RmsNorm::forward_unfused`, `apply_rope_unfused`).
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use streamer_models::{apply_rope, apply_rope_unfused, RmsNorm};

use crate::common::rel_err as max_rel;

/// The values of `t` as f64 on the CPU.
fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?)
}

/// Gradients of `sum(f(x, w) * g)` for `x` and `w`.
fn grads(
    f: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>,
    x: &Var,
    w: &Var,
    g: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let y = f(x.as_tensor(), w.as_tensor())?;
    let store = (y.to_dtype(DType::F32)? * g)?.sum_all()?.backward()?;
    let get = |v: &Var| -> Result<Tensor> {
        Ok(store
            .get(v.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient"))?
            .clone())
    };
    Ok((get(x)?, get(w)?))
}

/// RMSNorm of the rows of `x` (b, t, h) times `w` (h), in f64 on the CPU.
fn rms_norm_f64(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (b, t, h) = x.dims3()?;
    let (xv, wv) = (f64s(x)?, f64s(w)?);
    let mut want = vec![0f64; b * t * h];
    for r in 0..b * t {
        let row = &xv[r * h..(r + 1) * h];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
        for i in 0..h {
            want[r * h + i] = row[i] * inv * wv[i];
        }
    }
    Ok(Tensor::from_vec(want, (b, t, h), &Device::Cpu)?)
}

fn rms_norm_fused_matches_reference(dev: &Device) -> Result<()> {
    // Odd row count and width; weights away from 1 so that dw matters.
    let (b, t, h, eps) = (2, 37, 96, 1e-5);
    let x64 = Tensor::randn(0f64, 1.0, (b, t, h), &Device::Cpu)?;
    let w64 = (Tensor::randn(0f64, 0.3, h, &Device::Cpu)? + 1.0)?;
    let g = Tensor::randn(0f32, 1.0, (b, t, h), dev)?;
    // Stated tolerances, relative to the largest magnitude: value against f64
    // on the same rounded inputs, so only the kernel's rounding counts (Candle's
    // CPU kernel rounds the norm, x / norm and the product with w: at most about
    // 4 x 2^-9 = 7.8e-3 in bf16; against the unrounded inputs, two more
    // roundings made a random draw exceed 1e-2 now and then), gradients against
    // autograd through plain ops (whose own rounding differs in 16-bit types:
    // it rounds before multiplying by the weight).
    for (dt, tol_y, tol_g) in [
        (DType::F32, 1e-5, 1e-5),
        (DType::BF16, 1e-2, 3e-2),
        (DType::F16, 2e-3, 1e-2),
    ] {
        let x = Var::from_tensor(&x64.to_dtype(dt)?.to_device(dev)?)?;
        let w = Var::from_tensor(&w64.to_dtype(dt)?.to_device(dev)?)?;
        let want = rms_norm_f64(x.as_tensor(), w.as_tensor(), eps)?;
        let fused = |x: &Tensor, w: &Tensor| RmsNorm::from_weight(w.clone(), eps).forward(x);
        let plain =
            |x: &Tensor, w: &Tensor| RmsNorm::from_weight(w.clone(), eps).forward_unfused(x);
        let y = fused(x.as_tensor(), w.as_tensor())?;
        ensure!(
            y.dtype() == dt && y.dims() == [b, t, h],
            "{:?} {:?}",
            y.dtype(),
            y.dims()
        );
        let e = max_rel(&y, &want)?;
        ensure!(e <= tol_y, "{dt:?}: value error {e:e} > {tol_y:e}");
        let (dx, dw) = grads(fused, &x, &w, &g)?;
        // Reference gradients: plain ops in f64 on the same (rounded) inputs,
        // so only the fused kernel's own rounding is measured (two 16-bit
        // implementations against each other differ by both roundings, and a
        // random draw could exceed the bound).
        let to64 = |v: &Var| -> Result<Var> {
            Ok(Var::from_tensor(
                &v.as_tensor()
                    .to_dtype(DType::F64)?
                    .to_device(&Device::Cpu)?,
            )?)
        };
        let g_cpu = g.to_device(&Device::Cpu)?;
        let (rx, rw) = grads(plain, &to64(&x)?, &to64(&w)?, &g_cpu)?;
        let (ex, ew) = (max_rel(&dx, &rx)?, max_rel(&dw, &rw)?);
        ensure!(
            ex <= tol_g && ew <= tol_g,
            "{dt:?}: dx error {ex:e}, dw error {ew:e} > {tol_g:e}"
        );
    }
    // Untracked inputs take the kernel alone and give the same values.
    let x = x64.to_dtype(DType::F32)?.to_device(dev)?;
    let w = w64.to_dtype(DType::F32)?.to_device(dev)?;
    let want = rms_norm_f64(&x, &w, eps)?;
    let y = RmsNorm::from_weight(w, eps).forward(&x)?;
    ensure!(!y.track_op() && max_rel(&y, &want)? <= 1e-5);
    Ok(())
}
candle_streamer::test_device!(rms_norm_fused_matches_reference);

/// The rotation of `x` (b, heads, n, d) by `cos`, `sin` (n, d / 2), "rotate
/// half" layout, in f64 on the CPU.
fn rope_f64(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_, _, n, d) = x.dims4()?;
    let (xv, cos, sin) = (f64s(x)?, f64s(cos)?, f64s(sin)?);
    let mut want = vec![0f64; xv.len()];
    for r in 0..xv.len() / d {
        let p = r % n;
        for i in 0..d / 2 {
            let (c, s) = (cos[p * d / 2 + i], sin[p * d / 2 + i]);
            let (lo, hi) = (xv[r * d + i], xv[r * d + i + d / 2]);
            want[r * d + i] = lo * c - hi * s;
            want[r * d + i + d / 2] = hi * c + lo * s;
        }
    }
    Ok(Tensor::from_vec(want, x.dims(), &Device::Cpu)?)
}

fn rope_fused_matches_reference(dev: &Device) -> Result<()> {
    let (b, heads, n, d) = (2, 3, 19, 16);
    let x64 = Tensor::randn(0f64, 1.0, (b, heads, n, d), &Device::Cpu)?;
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for p in 0..n {
        for i in 0..d / 2 {
            let a = p as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (n, d / 2), &Device::Cpu)?;
    let sin = Tensor::from_vec(sin, (n, d / 2), &Device::Cpu)?;
    let g = Tensor::randn(0f32, 1.0, (b, heads, n, d), dev)?;
    for (dt, tol_y, tol_g) in [
        (DType::F32, 1e-6, 1e-6),
        (DType::BF16, 1e-2, 1e-2),
        (DType::F16, 2e-3, 2e-3),
    ] {
        let to = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(dev)?) };
        let (c, s) = (to(&cos)?, to(&sin)?);
        let x = Var::from_tensor(&to(&x64)?)?;
        // `w` is unused by the rotation; `grads` wants two variables.
        let w = Var::from_tensor(&to(&cos)?)?;
        let fused = |x: &Tensor, _: &Tensor| apply_rope(x, &c, &s);
        let plain = |x: &Tensor, _: &Tensor| apply_rope_unfused(x, &c, &s);
        let y = fused(x.as_tensor(), w.as_tensor())?;
        // Against f64 on the same rounded inputs: only the kernel's rounding.
        let e = max_rel(&y, &rope_f64(x.as_tensor(), &c, &s)?)?;
        ensure!(e <= tol_y, "{dt:?}: value error {e:e} > {tol_y:e}");
        let dx = {
            let y = fused(x.as_tensor(), w.as_tensor())?;
            let store = (y.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
            store.get(x.as_tensor()).cloned()
        };
        let rx = {
            let y = plain(x.as_tensor(), w.as_tensor())?;
            let store = (y.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
            store.get(x.as_tensor()).cloned()
        };
        let (Some(dx), Some(rx)) = (dx, rx) else {
            anyhow::bail!("{dt:?}: no gradient for x")
        };
        let e = max_rel(&dx, &rx)?;
        ensure!(e <= tol_g, "{dt:?}: dx error {e:e} > {tol_g:e}");
    }
    Ok(())
}
candle_streamer::test_device!(rope_fused_matches_reference);

fn fused_ops_reject_bad_shapes(dev: &Device) -> Result<()> {
    let x = Var::from_tensor(&Tensor::zeros((2, 4, 8), DType::F32, dev)?)?;
    let w = Tensor::ones(6, DType::F32, dev)?;
    let e = RmsNorm::from_weight(w, 1e-5)
        .forward(x.as_tensor())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        e.contains("rms-norm") && e.contains("[2, 4, 8]") && e.contains("[6]"),
        "{e}"
    );
    let x = Var::from_tensor(&Tensor::zeros((1, 2, 4, 8), DType::F32, dev)?)?;
    let cs = Tensor::zeros((4, 3), DType::F32, dev)?;
    let e = apply_rope(x.as_tensor(), &cs, &cs)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(e.contains("rope") && e.contains("[1, 2, 4, 8]"), "{e}");
    Ok(())
}
candle_streamer::test_device!(fused_ops_reject_bad_shapes);

/// `streamer_models::embedding`: rows as candle-nn's `Embedding`, and the
/// table's gradient (repeated ids included: every id of a small vocabulary
/// appears many times) against an f64 scatter-add.
fn embedding_matches_reference(dev: &Device) -> Result<()> {
    let (vocab, hidden, b, t) = (11, 40, 3, 29);
    let ids: Vec<u32> = (0..(b * t) as u32)
        .map(|i| (i * 7 + i / 5) % vocab as u32)
        .collect();
    let table64 = Tensor::randn(0f64, 1.0, (vocab, hidden), &Device::Cpu)?;
    let g64 = Tensor::randn(0f64, 1.0, (b, t, hidden), &Device::Cpu)?;
    let gv: Vec<f64> = g64.flatten_all()?.to_vec1()?;
    let mut want = vec![0f64; vocab * hidden];
    for (k, &id) in ids.iter().enumerate() {
        for j in 0..hidden {
            want[id as usize * hidden + j] += gv[k * hidden + j];
        }
    }
    let want = Tensor::from_vec(want, (vocab, hidden), &Device::Cpu)?;
    let ids_t = Tensor::from_vec(ids.clone(), (b, t), dev)?;
    for (dt, tol) in [(DType::F32, 1e-6), (DType::BF16, 8e-3)] {
        let table = Var::from_tensor(&table64.to_dtype(dt)?.to_device(dev)?)?;
        let rows = streamer_models::embedding(table.as_tensor(), &ids_t)?;
        ensure!(
            rows.dims() == [b, t, hidden] && rows.dtype() == dt,
            "{:?}",
            rows.dims()
        );
        let plain = candle_nn::Embedding::new(table.as_tensor().clone(), hidden).forward(&ids_t)?;
        ensure!(
            max_rel(&rows, &plain)? == 0.0,
            "{dt:?}: rows differ from candle-nn's"
        );
        let g = g64.to_dtype(DType::F32)?.to_device(dev)?;
        let grads = (rows.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
        let got = grads.get(table.as_tensor()).expect("table gradient");
        ensure!(got.dtype() == dt, "gradient dtype {:?}", got.dtype());
        let e = max_rel(got, &want)?;
        ensure!(e <= tol, "{dt:?}: table gradient error {e:e} > {tol:e}");
    }
    let bad = Tensor::from_vec(vec![0u32, vocab as u32], 2, dev)?;
    let table = Tensor::zeros((vocab, hidden), DType::F32, dev)?;
    if dev.is_cpu() {
        let e = streamer_models::embedding(&table, &bad).expect_err("id past the vocabulary");
        ensure!(e.to_string().contains("token id 11 of position 1"), "{e}");
    }
    let e = streamer_models::embedding(&table, &bad.to_dtype(DType::I64)?).expect_err("i64 ids");
    ensure!(e.to_string().contains("u32"), "{e}");
    Ok(())
}
candle_streamer::test_device!(embedding_matches_reference);

/// `rope_into_heads` / `rope_into_rows` (RoPE fused with the move between a
/// projection's rows and attention's head-major layout) against an f64 loop
/// of the rotation with explicit indexing: f32 to 1e-6, bf16 (inputs rounded
/// the same) to 1e-2 of the largest value. The round trip returns the input
/// (a rotation and its inverse). Mis-shaped tables are refused, named.
fn rope_layout_moves_match_reference(dev: &Device) -> Result<()> {
    use streamer_models::ops::fused::{rope_into_heads, rope_into_rows};
    let (b, n, h, d) = (2usize, 5usize, 3usize, 8usize);
    let half = d / 2;
    let p = Tensor::randn(0f32, 1.0, (b * n, h * d), &Device::Cpu)?;
    let ang = Tensor::randn(0f32, 1.0, (n, half), &Device::Cpu)?;
    let (cos, sin) = (ang.cos()?, ang.sin()?);
    let pv: Vec<f64> = p.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let (cv, sv): (Vec<f64>, Vec<f64>) = (
        cos.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?,
        sin.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?,
    );
    // want[b, h, t, :] = rotate(p[b * n + t, h * d..]) ; back[b * n + t, h * d..] = unrotate(want)
    let mut want = vec![0f64; b * h * n * d];
    for (bb, hh, t, i) in (0..b)
        .flat_map(|bb| (0..h).map(move |hh| (bb, hh)))
        .flat_map(|(bb, hh)| (0..n).map(move |t| (bb, hh, t)))
        .flat_map(|(bb, hh, t)| (0..half).map(move |i| (bb, hh, t, i)))
    {
        let src = (bb * n + t) * h * d + hh * d;
        let dst = ((bb * h + hh) * n + t) * d;
        let (x1, x2, c, s) = (
            pv[src + i],
            pv[src + i + half],
            cv[t * half + i],
            sv[t * half + i],
        );
        want[dst + i] = x1 * c - x2 * s;
        want[dst + i + half] = x1 * s + x2 * c;
    }
    let want = Tensor::from_vec(want, (b, h, n, d), &Device::Cpu)?;
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(dev)?) };
        let (pd, cd, sd) = (on(&p)?, on(&cos)?, on(&sin)?);
        let heads = rope_into_heads(&pd, (b, n, h), &cd, &sd)?;
        ensure!(heads.dims() == [b, h, n, d], "heads {:?}", heads.dims());
        let e = max_rel(&heads, &want)?;
        ensure!(e <= tol, "rope_into_heads {dtype:?}: {e:.2e}");
        let back = rope_into_rows(&heads, &cd, &sd)?;
        ensure!(back.dims() == [b * n, h * d], "rows {:?}", back.dims());
        let e = max_rel(&back, &p)?;
        ensure!(
            e <= 2.0 * tol,
            "rope_into_rows {dtype:?} round trip: {e:.2e}"
        );
        let short = cd.narrow(0, 0, n - 1)?;
        let err = rope_into_heads(&pd, (b, n, h), &short, &sd)
            .unwrap_err()
            .to_string();
        ensure!(err.contains("cos"), "{err}");
        let err = rope_into_heads(&pd, (b, n + 1, h), &cd, &sd)
            .unwrap_err()
            .to_string();
        ensure!(err.contains("rope_into_heads"), "{err}");
    }
    Ok(())
}
candle_streamer::test_device!(rope_layout_moves_match_reference);

/// `ops::fused::swiglu` and `ops::fused::add_rms_norm` (one kernel each on CUDA
/// with untracked inputs) against f64 loops over the same rounded inputs:
/// f32 to 1e-5 and bf16 to 1e-2 of the largest value (one rounding of the
/// output; the sum `s` of `add_rms_norm` is rounded once more before its
/// statistics). Tracked inputs take plain ops: their gradients match f64
/// autograd to 1e-5 (f32). Mismatched operands are refused, named.
fn swiglu_and_add_rms_norm_match_reference(dev: &Device) -> Result<()> {
    use streamer_models::ops::fused::{add_rms_norm, swiglu};
    let (rows, h, eps) = (37usize, 96usize, 1e-5);
    let cpu = Device::Cpu;
    let a = Tensor::randn(0f32, 2.0, (rows, h), &cpu)?;
    let c = Tensor::randn(0f32, 1.0, (rows, h), &cpu)?;
    let w = (Tensor::randn(0f32, 0.3, h, &cpu)? + 1.0)?;
    for (dt, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        // The reference reads the inputs as rounded to dt.
        let r64 = |t: &Tensor| -> Result<Vec<f64>> {
            Ok(t.to_dtype(dt)?
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1()?)
        };
        let (av, cv, wv) = (r64(&a)?, r64(&c)?, r64(&w)?);
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(dev)?) };
        let (ad, cd, wd) = (on(&a)?, on(&c)?, on(&w)?);
        let act: Vec<f64> = av
            .iter()
            .zip(&cv)
            .map(|(z, u)| z / (1.0 + (-z).exp()) * u)
            .collect();
        let e = max_rel(&swiglu(&ad, &cd)?, &Tensor::from_vec(act, (rows, h), &cpu)?)?;
        ensure!(e <= tol, "swiglu {dt:?}: {e:.2e} > {tol:.0e}");
        let (mut sv, mut yv) = (vec![0f64; rows * h], vec![0f64; rows * h]);
        for r in 0..rows {
            let row: Vec<f64> = (0..h).map(|j| av[r * h + j] + cv[r * h + j]).collect();
            let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / h as f64 + eps).sqrt();
            for j in 0..h {
                sv[r * h + j] = row[j];
                yv[r * h + j] = row[j] * inv * wv[j];
            }
        }
        let (s, y) = add_rms_norm(&ad, &cd, &wd, eps)?;
        ensure!(s.dims() == [rows, h] && y.dims() == [rows, h] && y.dtype() == dt);
        let es = max_rel(&s, &Tensor::from_vec(sv, (rows, h), &cpu)?)?;
        let ey = max_rel(&y, &Tensor::from_vec(yv, (rows, h), &cpu)?)?;
        ensure!(
            es <= tol && ey <= tol,
            "add_rms_norm {dt:?}: sum {es:.2e}, norm {ey:.2e} > {tol:.0e}"
        );
    }
    // Tracked inputs: autograd through the plain ops, against f64.
    let g = Tensor::randn(0f32, 1.0, (rows, h), &cpu)?;
    let f = |x: &Tensor, w: &Tensor| -> candle_core::Result<Tensor> {
        let u = x.affine(0.5, 0.1)?;
        let (s, y) = add_rms_norm(x, &u, w, eps).map_err(candle_core::Error::wrap)?;
        swiglu(&y, &s).map_err(candle_core::Error::wrap)
    };
    let var = |t: &Tensor, d: &Device, dt: DType| -> Result<Var> {
        Ok(Var::from_tensor(&t.to_dtype(dt)?.to_device(d)?)?)
    };
    let (dx, dw) = grads(
        f,
        &var(&a, dev, DType::F32)?,
        &var(&w, dev, DType::F32)?,
        &g.to_device(dev)?,
    )?;
    let (rx, rw) = grads(
        f,
        &var(&a, &cpu, DType::F64)?,
        &var(&w, &cpu, DType::F64)?,
        &g,
    )?;
    let (ex, ew) = (max_rel(&dx, &rx)?, max_rel(&dw, &rw)?);
    ensure!(
        ex <= 1e-5 && ew <= 1e-5,
        "tracked: dx {ex:.2e}, dw {ew:.2e}"
    );
    // Bad operands, before any launch.
    let short = Tensor::zeros((rows, h - 1), DType::F32, dev)?;
    let x = a.to_device(dev)?;
    let err = swiglu(&x, &short).unwrap_err().to_string();
    ensure!(err.contains("swiglu") && err.contains("up"), "{err}");
    let err = add_rms_norm(&x, &x.to_dtype(DType::BF16)?, &w.to_device(dev)?, eps)
        .unwrap_err()
        .to_string();
    ensure!(err.contains("residual"), "{err}");
    let err = add_rms_norm(&x, &x, &short.get(0)?, eps)
        .unwrap_err()
        .to_string();
    ensure!(err.contains("weight"), "{err}");
    Ok(())
}
candle_streamer::test_device!(swiglu_and_add_rms_norm_match_reference);
