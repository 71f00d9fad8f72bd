//! `cqsa`: exact attention by chunks, as a Candle custom op with forward and
//! backward on CPU and CUDA, and an out-of-core mode for sequences that do not fit
//! on the device.
//!
//! [`attention`] computes `softmax(q k^T * scale + mask) v` without ever forming
//! the `seq_q x seq_k` matrix: keys are visited in chunks with an online softmax,
//! and the forward keeps the log-sum-exp of every row so that the backward
//! recomputes the probabilities chunk by chunk. The result is differentiable through
//! Candle's backprop (`loss.backward()` gives dq, dk, dv).
//!
//! Shapes: `q` is `(batch, heads_q, seq_q, head_dim)`, `k` and `v` are
//! `(batch, heads_kv, seq_k, head_dim)` with `heads_q` a multiple of `heads_kv`
//! (grouped-query attention: query head `h` reads key/value head
//! `h / (heads_q / heads_kv)`). Dtypes f32, f16, bf16 (all three the same);
//! arithmetic is f32 in every path. `head_dim` is 1 to [`MAX_HEAD_DIM`].
//!
//! Causal masking with `seq_q != seq_k` is aligned **bottom-right**: query `i` sees
//! key `j` iff `j <= i + seq_k - seq_q`, so the last query sees every key (the
//! convention of FlashAttention 2.1+ and of decoding with a KV cache). When
//! `seq_q > seq_k` the first `seq_q - seq_k` queries see no key; their output is 0
//! and their gradient 0.
//!
//! Masks and scores of real models, through [`AttentionOpts`]: sliding windows
//! (`window_left`, `window_right`; Mistral, Qwen2, Gemma 2's local layers) with
//! flash-attn's semantics, logit soft-capping (`softcap`, Gemma 2), and
//! variable-length packed sequences (`cu_seqlens_q`, `cu_seqlens_k`), each
//! forward and backward, CPU and CUDA, resident and streamed. An additive bias
//! or ALiBi is not supported. The low-level ops take the resolved mask as
//! [`Scores`] ([`attention_forward_with`], [`attention_backward_with`]).
//!
//! When the inputs, output and workspace do not fit in the device's free memory (or
//! in the [`Budget`] given in [`AttentionOpts`]), the call runs in streamed mode:
//! the work is split into query and key chunks, every chunk pair runs resident, and
//! partial outputs are merged by their log-sum-exp (exact up to rounding). The
//! planner behind that choice is exposed by [`estimate`], which allocates nothing.
//! Its time model uses this device's measured rates when [`calibrate()`] has
//! stored them (see [`mod@calibrate`]), and built-in ones otherwise;
//! [`Plan::rates`] says which.
//!
//! [`attention_saved`] runs the same call outside autograd and hands back its
//! backward: a streamed call's gradients then skip Candle's host-side
//! bookkeeping (an all-ones upstream gradient, zero-filled accumulators),
//! seconds at a million tokens.
//!
//! Speed on CUDA: the forward and backward kernels use tensor cores for f16/bf16
//! at head dims 64 and 128 (other head dims and f32 take simpler kernels). On
//! Hopper GPUs (compute capability 9.0: H100, H200), with the crate built for
//! them (`CUDA_COMPUTE_CAP=90`), those calls run kernels written for that chip
//! (`wgmma` fed by the tensor memory accelerator, warp-specialised), and the
//! forward covers head dim 256 as well; [`set_hopper_kernels`] switches back
//! to the portable ones, which every other GPU runs. A packed (varlen) call on
//! those kernels is one launch over every document, as flash-attn's varlen
//! kernels. Both tensor-core backwards
//! sum dq in f32 across key blocks (atomics, or bulk reduce-adds on Hopper) in
//! an order that varies from run to run, as FlashAttention and cuDNN do, so dq
//! repeats only to f32 rounding; dk and dv repeat exactly.
//! Candle allocates through CUDA's stream-ordered pool, which by default returns
//! freed memory to the driver at every synchronisation, so a loop of short calls
//! maps its buffers again each time. Keeping freed memory pooled, as PyTorch's
//! caching allocator does (`streamer_device::retain_freed_device_memory`, or the
//! pool's release threshold), avoids that; the attention bench runs that way.
//!
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use cqsa::{attention, estimate, AttentionOpts, AttentionShape, Budget, Mode};
//!
//! let dev = Device::Cpu;
//! let q = Tensor::randn(0f32, 1.0, (1, 4, 10, 16), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 2, 12, 16), &dev)?; // 2 kv heads: GQA
//! let v = Tensor::randn(0f32, 1.0, (1, 2, 12, 16), &dev)?;
//! let o = attention(&q, &k, &v, &AttentionOpts { causal: true, ..Default::default() })?;
//! assert_eq!(o.dims(), &[1, 4, 10, 16]);
//!
//! // Causal with a sliding window of 4 keys left of the diagonal, soft-capped.
//! let opts = AttentionOpts { causal: true, window_left: Some(4), softcap: Some(30.0), ..Default::default() };
//! let o = attention(&q, &k, &v, &opts)?;
//! assert_eq!(o.dims(), &[1, 4, 10, 16]);
//!
//! let shape = AttentionShape { b: 1, hq: 4, hkv: 2, nq: 10, nk: 12, d: 16, dtype: DType::F32, causal: true };
//! let plan = estimate(&shape, &Budget::detect(&dev)?)?;
//! assert_eq!(plan.mode, Mode::Resident);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod calibrate;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod doctor;
#[cfg(feature = "cuda")]
mod hopper;
#[cfg(feature = "cuda")]
mod launch;
mod mask;
mod merge;
mod op;
mod packed;
mod plan;
mod saved;
#[cfg(feature = "cuda")]
mod segs;
mod shape;
pub mod staging;
mod stream;
mod timing;
mod varlen;

