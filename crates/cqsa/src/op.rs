//! The custom op: [`AttnOp`] implements `CustomOp3` over `(q, k, v)`; its forward
//! keeps the log-sum-exp, and its backward recomputes the probabilities from it.
//!
//! The log-sum-exp is a second result that `CustomOp3` has no slot for, so the op
//! keeps it in a cell that the forward fills and the backward reads (the op object
//! is the one Candle stores in the graph for this very call).
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor,
};

use crate::packed::Fused;
use crate::{cpu, AttentionShape, Scores};

/// The attention custom op for one call: its scores and mask (a packed call's
/// documents and their bands), and the cell that carries the log-sum-exp from
/// forward to backward.
pub(crate) struct AttnOp {
    scores: Scores,
    packed: Option<Arc<Fused>>,
    lse: Arc<Mutex<Option<Tensor>>>,
}

/// Applies the differentiable resident op to contiguous `(q, k, v)`; `packed`:
/// a packed call in one launch (CUDA, `varlen::fused`).
pub(crate) fn apply(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scores: &Scores,
    packed: Option<Arc<Fused>>,
) -> Result<Tensor> {
    let op = AttnOp {
        scores: *scores,
        packed,
        lse: Arc::new(Mutex::new(None)),
    };
    q.apply_op3(k, v, op)
}

/// `t`, copied when its first element is not 16-byte aligned (8 elements of
/// 2 bytes), as the tensor-core kernels need for a packed call's one launch
/// (which has no other kernel to fall back on).
pub(crate) fn aligned(t: Tensor) -> Result<Tensor> {
    match t.layout().start_offset() % 8 {
        0 => Ok(t),
        _ => t.copy(),
    }
}

/// The error of a packed op reaching the CPU (`varlen::fused` sends it to CUDA only).
fn packed_on_cpu() -> candle_core::Error {
    candle_core::Error::Msg("cqsa: a packed call in one launch runs on CUDA only".into())
}

/// The shape of a call from the layouts of q and k (already validated by
/// [`AttentionShape::of`] when the op was applied; checked again, it is cheap).
fn dims_of(lq: &Layout, lk: &Layout, dtype: DType) -> Result<AttentionShape> {
    let (b, hq, nq, d) = lq.shape().dims4()?;
    let (_, hkv, nk, _) = lk.shape().dims4()?;
    let shape = AttentionShape {
        b,
        hq,
        hkv,
        nq,
        nk,
        d,
        dtype,
        causal: false,
    };
    shape.check()?;
    Ok(shape)
}

fn lse_shape(dims: &AttentionShape) -> Shape {
    Shape::from((dims.b, dims.hq, dims.nq))
}

fn poisoned<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("cqsa: log-sum-exp cell poisoned by a panic".into())
}

fn cpu_forward(
    (sq, lq): (&CpuStorage, &Layout),
    (sk, lk): (&CpuStorage, &Layout),
    (sv, lv): (&CpuStorage, &Layout),
    scores: &Scores,
) -> Result<(CpuStorage, Vec<f32>, AttentionShape)> {
    let dims = dims_of(lq, lk, sq.dtype())?;
    let (q, k, v) = (
        cpu::to_f32(sq, lq)?,
        cpu::to_f32(sk, lk)?,
        cpu::to_f32(sv, lv)?,
    );
    let (o, lse) = cpu::forward(&q, &k, &v, &dims, scores);
    Ok((cpu::from_f32(o, sq)?, lse, dims))
}

