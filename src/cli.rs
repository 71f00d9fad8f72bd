//! Command-line helpers shared by the examples: the `--device` and `--dtype` flags.
use candle_core::{DType, Device, Result};

/// `cpu`, `cuda`, or (when `None`) the first CUDA GPU if the build has CUDA and one
/// is present, else the CPU. A CUDA device gets its own compute stream.
pub fn device(arg: Option<&str>) -> Result<Device> {
    match arg {
        Some("cpu") => Ok(Device::Cpu),
        Some("cuda") => Device::new_cuda_with_stream(0),
        Some(d) => candle_core::bail!("unknown --device {d:?} (cpu or cuda)"),
        None => Ok(Device::new_cuda_with_stream(0).unwrap_or(Device::Cpu)),
    }
}

/// `f32`, `bf16` or `f16`.
///
/// ```
/// assert_eq!(candle_streamer::cli::parse_dtype("bf16")?, candle_core::DType::BF16);
/// assert!(candle_streamer::cli::parse_dtype("u8").is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => candle_core::bail!("unknown --dtype {s:?} (f32, bf16 or f16)"),
    })
}

/// A learning rate given as `flag`: finite and positive.
///
/// ```
/// use candle_streamer::cli::learning_rate;
/// assert_eq!(learning_rate("--lr", 3e-4)?, 3e-4);
/// for bad in [f64::NAN, f64::INFINITY, -1e-3, 0.0] {
///     assert!(learning_rate("--lr", bad).unwrap_err().to_string().contains("--lr"));
/// }
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn learning_rate(flag: &str, lr: f64) -> Result<f64> {
    if !(lr.is_finite() && lr > 0.0) {
        candle_core::bail!("{flag} {lr}: a learning rate must be finite and positive");
    }
    Ok(lr)
}

/// A finite value of at least 0 given as `flag` (a weight decay, a temperature).
pub fn non_negative(flag: &str, x: f64) -> Result<f64> {
    if !(x.is_finite() && x >= 0.0) {
        candle_core::bail!("{flag} {x}: must be finite and at least 0");
    }
    Ok(x)
}

/// AdamW's decoupled weight decay for learning rate `lr`: finite, at least 0,
/// and `lr * weight_decay < 1` (otherwise each step flips the weights' sign).
pub fn weight_decay(flag: &str, wd: f64, lr: f64) -> Result<f64> {
    non_negative(flag, wd)?;
    if lr * wd >= 1.0 {
        candle_core::bail!(
            "{flag} {wd}: with learning rate {lr}, lr * weight decay must be below 1"
        );
    }
    Ok(wd)
}

/// A probability mass in `(0, 1]` given as `flag` (top-p).
pub fn fraction(flag: &str, x: f64) -> Result<f64> {
    if !(x > 0.0 && x <= 1.0) {
        candle_core::bail!("{flag} {x}: must be in (0, 1]");
    }
    Ok(x)
}

/// A count given as `flag`, in `1..=max` (zero and absurd sizes are errors).
///
/// ```
/// use candle_streamer::cli::count;
/// assert_eq!(count("--batch", 16, 1 << 20)?, 16);
/// assert!(count("--batch", 0, 1 << 20).unwrap_err().to_string().contains("--batch 0"));
/// assert!(count("--batch", 1 << 21, 1 << 20).is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn count(flag: &str, n: usize, max: usize) -> Result<usize> {
    if n == 0 || n > max {
        candle_core::bail!("{flag} {n}: must be between 1 and {max}");
    }
    Ok(n)
}

/// The streaming window's look-ahead for `blocks` blocks: an explicit
/// `--prefetch` beyond `blocks - 1` is an error (never clamped); the default is
/// 1, or 0 for a single block.
pub fn prefetch(flag: &str, given: Option<usize>, blocks: usize) -> Result<usize> {
    let most = blocks.saturating_sub(1);
    match given {
        Some(p) if p > most => candle_core::bail!(
            "{flag} {p}: the model has {blocks} blocks, so at most {most} can be loaded ahead"
        ),
        Some(p) => Ok(p),
        None => Ok(most.min(1)),
    }
}

/// `--seq` against the model's context: an explicit value beyond
/// `max_position_embeddings` is an error (never clamped); without one, the
/// default is shortened to the context.
pub fn seq_len(given: Option<usize>, default: usize, context: usize) -> Result<usize> {
    match given {
        Some(s) if s > context => candle_core::bail!(
            "--seq {s} is beyond the model's context (max_position_embeddings = {context})"
        ),
        Some(s) => count("--seq", s, context),
        None => Ok(default.min(context)),
    }
}

/// `--resume` with an explicit `--preset` or `--config` (`requested`, described
/// as `what`): the checkpoint's configuration `saved` (read from `saved_path`)
/// must be the same, or the error names both and the fields that differ.
pub fn same_config(
    what: &str,
    requested: &streamer_models::LlamaConfig,
    saved_path: &std::path::Path,
    saved: &streamer_models::LlamaConfig,
) -> Result<()> {
    let diff = requested.differences(saved)?;
    if diff.is_empty() {
        return Ok(());
    }
    let name = saved.preset_name().unwrap_or("a custom config");
    candle_core::bail!(
        "--resume: {what} differs from the checkpoint's config {} ({name}): {} \
         (requested vs checkpoint); drop {what} to continue the checkpoint, or train into another --out",
        saved_path.display(),
        diff.join(", ")
    )
}

/// An `--activations` value (`recompute`, `offload`, `keep:BYTES`,
/// `auto[:FRACTION]`), parsed and checked against `dev` before any work.
pub fn activation_policy(value: &str, dev: &Device) -> Result<streamer_autograd::ActivationPolicy> {
    let p: streamer_autograd::ActivationPolicy = value
        .parse()
        .map_err(|e: candle_core::Error| e.context(format!("--activations {value:?}")))?;
    p.validate(dev)
        .map_err(|e| e.context(format!("--activations {value:?}")))?;
    Ok(p)
}
