//! `streamer_models::cross_entropy` (no f32 copy of the logits, gradient in
//! their dtype): the loss against an f64 loop and candle-nn's
//! `cross_entropy`, the logits' gradient against Candle autograd through
//! candle-nn's version; bf16 logits within a bf16 bound; bad input.
use crate::fused_mlp::rel_err;
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use streamer_models::cross_entropy;

/// The mean loss and its gradient in f64 for `x (rows, vocab)` and targets.
fn reference(x: &[f64], t: &[u32], vocab: usize) -> (f64, Vec<f64>) {
    let rows = t.len();
    let (mut loss, mut grad) = (0f64, vec![0f64; x.len()]);
    for r in 0..rows {
        let row = &x[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        loss += (lse - row[t[r] as usize]) / rows as f64;
        for j in 0..vocab {
            let onehot = if j == t[r] as usize { 1.0 } else { 0.0 };
            grad[r * vocab + j] = ((row[j] - lse).exp() - onehot) / rows as f64;
        }
    }
    (loss, grad)
}

fn case(rows: usize, vocab: usize, scale: f64, seed: u32) -> Result<(Tensor, Vec<u32>)> {
    let x = (Tensor::randn(0f64, 1.0, (rows, vocab), &Device::Cpu)? * scale)?;
    let t = (0..rows as u32)
        .map(|r| (r.wrapping_mul(2_654_435_761).wrapping_add(seed)) % vocab as u32)
        .collect();
    Ok((x, t))
}

fn to_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?)
}

fn cross_entropy_matches_reference_and_candle(dev: &Device) -> Result<()> {
    // A vocabulary below one block of threads, one not a multiple of it, and
    // large logits (the log-sum-exp must subtract the row max).
    // Tolerances: 1e-5 for unit logits; for logits of magnitude ~180 the f32
    // inputs alone are rounded by ulp(180) ~ 1.5e-5, and exp(x - lse) carries
    // that relative error (the CUDA path computes in f32, the CPU in f64).
    for (rows, vocab, scale, tol) in [
        (5, 3, 1.0, 1e-5),
        (37, 1000, 1.0, 1e-5),
        (8, 517, 60.0, 1e-4),
    ] {
        let (x64, t) = case(rows, vocab, scale, 7)?;
        let (want_loss, want_grad) = reference(&x64.flatten_all()?.to_vec1()?, &t, vocab);
        let x = Var::from_tensor(&x64.to_dtype(DType::F32)?.to_device(dev)?)?;
        let targets = Tensor::new(t.as_slice(), dev)?;
        let loss = cross_entropy(x.as_tensor(), &targets)?;
        let grad = loss
            .backward()?
            .get(x.as_tensor())
            .expect("logits' gradient")
            .clone();
        let plain = candle_nn::loss::cross_entropy(x.as_tensor(), &targets)?;
        let plain_grad = plain
            .backward()?
            .get(x.as_tensor())
            .expect("plain gradient")
            .clone();
        let got = loss.to_scalar::<f32>()? as f64;
        let e_ref = (got - want_loss).abs() / want_loss.abs();
        let e_plain = (got - plain.to_scalar::<f32>()? as f64).abs() / want_loss.abs();
        ensure!(
            e_ref < tol,
            "{rows}x{vocab}: loss {got} vs f64 {want_loss} (rel {e_ref:e})"
        );
        ensure!(
            e_plain < tol,
            "{rows}x{vocab}: loss vs candle-nn rel {e_plain:e}"
        );
        let want = Tensor::from_vec(want_grad, (rows, vocab), &Device::Cpu)?;
        let (g_ref, g_plain) = (rel_err(&grad, &want)?, rel_err(&grad, &plain_grad)?);
        ensure!(g_ref < tol, "{rows}x{vocab}: gradient vs f64 rel {g_ref:e}");
        ensure!(
            g_plain < tol,
            "{rows}x{vocab}: gradient vs candle-nn autograd rel {g_plain:e}"
        );
        ensure!(grad.dtype() == DType::F32 && grad.dims() == [rows, vocab]);
    }
    Ok(())
}
candle_streamer::test_device!(cross_entropy_matches_reference_and_candle);

fn cross_entropy_bf16_logits_within_bound(dev: &Device) -> Result<()> {
    let (rows, vocab) = (33, 700);
    let (x64, t) = case(rows, vocab, 2.0, 3)?;
    let xb = x64.to_dtype(DType::BF16)?;
    // The reference sees the same bf16-rounded logits: what remains is the
    // kernel's f32 arithmetic (loss) and the gradient's rounding to bf16.
    let (want_loss, want_grad) = reference(&to_f64(&xb)?, &t, vocab);
    let x = Var::from_tensor(&xb.to_device(dev)?)?;
    let loss = cross_entropy(x.as_tensor(), &Tensor::new(t.as_slice(), dev)?)?;
    let grad = loss
        .backward()?
        .get(x.as_tensor())
        .expect("logits' gradient")
        .clone();
    ensure!(
        loss.dtype() == DType::F32,
        "the loss is f32, got {:?}",
        loss.dtype()
    );
    ensure!(
        grad.dtype() == DType::BF16,
        "the gradient keeps the logits' dtype"
    );
    let got = loss.to_scalar::<f32>()? as f64;
    let e = (got - want_loss).abs() / want_loss.abs();
    ensure!(
        e < 1e-5,
        "bf16 logits: loss {got} vs {want_loss} (rel {e:e})"
    );
    let want = Tensor::from_vec(want_grad, (rows, vocab), &Device::Cpu)?;
    // bf16 keeps 8 bits: 2^-8 of the largest gradient, with margin.
    let g = rel_err(&grad, &want)?;
    ensure!(g < 8e-3, "bf16 gradient rel {g:e} (bound 8e-3)");
    Ok(())
}
candle_streamer::test_device!(cross_entropy_bf16_logits_within_bound);

