//! Variable-length packed sequences (`cu_seqlens_q`, `cu_seqlens_k` as in
//! flash-attn's `flash_attn_varlen`): several documents along the sequence axis,
//! no attention across documents, no compute on padding.
//!
//! Document `i` holds query rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` and keys
//! `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` of every (batch, head) row, with the
//! call's masks applied inside the document and aligned bottom-right to it, as
//! flash-attn does. A document with no keys gives output 0 (its rows see
//! nothing); an empty one nothing.
//!
//! Two ways to run it:
//! - [`Fused`]: one launch of the tensor-core kernels (Hopper, or the portable
//!   ones) over every document, a unit of work per query block (forward; the
//!   Hopper forward's persistent blocks take them in turn) or key block
//!   (backward) of each, when the call is resident on CUDA in f16/bf16 at head
//!   dim 64 or 128 ([`fused`]). As flash-attn's varlen kernels.
//! - Otherwise each document is its own call of [`crate::attention_saved`]
//!   (resident or streamed as the planner says). The backward runs each
//!   document's saved backward and joins the gradients, so each input's gradient
//!   is built once: through Candle's autograd of `narrow` it would be a
//!   zero-padded whole-size tensor per document, added up (3 x documents passes
//!   over the inputs). Each document pays a launch (and its host work).
use std::sync::Arc;

use candle_core::{bail, DType, Device, Result, Tensor};

use crate::packed::{Document, Fused};
use crate::{
    attention_saved, op, AttentionOpts, AttentionShape, Call, Mode, SavedAttention, Scores,
};

/// The packed call as one launch, when it runs resident (`call`) on CUDA where
/// the tensor-core kernels serve it forward and backward (f16/bf16, head dim
/// 64 or 128; the Hopper ones where they apply, else the portable ones);
/// `None`: each document runs as its own call.
pub(crate) fn fused(
    shape: &AttentionShape,
    docs: &[Document],
    opts: &AttentionOpts,
    call: &Call,
) -> Result<Option<Fused>> {
    let tensor_cores =
        matches!(shape.dtype, DType::F16 | DType::BF16) && matches!(shape.d, 64 | 128);
    if !call.resident() || !call.exec.is_cuda() || !tensor_cores {
        return Ok(None);
    }
    let inner = per_document(opts, true);
    let bands = docs
        .iter()
        .map(|&((q0, q1), (k0, k1))| {
            let doc = AttentionShape {
                nq: q1 - q0,
                nk: k1 - k0,
                ..*shape
            };
            let s = Scores::of(&inner, &doc)?;
            Ok((s.lo, s.hi))
        })
        .collect::<Result<_>>()?;
    Ok(Some(Fused {
        docs: docs.to_vec(),
        bands,
    }))
}

/// The inputs on the compute device for the one launch: contiguous, and each
/// starting 16-byte aligned as the tensor-core kernels need (a view that does
/// not is copied).
pub(crate) fn on_exec(
    call: &Call,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (q, k, v) = call.on_exec(q, k, v)?;
    Ok((op::aligned(q)?, op::aligned(k)?, op::aligned(v)?))
}

/// Checks one `cu_seqlens` array against the sequence length `n`: starts at 0,
/// never decreases (equal neighbours are an empty document), ends at `n`.
fn check(name: &str, cu: &[usize], n: usize) -> Result<()> {
    if cu.len() < 2 {
        bail!("cqsa: {name} must hold at least 2 offsets (one document), got {cu:?}")
    }
    if cu[0] != 0 {
        bail!("cqsa: {name} must start at 0, got {name}[0] = {}", cu[0])
    }
    if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
        bail!(
            "cqsa: {name} must not decrease, got {name}[{}] = {} > {name}[{i}] = {}",
            i - 1,
            cu[i - 1],
            cu[i]
        )
    }
    let last = cu[cu.len() - 1];
    if last != n {
        bail!("cqsa: {name} must end at the sequence length {n}, got {last}")
    }
    Ok(())
}

/// The documents of a varlen call: `(q rows, keys)` ranges, checked against the
/// sequence lengths `nq`, `nk`. `None` when `opts` asks for no varlen.
pub(crate) fn documents(
    opts: &AttentionOpts,
    nq: usize,
    nk: usize,
) -> Result<Option<Vec<Document>>> {
    let (cq, ck) = match (&opts.cu_seqlens_q, &opts.cu_seqlens_k) {
        (None, None) => return Ok(None),
        (Some(cq), Some(ck)) => (cq, ck),
        (q, k) => bail!(
            "cqsa: cu_seqlens_q and cu_seqlens_k go together, got cu_seqlens_q {} and cu_seqlens_k {}",
            if q.is_some() { "set" } else { "None" },
            if k.is_some() { "set" } else { "None" }
        ),
    };
    check("cu_seqlens_q", cq, nq)?;
    check("cu_seqlens_k", ck, nk)?;
    if cq.len() != ck.len() {
        bail!(
            "cqsa: cu_seqlens_q ({} documents) and cu_seqlens_k ({} documents) must describe as many documents",
            cq.len() - 1,
            ck.len() - 1
        )
    }
    Ok(Some(
        (0..cq.len() - 1)
            .map(|i| ((cq[i], cq[i + 1]), (ck[i], ck[i + 1])))
            .collect(),
    ))
}

