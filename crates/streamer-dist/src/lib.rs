//! `streamer-dist`: more than one GPU (or CPU thread) working on one model.
//!
//! - [`Collective`]: all-reduce, reduce-scatter, all-gather, a ring shift and a
//!   barrier over the ranks of a group, each with a timeout and an error that
//!   names the rank and the operation, never a hang. [`HostCollective`] (ranks
//!   are threads meeting in host memory: the CPU path, and CI's) and, with the
//!   `cuda` feature, `NcclCollective` (one GPU per thread, NCCL through
//!   cudarc) implement it.
//! - [`ring_attention`]: exact sequence-parallel attention. Q/K/V are split
//!   along the sequence ([`SeqSplit::ZigZag`] balances a causal mask), K/V
//!   blocks go around the ring, partial outputs merge by log-sum-exp; forward
//!   and backward through cqsa's low-level ops.
//! - [`DataParallel`]: the same streamed model on every rank over one copy of
//!   the host weights, each rank on its micro-batch, gradients reduced through
//!   the collective, the optimizer stepping each weight once.
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor};
//! use streamer_dist::{ring_attention_forward, Collective, HostCollective, RingOpts, SeqSplit};
//!
//! // Causal attention over 8 positions, split zig-zag over 2 threads.
//! let (q, k, v) = (
//!     Tensor::randn(0f32, 1.0, (1, 2, 8, 4), &Device::Cpu)?,
//!     Tensor::randn(0f32, 1.0, (1, 2, 8, 4), &Device::Cpu)?,
//!     Tensor::randn(0f32, 1.0, (1, 2, 8, 4), &Device::Cpu)?,
//! );
//! let opts = RingOpts { causal: true, ..Default::default() };
//! let ranks = HostCollective::group(2, std::time::Duration::from_secs(10))?;
//! let parts = std::thread::scope(|s| {
//!     let hs: Vec<_> = ranks.iter().map(|c| {
//!         let (q, k, v, opts) = (&q, &k, &v, &opts);
//!         s.spawn(move || -> candle_core::Result<Tensor> {
//!             let shard = |t: &Tensor| SeqSplit::ZigZag.shard(t, 2, c.rank(), 2);
//!             Ok(ring_attention_forward(&shard(q)?, &shard(k)?, &shard(v)?, c, opts)?.0)
//!         })
//!     }).collect();
//!     hs.into_iter().map(|h| h.join().unwrap()).collect::<candle_core::Result<Vec<_>>>()
//! })?;
//! let got = SeqSplit::ZigZag.unshard(&parts, 2)?;
//! let want = cqsa::attention(&q, &k, &v, &cqsa::AttentionOpts { causal: true, ..Default::default() })?;
//! assert!((got - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod collective;
mod data_parallel;
mod host;
#[cfg(feature = "cuda")]
mod nccl;
mod ring;

pub use collective::{Collective, Member, DEFAULT_TIMEOUT};
pub use data_parallel::{DataParallel, GradReduction, StepReport};
pub use host::HostCollective;
#[cfg(feature = "cuda")]
pub use nccl::NcclCollective;
pub use ring::{
    ring_attention, ring_attention_backward, ring_attention_forward, RingOpts, SeqSplit,
};