use candle_core::{Device, Result, Tensor};

pub use calibrate::{calibrate, Calibration, RatesSource};
pub use mask::Scores;
pub use merge::merge_by_lse;
pub use op::{
    attention_backward, attention_backward_with, attention_forward, attention_forward_with,
};
pub use plan::{estimate, estimate_with, Budget, Mode, Plan};
pub use saved::{attention_saved, SavedAttention};
pub use shape::AttentionShape;

/// The largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 256;

/// Options of [`attention`]. `AttentionOpts::default()` is non-causal attention
/// with scale `1/sqrt(head_dim)`, the mode chosen by the planner from the free
/// memory of the inputs' device.
///
/// Masks, as in flash-attn: with `i' = i + seq_k - seq_q` (query `i` aligned
/// bottom-right), key `j` is visible from query `i` iff
/// `i' - window_left <= j <= i' + window_right`, a `None` window being no
/// bound on that side, and `causal` meaning `window_right = 0`. A window of
/// `seq_q + seq_k` or more hides nothing. A row that sees no key (possible with
/// windows and with causal `seq_q > seq_k`) has output 0, log-sum-exp `-inf` and
/// gradient 0. Every mask works with every head dim `1..=MAX_HEAD_DIM` and dtype,
/// forward and backward, resident and streamed; on CUDA the tensor-core kernels
/// (f16/bf16 at head dims 64 and 128) skip the key tiles a block cannot see, so a
/// window `w` at `N` tokens costs `O(N w)`, and other head dims fall back to the
/// simple kernels.
#[derive(Debug, Clone, Default)]
pub struct AttentionOpts {
    /// Causal mask, aligned bottom-right when `seq_q != seq_k` (see the crate docs).
    /// Implies `window_right = 0`; any other `window_right` is an error.
    pub causal: bool,
    /// Sliding window to the left: query `i` sees keys down to `i' - window_left`
    /// (see above; `Some(0)`: none left of the diagonal). `None`: unbounded.
    pub window_left: Option<usize>,
    /// Sliding window to the right: query `i` sees keys up to `i' + window_right`.
    /// `None`: unbounded (or 0 when `causal`).
    pub window_right: Option<usize>,
    /// Logit soft-capping (Gemma 2): every scaled score `s` becomes
    /// `softcap * tanh(s / softcap)` before the mask and the softmax; the
    /// backward multiplies by `1 - tanh^2`. Must be positive and finite.
    pub softcap: Option<f32>,
    /// Variable-length packed sequences, as in flash-attn's `flash_attn_varlen`:
    /// offsets along the query axis of the documents packed into every (batch,
    /// head) row (`[0, n1, n1 + n2, ..., seq_q]`, never decreasing; equal
    /// neighbours are an empty document). No query attends across documents,
    /// the masks above apply inside each document (aligned bottom-right to it),
    /// and a document without keys gives output 0. Set with `cu_seqlens_k`.
    /// A resident call on CUDA in f16/bf16 at head dim 64 or 128 is one launch of
    /// the tensor-core kernels over every document (a block per document's
    /// tile, as flash-attn's varlen kernels); otherwise (f32, other head dims,
    /// the CPU, streamed) each document runs as its own call. On Hopper a tile
    /// past the end of a document reads its neighbour's keys and values (TMA
    /// loads whole tiles), masked to weight 0, so a non-finite value there (inf,
    /// NaN) reaches this document as NaN.
    pub cu_seqlens_q: Option<Vec<usize>>,
    /// The documents' offsets along the key axis (`[0, ..., seq_k]`), as many as
    /// in `cu_seqlens_q`.
    pub cu_seqlens_k: Option<Vec<usize>>,
    /// Multiplier of `q k^T`; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Force resident or streamed execution; `Mode::Auto` lets the planner decide.
    pub mode: Mode,
    /// Memory budget to plan against; `None` detects the free memory of the
    /// compute device.
    pub budget: Option<Budget>,
    /// Device that computes. `None`: the inputs' device. Host (CPU) inputs with a
    /// CUDA device here run on that device, streamed chunk by chunk when needed,
    /// and the output stays on the host.
    pub device: Option<Device>,
    /// Override the planner's query chunk (rows) in streamed mode.
    pub q_chunk: Option<usize>,
    /// Override the planner's key chunk (rows) in streamed mode.
    pub kv_chunk: Option<usize>,
    /// Print the plan and progress of streamed calls to stderr (also enabled by
    /// the environment variable `CQSA_VERBOSE=1`).
    pub verbose: bool,
}