fn cross_entropy_rejects_bad_input(dev: &Device) -> Result<()> {
    let x = Tensor::zeros((4, 10), DType::F32, dev)?;
    let msg = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let e = msg(cross_entropy(&x, &Tensor::zeros(3, DType::U32, dev)?));
    ensure!(
        e.contains("(4,) u32") && e.contains("[3]"),
        "wrong target count: {e}"
    );
    let e = msg(cross_entropy(&x, &Tensor::zeros(4, DType::I64, dev)?));
    ensure!(e.contains("I64"), "wrong target dtype: {e}");
    let e = msg(cross_entropy(
        &Tensor::zeros((4, 10), DType::U32, dev)?,
        &Tensor::zeros(4, DType::U32, dev)?,
    ));
    ensure!(e.contains("U32"), "integer logits: {e}");
    let e = msg(cross_entropy(
        &Tensor::zeros((0, 10), DType::F32, dev)?,
        &Tensor::zeros(0, DType::U32, dev)?,
    ));
    ensure!(e.contains("0 rows"), "no rows: {e}");
    let bad = Tensor::new(&[1u32, 2, 10, 0], dev)?;
    if dev.is_cpu() {
        let e = msg(cross_entropy(&x, &bad));
        ensure!(e.contains("target 10 of row 2"), "out-of-range target: {e}");
    } else {
        // Checked on the device without a sync: the loss cannot look valid.
        let l = cross_entropy(&x, &bad)?.to_scalar::<f32>()?;
        ensure!(l.is_nan(), "an out-of-range target gave loss {l}");
    }
    Ok(())
}
candle_streamer::test_device!(cross_entropy_rejects_bad_input);

/// The chunked head and loss (`linear_cross_entropy`) against the f64
/// reference on `h w^T` (loss, and the gradients of `h` and `w` through the
/// logits' f64 gradient), for chunks that divide the rows, that do not, and
/// one chunk of all rows; f32 within 1e-5 relative. The gradients made in the
/// forward serve the first backward, scaled by its upstream gradient; a
/// second backward through the same loss makes them again.
fn linear_cross_entropy_matches_reference(dev: &Device) -> Result<()> {
    use streamer_models::cross_entropy::linear_cross_entropy;
    let (rows, hidden, vocab) = (10, 6, 17);
    let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, hidden), dev)?)?;
    let w = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (vocab, hidden), dev)? * 0.5)?)?;
    let t: Vec<u32> = (0..rows as u32)
        .map(|r| (r * 7 + 3) % vocab as u32)
        .collect();
    let targets = Tensor::new(t.as_slice(), dev)?;
    let logits = h.as_tensor().matmul(&w.as_tensor().t()?)?;
    let (want_loss, g_logits) = reference(&to_f64(&logits)?, &t, vocab);
    // d h = G w, d w = G^T h in f64.
    let g = Tensor::from_vec(g_logits, (rows, vocab), &Device::Cpu)?;
    let (h64, w64) = (
        h.as_tensor()
            .to_dtype(DType::F64)?
            .to_device(&Device::Cpu)?,
        w.as_tensor()
            .to_dtype(DType::F64)?
            .to_device(&Device::Cpu)?,
    );
    let (want_dh, want_dw) = (g.matmul(&w64)?, g.t()?.matmul(&h64)?);
    for chunk in [3, 5, rows, 64] {
        let loss = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &targets, chunk)?;
        let got = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        ensure!(
            ((got - want_loss) / want_loss).abs() <= 1e-5,
            "chunk {chunk}: loss {got} vs {want_loss}"
        );
        // The gradients made with the loss, for an upstream gradient of 1;
        // a second backward through the same loss (scaled by 0.5) computes
        // them again; a fresh scaled loss scales the ones made with it.
        let again = (&loss * 0.5)?;
        let fresh = (linear_cross_entropy(h.as_tensor(), w.as_tensor(), &targets, chunk)? * 0.5)?;
        for (how, l, k) in [
            ("first", &loss, 1.0),
            ("again", &again, 0.5),
            ("scaled", &fresh, 0.5),
        ] {
            let grads = l.backward()?;
            for (what, v, want) in [("h", &h, &want_dh), ("w", &w, &want_dw)] {
                let got = grads.get(v.as_tensor()).expect("a gradient");
                let got = (got.to_dtype(DType::F64)?.to_device(&Device::Cpu)? / k)?;
                let e = rel_err(&got, want)?;
                ensure!(
                    e <= 1e-5,
                    "chunk {chunk}, {how}: d{what} relative error {e:.2e}"
                );
            }
        }
    }
    // Nothing to differentiate: the loss alone.
    let loss = linear_cross_entropy(
        &h.as_tensor().detach(),
        &w.as_tensor().detach(),
        &targets,
        3,
    )?;
    let got = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    ensure!(
        ((got - want_loss) / want_loss).abs() <= 1e-5,
        "untracked: loss {got} vs {want_loss}"
    );
    ensure!(linear_cross_entropy(h.as_tensor(), w.as_tensor(), &targets, 0).is_err());
    Ok(())
}
candle_streamer::test_device!(linear_cross_entropy_matches_reference);
