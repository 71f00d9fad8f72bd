//! The `--device` and `--dtype` flags the examples share, and what they
//! resolve to.
use candle_core::{DType, Device};
use candle_streamer::cli;

/// Where the example computes, and in which dtype.
#[derive(clap::Args, Debug)]
pub struct DeviceFlags {
    /// Compute dtype: f32, bf16 or f16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Device: cpu or cuda (default: cuda when built with it and present).
    #[arg(long)]
    pub device: Option<String>,
}

impl DeviceFlags {
    /// The device, and the compute dtype (as given, else bf16 on CUDA and
    /// f32 on the CPU).
    pub fn resolve(&self) -> candle_core::Result<(Device, DType)> {
        let dev = cli::device(self.device.as_deref())?;
        let dtype = match self.dtype.as_deref() {
            Some(s) => cli::parse_dtype(s)?,
            None if dev.is_cuda() => DType::BF16,
            None => DType::F32,
        };
        Ok((dev, dtype))
    }
}
