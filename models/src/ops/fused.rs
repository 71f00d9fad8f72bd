//! RMSNorm and the rotary embedding through candle-nn's fused kernels, forward
//! and backward.
//!
//! candle-nn's `rms_norm` and `rope` are one kernel each but have no backward, so
//! training used to spell both out in plain ops (eight for the norm, nine for the
//! rotation, each with its own autograd steps and f32 temporaries). Here the
//! forward is the fused kernel on detached inputs, and a pass-through custom op
//! (one copy of the output) attaches a backward written for the operation:
//! - RMSNorm, `y = x r w` with `r = 1 / sqrt(mean(x^2) + eps)` per row:
//!   `dx = r (g w) - x r^3 mean(g w x)`, `dw = sum over rows of g x r`, in f32;
//! - rotary embedding: a rotation per pair of dims, so its gradient is the
//!   inverse rotation, `rope(g, cos, -sin)`, the same fused kernel.
//!
//! Untracked inputs (inference) skip the pass-through.
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};

/// `x / sqrt(mean(x^2) + eps) * w` over the last dim, statistics in f32;
/// differentiable in `x` and `w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let y = candle_nn::ops::rms_norm(&x.detach(), &w.detach(), eps as f32)?;
    if !x.track_op() && !w.track_op() {
        return Ok(y);
    }
    x.apply_op3(&w, &y, RmsNormGrad { eps })
}

/// `silu(gate) * up`, SwiGLU's product. On CUDA with untracked bf16/f16/f32
/// inputs one kernel (f32 arithmetic, one rounding: the two-op version rounds
/// `silu` first); tracked inputs, other dtypes or another device take Candle
/// ops, differentiable.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check_alike("swiglu", [("gate", gate), ("up", up)])?;
    #[cfg(feature = "cuda")]
    if gate.device().is_cuda() && kernel_dtype(gate.dtype()) && !gate.track_op() && !up.track_op() {
        return crate::ops::decoder::swiglu(gate, up);
    }
    gate.silu()? * up
}

/// `(s, rms_norm(s, w))` with `s = x + r`: a residual add and the RMSNorm
/// after it. On CUDA with untracked inputs one pass over each row (`s` is
/// rounded to the dtype before its statistics, as the two-op version does);
/// otherwise `x + r` and `RmsNorm`'s forward, differentiable (any float dtype).
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    check_alike("add_rms_norm", [("x", x), ("residual", r)])?;
    let h = x.dim(D::Minus1)?;
    if w.dims() != [h] || w.dtype() != x.dtype() || !w.device().same_device(x.device()) {
        bail!(
            "add_rms_norm: weight {:?} {:?} for x {:?} {:?}: expected ({h},) in x's dtype and device",
            w.dims(),
            w.dtype(),
            x.dims(),
            x.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && kernel_dtype(x.dtype())
        && !(x.track_op() || r.track_op() || w.track_op())
    {
        return crate::ops::decoder::add_rms_norm(x, r, w, eps);
    }
    let s = (x + r)?;
    let y = candle_core::Module::forward(&crate::RmsNorm::from_weight(w.clone(), eps), &s)?;
    Ok((s, y))
}

/// The dtypes our fused kernels take (others use Candle ops).
#[cfg(feature = "cuda")]
fn kernel_dtype(dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F16 | DType::F32)
}

/// Two operands of an element-wise fused op: same shape, dtype and device.
fn check_alike(what: &str, [(na, a), (nb, b)]: [(&str, &Tensor); 2]) -> Result<()> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() || !a.device().same_device(b.device()) {
        bail!(
            "{what}: {na} {:?} {:?} on {:?} and {nb} {:?} {:?} on {:?} differ",
            a.dims(),
            a.dtype(),
            a.device().location(),
            b.dims(),
            b.dtype(),
            b.device().location()
        );
    }
    Ok(())
}

/// Hugging Face's "rotate half" rotary embedding of `x` `(batch, heads, seq,
/// head_dim)` with `cos`, `sin` `(seq, head_dim / 2)`; differentiable in `x`
/// (the tables are constants).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let y = candle_nn::rotary_emb::rope(&x.detach(), &cos, &sin)?;
    if !x.track_op() {
        return Ok(y);
    }
    x.apply_op2(
        &y,
        RopeGrad {
            cos: cos.detach(),
            sin: sin.detach(),
        },
    )
}

/// [`rope`] of a projection in rows `(batch * seq, heads * head_dim)`,
/// returned head-major `(batch, heads, seq, head_dim)` as attention takes it:
/// on CUDA one kernel reads the rows and writes the rotated heads (no
/// transpose copy first); elsewhere a transpose and `rope`. Not
/// differentiable (for hand-written backwards: see [`rope_into_rows`]).
pub fn rope_into_heads(
    p: &Tensor,
    (batch, seq, heads): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let (rows, width) = p.dims2()?;
    if rows != batch * seq || heads == 0 || width % heads != 0 || (width / heads) % 2 != 0 {
        bail!(
            "rope_into_heads: projection {:?} is not (batch * seq, heads * even head_dim) for batch {batch}, seq {seq}, heads {heads}",
            p.dims()
        );
    }
    let d = width / heads;
    check_tables("rope_into_heads", p, cos, sin, seq, d)?;
    #[cfg(feature = "cuda")]
    if p.device().is_cuda() {
        return crate::ops::decoder::rope_to_heads(p, (batch, seq, heads), cos, sin);
    }
    let x = p
        .reshape((batch, seq, heads, d))?
        .transpose(1, 2)?
        .contiguous()?;
    candle_nn::rotary_emb::rope(&x, &cos.contiguous()?, &sin.contiguous()?)
}

