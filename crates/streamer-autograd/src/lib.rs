//! `streamer-autograd`: training through the `streamer-core` residency pool.
//!
//! - [`TrainableSequential`] (from `StreamedSequential::train()` via [`Train`]):
//!   forward keeps only block inputs; backward re-fetches each block's weights in
//!   reverse, recomputes it under Candle autograd, sends weight gradients to
//!   host buffers on their own stream, and returns one Candle `GradStore`.
//!   Blocks with a hand-written backward keep their activations instead of
//!   recomputing while an [`ActivationPolicy`] budget allows.
//! - [`CpuAdamW`], [`CpuSgd`]: fused, multi-threaded optimizers that update the
//!   host masters in place; they also implement candle-nn's `Optimizer`.
//! - [`Dropout`] / [`dropout`]: dropout whose masks the recompute replays.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{linear, VarBuilder, VarMap};
//! use streamer_autograd::Train;
//! use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
//!
//! let varmap = VarMap::new();
//! linear(3, 3, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("l"))?;
//! let blocks = vec![BlockSpec::module("l", |vb| linear(3, 3, vb))];
//! let model = StreamedSequential::from_varmap(&varmap, blocks, StreamConfig::default())?.train();
//! let loss = model.forward(&Tensor::ones((2, 3), DType::F32, &Device::Cpu)?)?.sum_all()?;
//! let grads = model.backward(&loss)?;
//! let (_, w) = &model.parameters()[0];
//! assert!(grads.get(w.as_tensor()).unwrap().device().is_cpu());
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod activations;
mod adamw;
mod device_adamw;
#[cfg(feature = "cuda")]
mod device_kernels;
mod device_step;
mod dropout;
mod grads;
mod host_optim;
mod host_saved;
mod host_update;
mod optim_state;
mod placed_adamw;
mod sgd;
mod state;
mod trainer;

pub use activations::{ActivationPlace, ActivationPolicy};
pub use adamw::{AdamWUpdate, CpuAdamW, Moments};
pub use device_adamw::DeviceAdamW;
pub use dropout::{dropout, dropout_ctx, dropout_keep, dropout_scale, with_seed, Dropout};
pub use grads::accumulate_grad;
pub use host_optim::{BufferName, HostOptimizer, MetaValue, UpdateRule};
pub use placed_adamw::{OptimizerPlace, PlacedAdamW};
pub use sgd::{CpuSgd, ParamsSgd, SgdUpdate};
pub use state::StateDtype;
pub use trainer::{Train, TrainableSequential};