impl CustomOp3 for AttnOp {
    fn name(&self) -> &'static str {
        "cqsa-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if self.packed.is_some() {
            return Err(packed_on_cpu());
        }
        let (o, lse, dims) = cpu_forward((sq, lq), (sk, lk), (sv, lv), &self.scores)?;
        let lse = Tensor::from_vec(lse, lse_shape(&dims), &Device::Cpu)?;
        *self.lse.lock().map_err(poisoned)? = Some(lse);
        Ok((o, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sq: &candle_core::CudaStorage,
        lq: &Layout,
        sk: &candle_core::CudaStorage,
        lk: &Layout,
        sv: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = dims_of(lq, lk, sq.dtype())?;
        let (o, lse) = crate::cuda::forward(
            [(sq, lq), (sk, lk), (sv, lv)],
            &dims,
            (&self.scores, self.packed.as_deref()),
        )?;
        let lse = Tensor::from_storage(
            Storage::Cuda(lse),
            lse_shape(&dims),
            BackpropOp::none(),
            false,
        );
        *self.lse.lock().map_err(poisoned)? = Some(lse);
        Ok((o, lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.lock().map_err(poisoned)?.clone();
        let Some(lse) = lse else {
            bail!("cqsa: backward called before forward kept its log-sum-exp")
        };
        let (dq, dk, dv) = backward_packed(
            [q, k, v, o, grad_o, &lse],
            &self.scores,
            self.packed.as_deref(),
        )?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// Forward without autograd: returns the output `(batch, heads_q, seq_q,
/// head_dim)` in the inputs' dtype and the natural log-sum-exp of every row,
/// `(batch, heads_q, seq_q)` in f32 (`-inf` for a row that sees no key).
///
/// `causal_offset`: `None` for no mask, `Some(off)` to let query `i` see key `j`
/// iff `j <= i + off` (the full causal call uses `off = seq_k - seq_q`). This is
/// the building block of the streamed mode, where chunks use other offsets.
/// [`attention_forward_with`] takes any [`Scores`] (windows, soft-capping).
pub fn attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal_offset: Option<i64>,
) -> Result<(Tensor, Tensor)> {
    let scores = Scores {
        hi: causal_offset,
        ..Scores::dense(scale)
    };
    attention_forward_with(q, k, v, &scores)
}

/// [`attention_forward`] with the scores and mask of `scores`: key `j` visible
/// from query `i` iff `i + lo <= j <= i + hi`, scores soft-capped when
/// `scores.softcap` is set.
pub fn attention_forward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scores: &Scores,
) -> Result<(Tensor, Tensor)> {
    forward_packed(q, k, v, scores, None)
}

/// [`attention_forward_with`] of a packed call in one launch when `packed`.
pub(crate) fn forward_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scores: &Scores,
    packed: Option<&Fused>,
) -> Result<(Tensor, Tensor)> {
    let dims = AttentionShape::of(q, k, v, scores.hi.is_some())?;
    scores.check()?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    match (&*sq, &*sk, &*sv) {
        (Storage::Cpu(_), _, _) if packed.is_some() => Err(packed_on_cpu()),
        (Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)) => {
            let (o, lse, _) = cpu_forward((a, lq), (b, lk), (c, lv), scores)?;
            let o = Tensor::from_storage(Storage::Cpu(o), q.shape(), BackpropOp::none(), false);
            Ok((o, Tensor::from_vec(lse, lse_shape(&dims), &Device::Cpu)?))
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) => {
            let (o, lse) =
                crate::cuda::forward([(a, lq), (b, lk), (c, lv)], &dims, (scores, packed))?;
            let o = Tensor::from_storage(Storage::Cuda(o), q.shape(), BackpropOp::none(), false);
            let lse = Tensor::from_storage(
                Storage::Cuda(lse),
                lse_shape(&dims),
                BackpropOp::none(),
                false,
            );
            Ok((o, lse))
        }
        _ => bail!(
            "cqsa: no attention kernel for device {:?}",
            q.device().location()
        ),
    }
}

/// Backward without autograd: given the forward's inputs, output `o`, the
/// gradient of the output `grad_o` and the log-sum-exp from
/// [`attention_forward`], returns `(dq, dk, dv)` shaped and typed like
/// `(q, k, v)`. For grouped-query attention dk/dv sum over the query heads of
/// each group. The probabilities are recomputed from `lse`, never stored.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    grad_o: &Tensor,
    lse: &Tensor,
    scale: f32,
    causal_offset: Option<i64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let scores = Scores {
        hi: causal_offset,
        ..Scores::dense(scale)
    };
    attention_backward_with(q, k, v, o, grad_o, lse, &scores)
}

/// [`attention_backward`] with the scores and mask of `scores` (the same as
/// the forward's, see [`attention_forward_with`]).
pub fn attention_backward_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    grad_o: &Tensor,
    lse: &Tensor,
    scores: &Scores,
) -> Result<(Tensor, Tensor, Tensor)> {
    backward_packed([q, k, v, o, grad_o, lse], scores, None)
}

/// Fails unless `o` and `grad_o` have `q`'s shape and `lse` is the f32
/// log-sum-exp of `dims`' rows (what [`attention_forward`] returns), before
/// any kernel reads them.
fn check_backward_inputs(
    q: &Tensor,
    o: &Tensor,
    grad_o: &Tensor,
    lse: &Tensor,
    dims: &AttentionShape,
) -> Result<()> {
    if o.dims() != q.dims() || grad_o.dims() != q.dims() {
        bail!(
            "cqsa: {} and {} must have the shape of {}",
            crate::shape::describe("o", o),
            crate::shape::describe("grad_o", grad_o),
            crate::shape::describe("q", q)
        )
    }
    if lse.dims() != dims.lse_dims() || lse.dtype() != DType::F32 {
        bail!(
            "cqsa: lse must be F32 of shape {:?}, got {}",
            dims.lse_dims(),
            crate::shape::describe("lse", lse)
        )
    }
    Ok(())
}

