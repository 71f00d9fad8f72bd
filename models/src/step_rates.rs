//! The speeds a device plan's expected tokens/s is made of, measured on the
//! device that will train: one decoder layer's training forward and backward
//! over one piece of the step (the real kernels at the real shapes), and the
//! host<->device copy bandwidths.
use crate::config::LlamaConfig;
use crate::cross_entropy::{linear_cross_entropy, linear_cross_entropy_chunk};
use crate::llama::{DecoderLayer, Rope};
use crate::step_shape::StepShape;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::time::Instant;
use streamer_core::ManualBackward;
use streamer_device::{measure_copy_gbps, CopyDirection};

/// Bytes each bandwidth probe copies (large enough to reach the link's rate).
const PROBE_BYTES: usize = 256 << 20;

/// Measured speeds of one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepRates {
    /// Sequences of the piece the layer was timed over.
    pub piece_rows: usize,
    /// Seconds of one layer's training forward over the piece.
    pub layer_forward_s: f64,
    /// Seconds of one layer's backward over the piece.
    pub layer_backward_s: f64,
    /// Seconds of the vocabulary projection and the loss over the piece,
    /// forward and backward (chunked as `Llama::loss` runs them).
    pub head_s: f64,
    /// Host-to-device copy bandwidth from page-locked memory, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// Device-to-host copy bandwidth into page-locked memory, bytes/s.
    pub d2h_bytes_per_s: f64,
}

impl StepRates {
    /// Times layer 0 of `cfg` (random weights, no adapters) and the head and
    /// loss over `piece_rows` sequences of `shape` on `device`, best of two after a warm-up (the
    /// warm-up also compiles the kernels, once per process), and probes the
    /// copy bandwidths. Allocates one layer's weights and one piece's
    /// activations on the device and frees them before returning.
    pub fn measure(
        cfg: &LlamaConfig,
        shape: StepShape,
        piece_rows: usize,
        device: &Device,
    ) -> Result<Self> {
        if !device.is_cuda() {
            bail!("StepRates::measure times a CUDA device, not {device:?}");
        }
        let layer = random_layer(cfg, shape, device)?;
        let extras = Rope::new(cfg, shape.dtype, device)?.extras(shape.seq)?;
        let x = Tensor::randn(0f32, 1.0, (piece_rows, shape.seq, cfg.hidden_size), device)?
            .to_dtype(shape.dtype)?;
        let mut best = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
        for round in 0..3 {
            let (f, b) = time_layer(&layer, &x, &extras, device)?;
            let h = time_head(cfg, &x, device)?;
            if round > 0 {
                best = (best.0.min(f), best.1.min(b), best.2.min(h));
            }
        }
        Ok(Self {
            piece_rows,
            layer_forward_s: best.0,
            layer_backward_s: best.1,
            head_s: best.2,
            h2d_bytes_per_s: copy_rate(device, CopyDirection::HostToDevice)?,
            d2h_bytes_per_s: copy_rate(device, CopyDirection::DeviceToHost)?,
        })
    }
}

/// Bytes per second of page-locked copies in `direction`.
fn copy_rate(device: &Device, direction: CopyDirection) -> Result<f64> {
    Ok(measure_copy_gbps(device, direction, PROBE_BYTES, 4)? * 1e9)
}

/// Layer 0 of `cfg` over random weights (`N(0, 0.02)`; norms at 1).
fn random_layer(cfg: &LlamaConfig, shape: StepShape, device: &Device) -> Result<DecoderLayer> {
    let mut weights = HashMap::new();
    for (name, dims, _) in cfg.layer_weights(0) {
        let t = if dims.len() == 1 {
            Tensor::ones(dims, shape.dtype, device)?
        } else {
            (Tensor::randn(0f32, 1.0, dims, device)? * 0.02)?.to_dtype(shape.dtype)?
        };
        weights.insert(name, t);
    }
    let vb = VarBuilder::from_tensors(weights, shape.dtype, device);
    DecoderLayer::for_layer(cfg, 0, vb.pp("model.layers.0"))
}

/// Seconds of the head and loss over `x`'s rows, forward and backward, with
/// a random vocabulary projection.
fn time_head(cfg: &LlamaConfig, x: &Tensor, device: &Device) -> Result<f64> {
    let (v, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let h = Var::from_tensor(&x.reshape(((), hidden))?)?;
    let w =
        Var::from_tensor(&(Tensor::randn(0f32, 0.02, (v, hidden), device)?).to_dtype(x.dtype())?)?;
    let targets = Tensor::rand(0f32, v as f32, h.dim(0)?, device)?
        .floor()?
        .clamp(0f32, (v - 1) as f32)?
        .to_dtype(DType::U32)?;
    let chunk = linear_cross_entropy_chunk(v, x.dtype());
    device.synchronize()?;
    let t0 = Instant::now();
    let grads = linear_cross_entropy(&h, &w, &targets, chunk)?.backward()?;
    device.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    drop(grads);
    Ok(secs)
}

/// Seconds of one training forward and one backward of `layer` over `x`.
fn time_layer(
    layer: &DecoderLayer,
    x: &Tensor,
    extras: &[Tensor],
    device: &Device,
) -> Result<(f64, f64)> {
    device.synchronize()?;
    let t0 = Instant::now();
    let (y, saved) = layer.forward_train(x, extras)?;
    device.synchronize()?;
    let t1 = Instant::now();
    let grad = y.ones_like()?;
    device.synchronize()?;
    let t2 = Instant::now();
    let (dx, grads) = layer.backward(saved, &grad)?;
    device.synchronize()?;
    let t3 = Instant::now();
    drop((dx, grads));
    Ok(((t1 - t0).as_secs_f64(), (t3 - t2).as_secs_f64()))
}
