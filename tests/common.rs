//! Fixtures and comparisons shared by the topics.
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use streamer_core::StreamConfig;

/// Streaming on `dev` in `dtype`, `prefetch` blocks ahead, f32 host masters.
pub(crate) fn stream(dev: &Device, dtype: DType, prefetch: usize) -> StreamConfig {
    StreamConfig {
        device: dev.clone(),
        prefetch_ahead: prefetch,
        dtype,
        master_dtype: Some(DType::F32),
        ..Default::default()
    }
}

/// The compute dtype of the mixed-precision tests: bf16 on CUDA, f32 on the CPU.
pub(crate) fn compute_dtype(dev: &Device) -> DType {
    if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

/// The largest absolute difference of two value lists relative to the
/// largest magnitude of `want` (floored at 1e-12).
pub(crate) fn rel_err_vals(got: &[f64], want: &[f64]) -> Result<f64> {
    ensure!(
        got.len() == want.len(),
        "{} values, expected {}",
        got.len(),
        want.len()
    );
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-12);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    Ok(diff / scale)
}

/// [`rel_err_vals`] of two tensors of any float dtype and device.
pub(crate) fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    let vals = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_dtype(DType::F64)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f64>()?)
    };
    rel_err_vals(&vals(got)?, &vals(want)?)
}

/// Fails, naming `what`, unless `got` has `want`'s shape and is within `tol`
/// of it ([`rel_err`]).
pub(crate) fn ensure_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<()> {
    ensure!(
        got.dims() == want.dims(),
        "{what}: shape {:?} vs {:?}",
        got.dims(),
        want.dims()
    );
    let e = rel_err(got, want)?;
    ensure!(e <= tol, "{what}: relative error {e:.2e} > {tol:.0e}");
    Ok(())
}

/// Fails unless `r` is an error whose message mentions every one of `needles`.
pub(crate) fn expect_err<T: std::fmt::Debug, E: std::fmt::Display>(
    r: std::result::Result<T, E>,
    needles: &[&str],
) -> Result<()> {
    match r {
        Ok(t) => anyhow::bail!("expected an error, got {t:?}"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                ensure!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
            Ok(())
        }
    }
}

/// Streamed attention options with explicit `(q_chunk, kv_chunk)` chunks,
/// causal or not, the rest default.
pub(crate) fn streamed_opts(causal: bool, (q, kv): (usize, usize)) -> cqsa::AttentionOpts {
    cqsa::AttentionOpts {
        causal,
        mode: cqsa::Mode::Streamed,
        q_chunk: Some(q),
        kv_chunk: Some(kv),
        ..Default::default()
    }
}

/// Random CPU weights of a linear layer `(out, inp)` under `prefix`
/// (`{prefix}.weight` ~ N(0, `std`), `{prefix}.bias` ~ N(0, 0.1)), added to `m`.
pub(crate) fn insert_linear(
    m: &mut std::collections::HashMap<String, Tensor>,
    prefix: &str,
    (out, inp): (usize, usize),
    std: f32,
) -> Result<()> {
    let cpu = &Device::Cpu;
    m.insert(
        format!("{prefix}.weight"),
        Tensor::randn(0f32, std, (out, inp), cpu)?,
    );
    m.insert(
        format!("{prefix}.bias"),
        Tensor::randn(0f32, 0.1, out, cpu)?,
    );
    Ok(())
}

/// A VarBuilder in `dtype` on `dev` over the variables `vars`, by name: a
/// resident model built on it trains them.
pub(crate) fn var_builder(
    vars: &std::collections::HashMap<String, candle_core::Var>,
    dtype: DType,
    dev: &Device,
) -> candle_nn::VarBuilder<'static> {
    let tensors = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    candle_nn::VarBuilder::from_tensors(tensors, dtype, dev)
}

/// `weights` as variables on `dev` (the parameters of a resident reference).
pub(crate) fn vars_on(
    weights: &std::collections::HashMap<String, Tensor>,
    dev: &Device,
) -> Result<std::collections::HashMap<String, candle_core::Var>> {
    weights
        .iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                candle_core::Var::from_tensor(&v.to_device(dev)?)?,
            ))
        })
        .collect()
}

/// A fresh empty directory under the system's temporary one, unique to this
/// process and call: `streamer-{topic}-{name}-{pid}-{n}`.
pub(crate) fn temp_dir(topic: &str, name: &str) -> Result<std::path::PathBuf> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let k = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let pid = std::process::id();
    let d = std::env::temp_dir().join(format!("streamer-{topic}-{name}-{pid}-{k}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// This test binary run again on one test (`name`, exactly), single-threaded
/// and quiet: a child process for the tests that must crash or measure one.
pub(crate) fn child_test(name: &str) -> Result<std::process::Command> {
    let mut c = std::process::Command::new(std::env::current_exe()?);
    c.args([name, "--exact", "--nocapture", "--test-threads=1", "-q"]);
    Ok(c)
}

/// The tests' training loop: batches of 2 rows of `seq` tokens, one micro
/// batch, seed 0, a constant learning rate of 1e-2, no checkpoints.
pub(crate) fn loop_options(steps: usize, seq: usize) -> streamer_models::LoopOptions {
    streamer_models::LoopOptions {
        steps,
        batch: 2,
        micro_batches: 1,
        seq,
        seed: 0,
        lr: 1e-2,
        warmup: 0,
        decay: streamer_models::Decay::Constant,
        save_every: None,
        checkpoint_dir: None,
    }
}

/// Trains the adapters of `model` (a frozen base with LoRA set) for `steps`
/// steps of `opt` on `(x, y)` and returns the losses. At the first step no
/// parameter of the base has a gradient: it is frozen outside the layers too
/// (no gradient is made for the embedding, final norm or head).
pub(crate) fn train_adapters(
    model: &streamer_models::Llama,
    opt: &mut impl candle_nn::Optimizer,
    (x, y): (&Tensor, &Tensor),
    steps: usize,
) -> Result<Vec<f32>> {
    let mut losses = Vec::new();
    for s in 0..steps {
        let loss = model.loss(x, y)?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = model.backward(&loss)?;
        if s == 0 {
            for (name, v) in model.parameters() {
                ensure!(
                    grads.get(v.as_tensor()).is_none(),
                    "a gradient for frozen {name}"
                );
            }
        }
        opt.step(&grads)?;
        model.zero_grad()?;
    }
    Ok(losses)
}

/// Fails unless the driver counts at most `budget` bytes of the device's
/// `total` in use by this process besides what `cap` holds back.
pub(crate) fn within(
    dev: &Device,
    (total, budget): (usize, usize),
    cap: &streamer_core::DeviceCap,
) -> Result<()> {
    dev.synchronize()?;
    let free = streamer_core::free_device_memory(dev)?
        .ok_or_else(|| anyhow::anyhow!("a CUDA device reports its free memory"))?;
    let used = total - free - cap.held();
    ensure!(
        used <= budget,
        "{used} bytes in use with a budget of {budget}"
    );
    Ok(())
}