/// The CPU backward over `(q, k, v, o, grad_o, lse)`: the f32 reference
/// kernel on f32 copies, `(dq, dk, dv)` converted back to `q`'s dtype.
fn cpu_backward(
    [(cq, lq), (ck, lk), (cv, lv), (co, lo), (cg, lg), (cl, ll)]: [(&CpuStorage, &Layout); 6],
    dims: &AttentionShape,
    scores: &Scores,
) -> Result<[CpuStorage; 3]> {
    let (qf, kf, vf) = (
        cpu::to_f32(cq, lq)?,
        cpu::to_f32(ck, lk)?,
        cpu::to_f32(cv, lv)?,
    );
    let (of, gf, lf) = (
        cpu::to_f32(co, lo)?,
        cpu::to_f32(cg, lg)?,
        cpu::to_f32(cl, ll)?,
    );
    let inputs = cpu::BackwardInputs {
        q: &qf,
        k: &kf,
        v: &vf,
        o: &of,
        g: &gf,
        lse: &lf,
    };
    let (dq, dk, dv) = cpu::backward(&inputs, dims, scores);
    Ok([
        cpu::from_f32(dq, cq)?,
        cpu::from_f32(dk, cq)?,
        cpu::from_f32(dv, cq)?,
    ])
}

/// [`attention_backward_with`] of a packed call in one launch when `packed`.
pub(crate) fn backward_packed(
    [q, k, v, o, grad_o, lse]: [&Tensor; 6],
    scores: &Scores,
    packed: Option<&Fused>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = AttentionShape::of(q, k, v, scores.hi.is_some())?;
    scores.check()?;
    check_backward_inputs(q, o, grad_o, lse, &dims)?;
    let mut o = o.to_dtype(q.dtype())?.contiguous()?;
    let mut g = grad_o.to_dtype(q.dtype())?.contiguous()?;
    if packed.is_some() {
        (o, g) = (aligned(o)?, aligned(g)?);
    }
    let (q, k, v, lse) = (
        q.contiguous()?,
        k.contiguous()?,
        v.contiguous()?,
        lse.contiguous()?,
    );
    let (sq, lq) = q.storage_and_layout();
    let (sk, lk) = k.storage_and_layout();
    let (sv, lv) = v.storage_and_layout();
    let (so, lo) = o.storage_and_layout();
    let (sg, lg) = g.storage_and_layout();
    let (sl, ll) = lse.storage_and_layout();
    let none = BackpropOp::none;
    match (&*sq, &*sk, &*sv, &*so, &*sg, &*sl) {
        (Storage::Cpu(_), ..) if packed.is_some() => Err(packed_on_cpu()),
        (
            Storage::Cpu(cq),
            Storage::Cpu(ck),
            Storage::Cpu(cv),
            Storage::Cpu(co),
            Storage::Cpu(cg),
            Storage::Cpu(cl),
        ) => {
            let t = [(cq, lq), (ck, lk), (cv, lv), (co, lo), (cg, lg), (cl, ll)];
            let [dq, dk, dv] = cpu_backward(t, &dims, scores)?;
            let wrap = |x: CpuStorage, shape: &Shape| {
                Tensor::from_storage(Storage::Cpu(x), shape, none(), false)
            };
            Ok((wrap(dq, q.shape()), wrap(dk, k.shape()), wrap(dv, v.shape())))
        }
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(cq),
            Storage::Cuda(ck),
            Storage::Cuda(cv),
            Storage::Cuda(co),
            Storage::Cuda(cg),
            Storage::Cuda(cl),
        ) => {
            let (dq, dk, dv) = crate::cuda::backward(
                [(cq, lq), (ck, lk), (cv, lv), (co, lo), (cg, lg), (cl, ll)],
                &dims,
                (scores, packed),
            )?;
            Ok((
                Tensor::from_storage(Storage::Cuda(dq), q.shape(), none(), false),
                Tensor::from_storage(Storage::Cuda(dk), k.shape(), none(), false),
                Tensor::from_storage(Storage::Cuda(dv), v.shape(), none(), false),
            ))
        }
        _ => bail!(
            "cqsa: attention backward needs all of q, k, v, o, grad_o, lse on one device, q is on {:?}",
            q.device().location()
        ),
    }
}