/// The options of each document's call: `opts` without the varlen fields,
/// resident when `resident` (the planner chose that for the whole packed call,
/// which bounds every document's memory), so that a document's call does not
/// plan again: with short documents, planning each one cost more host time
/// than its kernels took.
pub(crate) fn per_document(opts: &AttentionOpts, resident: bool) -> AttentionOpts {
    AttentionOpts {
        cu_seqlens_q: None,
        cu_seqlens_k: None,
        mode: if resident { Mode::Resident } else { opts.mode },
        ..opts.clone()
    }
}

/// The documents' forwards, kept for one backward of a packed call.
pub(crate) struct Packed {
    docs: Vec<Document>,
    /// Each document's saved call; `None` when it has no queries or no keys.
    parts: Vec<Option<SavedAttention>>,
    /// The shapes of q and k, and their dtype and device (for zero gradients).
    like: (Vec<usize>, Vec<usize>, DType, Device),
}

/// The packed output of `call` on each document (`None` in `parts` where a
/// document has no queries or no keys: its rows are 0).
fn forward<S>(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    docs: &[Document],
    call: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, S)>,
) -> Result<(Tensor, Vec<Option<S>>)> {
    let mut outs = Vec::with_capacity(docs.len());
    let mut parts = Vec::with_capacity(docs.len());
    for &((q0, q1), (k0, k1)) in docs {
        if q1 == q0 {
            parts.push(None);
            continue;
        }
        let qd = q.narrow(2, q0, q1 - q0)?;
        if k1 == k0 {
            // Rows that see no key: output 0, gradient 0.
            outs.push(qd.zeros_like()?);
            parts.push(None);
            continue;
        }
        let (o, saved) = call(&qd, &k.narrow(2, k0, k1 - k0)?, &v.narrow(2, k0, k1 - k0)?)?;
        outs.push(o);
        parts.push(Some(saved));
    }
    let out = match outs.is_empty() {
        true => q.zeros_like()?,
        false => Tensor::cat(&outs, 2)?,
    };
    Ok((out, parts))
}

/// The packed call's output (outside autograd) and what its backward needs:
/// each document through [`attention_saved`] with `inner` (the call's options
/// without the varlen fields).
pub(crate) fn forward_saved(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    docs: Vec<Document>,
    inner: &AttentionOpts,
) -> Result<(Tensor, Packed)> {
    let (q, k, v) = (q.detach(), k.detach(), v.detach());
    let (out, parts) = forward((&q, &k, &v), &docs, |q, k, v| {
        attention_saved(q, k, v, inner)
    })?;
    let like = (
        q.dims().to_vec(),
        k.dims().to_vec(),
        q.dtype(),
        q.device().clone(),
    );
    Ok((out, Packed { docs, parts, like }))
}

impl Packed {
    /// The output's shape and dtype (those of q).
    pub(crate) fn output_like(&self) -> (&[usize], DType) {
        (&self.like.0, self.like.2)
    }

    /// `(dq, dk, dv)` for `grad_o`, the gradient of the packed output.
    pub(crate) fn backward(&self, grad_o: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (qdims, kdims, dtype, device) = &self.like;
        let zeros = |dims: &[usize], rows: usize| -> Result<Tensor> {
            let mut dims = dims.to_vec();
            dims[2] = rows;
            Tensor::zeros(dims, *dtype, device)
        };
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        for (&((q0, q1), (k0, k1)), part) in self.docs.iter().zip(&self.parts) {
            let (a, b, c) = match part {
                Some(saved) => saved.backward(&grad_o.narrow(2, q0, q1 - q0)?.contiguous()?)?,
                None => {
                    let dk0 = zeros(kdims, k1 - k0)?;
                    (zeros(qdims, q1 - q0)?, dk0.clone(), dk0)
                }
            };
            // Empty documents add no rows.
            for (list, t) in [(&mut dq, a), (&mut dk, b), (&mut dv, c)] {
                if t.dim(2)? > 0 {
                    list.push(t);
                }
            }
        }
        let join = |list: Vec<Tensor>, dims: &[usize]| match list.is_empty() {
            true => zeros(dims, 0),
            false => Tensor::cat(&list, 2),
        };
        Ok((join(dq, qdims)?, join(dk, kdims)?, join(dv, kdims)?))
    }
}

/// The packed call, as a node of Candle's graph when a gradient can reach an
/// input: in one launch ([`fused`]; the op's backward is one launch too), or
/// document by document (its backward is [`Packed::backward`]).
pub(crate) fn attention(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    docs: Vec<Document>,
    opts: &AttentionOpts,
    (shape, scores): (&AttentionShape, &Scores),
    call: &Call,
) -> Result<Tensor> {
    if let Some(f) = fused(shape, &docs, opts, call)? {
        let (qe, ke, ve) = on_exec(call, q, k, v)?;
        let o = op::apply(&qe, &ke, &ve, &scores.unbanded(), Some(Arc::new(f)))?;
        return call.back(&o, q.device());
    }
    let inner = &per_document(opts, call.resident());
    if ![q, k, v].iter().any(|t| t.track_op()) {
        // Nothing to save: plain calls, planned without a backward.
        let call = |q: &Tensor, k: &Tensor, v: &Tensor| Ok((crate::attention(q, k, v, inner)?, ()));
        return Ok(forward((q, k, v), &docs, call)?.0);
    }
    let (out, packed) = forward_saved((q, k, v), docs, inner)?;
    let packed = Arc::new(packed);
    streamer_device::with_backward3("cqsa-attention-varlen", q, k, v, out, move |g| {
        let (dq, dk, dv) = packed.backward(g)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    })
}