/// The inverse rotation of a head-major gradient `(batch, heads, seq,
/// head_dim)`, returned in rows `(batch * seq, heads * head_dim)`: the
/// backward of [`rope_into_heads`], one kernel on CUDA.
pub fn rope_into_rows(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = g.dims4()?;
    if d % 2 != 0 {
        bail!("rope_into_rows: head_dim {d} of {:?} is odd", g.dims());
    }
    check_tables("rope_into_rows", g, cos, sin, n, d)?;
    #[cfg(feature = "cuda")]
    if g.device().is_cuda() {
        return crate::ops::decoder::rope_to_rows(g, cos, sin);
    }
    rope_backward(g, cos, sin)?
        .transpose(1, 2)?
        .reshape((b * n, h * d))?
        .contiguous()
}

/// `cos`, `sin` must be `(seq, head_dim / 2)` in `x`'s dtype.
fn check_tables(
    what: &str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    seq: usize,
    d: usize,
) -> Result<()> {
    for (name, t) in [("cos", cos), ("sin", sin)] {
        if t.dims() != [seq, d / 2] || t.dtype() != x.dtype() {
            bail!(
                "{what}: {name} is {:?} {:?}, expected ({seq}, {}) {:?}",
                t.dims(),
                t.dtype(),
                d / 2,
                x.dtype()
            );
        }
    }
    Ok(())
}

/// The output of the pass-through ops below: argument `y` itself (a copy),
/// after checking that its layout is the fresh contiguous tensor it should
/// be (`try_clone` copies the whole storage, so an offset or a stride would
/// mean the output is not `y`).
fn pass_through_cpu(s: &CpuStorage, l: &Layout, what: &str) -> Result<(CpuStorage, Shape)> {
    fresh(l, what)?;
    Ok((s.try_clone(l)?, l.shape().clone()))
}

/// [`pass_through_cpu`] on CUDA.
#[cfg(feature = "cuda")]
fn pass_through_cuda(
    s: &candle_core::CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<(candle_core::CudaStorage, Shape)> {
    fresh(l, what)?;
    Ok((s.try_clone(l)?, l.shape().clone()))
}

fn fresh(l: &Layout, what: &str) -> Result<()> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        bail!("{what}: internal error, pass-through output has layout {l:?}")
    }
    Ok(())
}

/// `cpu_fwd` and `cuda_fwd` of a pass-through op: the inputs named here come
/// first and are not read; the output is the last input, as
/// [`pass_through_cpu`] / [`pass_through_cuda`] give it.
macro_rules! pass_through_fwd {
    ($($unused:tt),*) => {
        fn cpu_fwd(
            &self,
            $($unused: &CpuStorage, _: &Layout,)*
            s: &CpuStorage,
            l: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            pass_through_cpu(s, l, self.name())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            $($unused: &candle_core::CudaStorage, _: &Layout,)*
            s: &candle_core::CudaStorage,
            l: &Layout,
        ) -> Result<(candle_core::CudaStorage, Shape)> {
            pass_through_cuda(s, l, self.name())
        }
    };
}

/// `(x, w, y) -> y`, with the RMSNorm backward.
struct RmsNormGrad {
    eps: f64,
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    pass_through_fwd!(_x, _w);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = norm_backward(x, w, grad, None, self.eps)?;
        Ok((Some(dx), Some(dw), None))
    }
}

/// RMSNorm's `(dx, dw)`, with `res` (a residual branch's gradient into the
/// same input) added to `dx`: the fused CUDA kernels where they apply (two
/// passes, the add in the first, no f32 copies of the activation), else
/// [`rms_norm_backward`]'s Candle ops.
pub(crate) fn norm_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    res: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        if let Some(r) = crate::ops::decoder::rms_norm_backward(x, w, g, res, eps)? {
            return Ok(r);
        }
    }
    let (dx, dw) = rms_norm_backward(x, w, g, eps)?;
    Ok(match res {
        Some(r) => ((dx + r)?, dw),
        None => (dx, dw),
    })
}

/// The RMSNorm gradients `(dx, dw)` for input `x` (`(..., hidden)`), weight
/// `w` and output gradient `grad`, in f32, returned in the dtypes of `x`, `w`.
pub(crate) fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let xf = x.to_dtype(DType::F32)?;
    let gf = grad.to_dtype(DType::F32)?;
    let wf = w.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let xr = xf.broadcast_mul(&r)?; // the normalised input
    let gw = gf.broadcast_mul(&wf)?;
    // dx = r (gw - xr mean(gw xr))
    let m = (&gw * &xr)?.mean_keepdim(D::Minus1)?;
    let dx = (gw - xr.broadcast_mul(&m)?)?.broadcast_mul(&r)?;
    // dw = sum over every row of g xr
    let hidden = x.dim(D::Minus1)?;
    let dw = (gf * xr)?.reshape(((), hidden))?.sum(0)?;
    Ok((dx.to_dtype(x.dtype())?, dw.to_dtype(w.dtype())?))
}

/// The rotary embedding's gradient: the inverse rotation of `grad`.
pub(crate) fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope(&grad.contiguous()?, cos, &sin.neg()?)
}

/// `(x, y) -> y`, with the rotary backward `rope(g, cos, -sin)`.
struct RopeGrad {
    cos: Tensor,
    sin: Tensor,
}

impl CustomOp2 for RopeGrad {
    fn name(&self) -> &'static str {
        "rope-grad"
    }

    pass_through_fwd!(_x);

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(rope_backward(grad, &self.cos, &self.sin)?), None))
    }
}
