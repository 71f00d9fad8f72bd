//! The host (CPU) dequantization every format shares: each format says how an
//! element's f32 value is made ([`DequantizeHost::dequantize_with`]); the f32
//! and bf16 outputs are written once, here.
use half::bf16;

/// A quantized tensor dequantized on the host, element by element in
/// row-major order.
pub trait DequantizeHost {
    /// Every element's f32 value (the format's product of code and scale, in
    /// bitsandbytes' order of operations) passed through `round`.
    fn dequantize_with<T: Send>(&self, round: impl Fn(f32) -> T + Send + Sync) -> Vec<T>;

    /// Every element in f32.
    fn dequantize_f32(&self) -> Vec<f32> {
        self.dequantize_with(|v| v)
    }

    /// Every element as bitsandbytes' kernels give it in bf16: the f32 value
    /// rounded once to nearest even.
    fn dequantize_bf16(&self) -> Vec<bf16> {
        self.dequantize_with(bf16::from_f32)
    }
}