/// Whether CUDA calls may use the Hopper kernels (see [`set_hopper_kernels`]):
/// 0 not decided yet (the environment decides at the first call), 1 on, 2 off.
static HOPPER_KERNELS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Lets CUDA attention use the Hopper kernels (`wgmma` and TMA; f16/bf16, head
/// dims 64 and 128, and 256 in the forward) on GPUs of compute capability 9.0
/// (H100, H200), or makes every call use the portable tensor-core kernels (like
/// PyTorch's `torch.backends.cuda.enable_flash_sdp`). The default is on, unless
/// the environment variable `CQSA_HOPPER_KERNELS` is `0` when the first call
/// asks. Both are exact attention and agree to rounding; the switch is
/// process-wide and meant for comparing them or working around a problem.
/// Without the `cuda` feature it changes nothing.
pub fn set_hopper_kernels(enabled: bool) {
    HOPPER_KERNELS.store(
        if enabled { 1 } else { 2 },
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// Whether the Hopper kernels are on ([`set_hopper_kernels`]).
pub fn hopper_kernels_enabled() -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    match HOPPER_KERNELS.load(Relaxed) {
        0 => {
            let on = std::env::var("CQSA_HOPPER_KERNELS").map_or(true, |v| v.trim() != "0");
            // A concurrent set_hopper_kernels wins over the environment.
            let _ = HOPPER_KERNELS.compare_exchange(0, if on { 1 } else { 2 }, Relaxed, Relaxed);
            HOPPER_KERNELS.load(Relaxed) == 1
        }
        x => x == 1,
    }
}

/// Whether calls on `dev` can run the Hopper kernels (see
/// [`set_hopper_kernels`], which this ignores): the crate built for compute
/// capability 9.0 and `dev` a GPU of that capability. False on the CPU and
/// without the `cuda` feature.
pub fn hopper_kernels_available(dev: &Device) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        return hopper::available(d);
    }
    let _ = dev;
    Ok(false)
}

/// The scale actually used: `opts.scale` or `1/sqrt(head_dim)`.
pub(crate) fn resolve_scale(scale: Option<f64>, d: usize) -> f32 {
    scale.unwrap_or(1.0 / (d as f64).sqrt()) as f32
}

