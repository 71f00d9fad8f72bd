//! Attention with an explicit backward, outside Candle's autograd.
//!
//! Through autograd, `o.backward()` on a streamed call over host tensors pays
//! Candle's host-side bookkeeping besides the op itself: an all-ones upstream
//! gradient the size of the output, and for each of q, k, v a zero-filled
//! tensor that the op's gradient is then added into (`GradStore`'s
//! accumulation), each a single-threaded pass over gigabytes at long sequence
//! lengths. [`attention_saved`] runs the same forward without a graph node and
//! returns a [`SavedAttention`] whose [`SavedAttention::backward`] takes the
//! output's gradient and returns the op's gradients as they are, as a
//! hand-written backward (or a `torch.autograd.Function`) would use them.
use candle_core::{bail, Device, Result, Tensor};

use std::sync::Arc;

use crate::packed::Fused;
use crate::{op, shape, stream, varlen, AttentionOpts, AttentionShape, Call, Mode, Scores};

/// What the backward of one [`attention_saved`] call needs.
pub struct SavedAttention {
    kind: Kind,
}

enum Kind {
    /// Inputs, output and log-sum-exp on the compute device; results go to
    /// `device` (the inputs').
    Resident {
        qkvo: [Tensor; 4],
        lse: Tensor,
        scores: Scores,
        /// A packed call's documents, run in one launch.
        packed: Option<Arc<Fused>>,
        device: Device,
    },
    Streamed(stream::Saved),
    /// A varlen call: each document's own saved call.
    Packed(varlen::Packed),
}

/// [`crate::attention`]'s forward outside autograd: the output (detached, on
/// the inputs' device) and what [`SavedAttention::backward`] needs. Planned as
/// a call with a backward (its host memory counted), resident or streamed as
/// `opts` and the budget say. A varlen call (`cu_seqlens_q`/`cu_seqlens_k`)
/// saves each document's call.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use cqsa::{attention_saved, AttentionOpts, Mode};
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 2, 64, 32), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 2, 64, 32), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 2, 64, 32), &dev)?;
/// // Streamed in chunks of 16 rows, as a call from host memory would be.
/// let opts = AttentionOpts { causal: true, mode: Mode::Streamed, q_chunk: Some(16), kv_chunk: Some(16), ..Default::default() };
/// let (o, saved) = attention_saved(&q, &k, &v, &opts)?;
/// let grad_o = o.ones_like()?; // the gradient of `o.sum_all()`
/// let (dq, dk, dv) = saved.backward(&grad_o)?;
/// assert_eq!((dq.dims(), dk.dims(), dv.dims()), (q.dims(), k.dims(), v.dims()));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn attention_saved(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
) -> Result<(Tensor, SavedAttention)> {
    let shape = AttentionShape::of(q, k, v, opts.causal)?;
    let scores = Scores::of(opts, &shape)?;
    let docs = varlen::documents(opts, shape.nq, shape.nk)?;
    let call = Call::plan(q, k, v, opts, (&shape, &scores), true)?;
    if let Some(docs) = docs {
        if let Some(fused) = varlen::fused(&shape, &docs, opts, &call)? {
            let exec = varlen::on_exec(&call, q, k, v)?;
            let packed = Some(Arc::new(fused));
            let kind = resident(exec, (&call, q.device()), &scores.unbanded(), packed)?;
            return Ok((kind.0, SavedAttention { kind: kind.1 }));
        }
        let inner = varlen::per_document(opts, call.resident());
        let (o, packed) = varlen::forward_saved((q, k, v), docs, &inner)?;
        return Ok((
            o,
            SavedAttention {
                kind: Kind::Packed(packed),
            },
        ));
    }
    let (o, kind) = match &call.plan {
        Some(plan) if plan.mode == Mode::Streamed => {
            let op = stream::StreamOp::new(q, k, v, &scores, plan, &call.exec, call.verbose)?;
            let (o, saved) = stream::forward_saved(q, k, v, op)?;
            (o, Kind::Streamed(saved))
        }
        _ => resident(call.on_exec(q, k, v)?, (&call, q.device()), &scores, None)?,
    };
    Ok((o, SavedAttention { kind }))
}

/// The resident forward of `(qe, ke, ve)` (on the compute device), its output
/// moved back to the inputs' device `device` and what its backward needs.
fn resident(
    (qe, ke, ve): (Tensor, Tensor, Tensor),
    (call, device): (&Call, &Device),
    scores: &Scores,
    packed: Option<Arc<Fused>>,
) -> Result<(Tensor, Kind)> {
    let (o, lse) = op::forward_packed(&qe, &ke, &ve, scores, packed.as_deref())?;
    let back = call.back(&o, device)?;
    let kind = Kind::Resident {
        qkvo: [qe, ke, ve, o],
        lse,
        scores: *scores,
        packed,
        device: device.clone(),
    };
    Ok((back, kind))
}

impl SavedAttention {
    /// `(dq, dk, dv)`, shaped and typed like `(q, k, v)` and on their device,
    /// for `grad_o`, the gradient of the output (its shape and dtype, on any
    /// device). Can be called more than once (each call is a full backward).
    pub fn backward(&self, grad_o: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        // The saved output's shape and dtype, which `grad_o` must have.
        let (dims, dtype) = match &self.kind {
            Kind::Streamed(saved) => (saved.output().dims(), saved.output().dtype()),
            Kind::Resident { qkvo, .. } => (qkvo[3].dims(), qkvo[3].dtype()),
            Kind::Packed(packed) => packed.output_like(),
        };
        if grad_o.dims() != dims || grad_o.dtype() != dtype {
            bail!(
                "cqsa: {} must have the output's shape {dims:?} and dtype {dtype:?}",
                shape::describe("grad_o", grad_o),
            )
        }
        match &self.kind {
            Kind::Streamed(saved) => saved.backward(grad_o),
            Kind::Packed(packed) => packed.backward(grad_o),
            Kind::Resident {
                qkvo: [q, k, v, o],
                lse,
                scores,
                packed,
                device,
            } => {
                let g = streamer_device::to_device_compact(grad_o, q.device())?;
                let (dq, dk, dv) =
                    op::backward_packed([q, k, v, o, &g, lse], scores, packed.as_deref())?;
                let back = |t: Tensor| -> Result<Tensor> {
                    if t.device().same_device(device) {
                        Ok(t)
                    } else {
                        t.to_device(device)
                    }
                };
                Ok((back(dq)?, back(dk)?, back(dv)?))
            }
        }
    }
}
