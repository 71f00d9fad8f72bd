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