/// Exact attention `softmax(q k^T * scale + mask) v`, differentiable.
///
/// `q`: `(batch, heads_q, seq_q, head_dim)`, `k`, `v`: `(batch, heads_kv, seq_k,
/// head_dim)`; returns `(batch, heads_q, seq_q, head_dim)` in the inputs' dtype
/// (on the inputs' device). Non-contiguous inputs are made contiguous first.
///
/// Runs resident (one custom op) when it fits the budget and streamed otherwise,
/// per [`estimate`]; `opts.mode` can force either. Errors, before any work, on bad
/// ranks, mixed dtypes, mismatched devices, head counts that do not divide, a
/// head_dim of 0 or above [`MAX_HEAD_DIM`], a `softcap` that is not positive and
/// finite, `window_right` other than 0 with `causal`, `cu_seqlens_q`/`cu_seqlens_k`
/// that do not start at 0, decrease, miss the sequence length or disagree in
/// count, or when nothing fits the budget.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
    let shape = AttentionShape::of(q, k, v, opts.causal)?;
    let scores = Scores::of(opts, &shape)?;
    let docs = varlen::documents(opts, shape.nq, shape.nk)?;
    // Inputs no gradient can reach need no host memory for a backward.
    let backward = [q, k, v].iter().any(|t| t.track_op());
    let call = Call::plan(q, k, v, opts, (&shape, &scores), backward)?;
    if let Some(docs) = docs {
        return varlen::attention((q, k, v), docs, opts, (&shape, &scores), &call);
    }
    match call.plan {
        Some(plan) if plan.mode == Mode::Streamed => {
            let op = stream::StreamOp::new(q, k, v, &scores, &plan, &call.exec, call.verbose)?;
            stream::attention(q, k, v, op)
        }
        _ => {
            let (qe, ke, ve) = call.on_exec(q, k, v)?;
            let o = op::apply(&qe, &ke, &ve, &scores, None)?;
            call.back(&o, q.device())
        }
    }
}

/// Where and how one call runs: its compute device, the planner's choice
/// (`None` when the caller forced resident mode) and whether to print progress.
pub(crate) struct Call {
    exec: Device,
    plan: Option<Plan>,
    verbose: bool,
}

impl Call {
    /// Plans a call of `shape` (with a backward when `backward`), printing the
    /// plan of a streamed one when verbose.
    fn plan(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        opts: &AttentionOpts,
        (shape, scores): (&AttentionShape, &Scores),
        backward: bool,
    ) -> Result<Self> {
        let exec = opts.device.clone().unwrap_or_else(|| q.device().clone());
        let verbose = opts.verbose || std::env::var("CQSA_VERBOSE").is_ok_and(|v| v == "1");
        // The inputs already allocated on the compute device count as available.
        let inputs = if q.device().same_device(&exec) {
            (q.elem_count() + k.elem_count() + v.elem_count()) * q.dtype().size_in_bytes()
        } else {
            0
        };
        let forced =
            opts.mode == Mode::Streamed || opts.q_chunk.is_some() || opts.kv_chunk.is_some();
        // Resident when forced, or when the planner would choose it (checked
        // cheaply first: an attention call in a training step should not wait on
        // the planner).
        if opts.mode == Mode::Resident
            || (!forced && opts.budget.is_none() && Budget::fits_resident(&exec, shape, inputs)?)
        {
            return Ok(Self {
                exec,
                plan: None,
                verbose,
            });
        }
        let budget = match opts.budget {
            Some(b) => b,
            None => {
                let mut b = Budget::detect(&exec)?;
                b.device_bytes += inputs;
                b
            }
        };
        let plan = plan::plan(shape, scores, &budget, (opts, backward), &exec)?;
        if verbose && plan.mode == Mode::Streamed {
            eprintln!("cqsa: {plan}");
        }
        Ok(Self {
            exec,
            plan: Some(plan),
            verbose,
        })
    }

    /// Whether the call runs resident (forced, or the planner's choice).
    fn resident(&self) -> bool {
        self.plan.as_ref().is_none_or(|p| p.mode == Mode::Resident)
    }

    /// Contiguous copies of the inputs on the compute device (a view moves only
    /// its own elements).
    fn on_exec(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let to = |t: &Tensor| streamer_device::to_device_compact(t, &self.exec)?.contiguous();
        Ok((to(q)?, to(k)?, to(v)?))
    }

    /// A result of the compute device, moved to `dev` (the inputs' device).
    fn back(&self, t: &Tensor, dev: &Device) -> Result<Tensor> {
        if t.device().same_device(dev) {
            Ok(t.clone())
        } else {
            t.to_device(dev)
        }
    }
}
