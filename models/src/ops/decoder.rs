//! The decoder's fused element-wise pieces on CUDA (kernels in
//! `kernels/src/decoder.cu`), each one [`launch`]. Forward pieces (SwiGLU,
//! the residual add with RMSNorm, the rotary moves) and the backward's (their
//! gradients, cross-entropy, embedding) return untracked tensors: they are the
//! backward, or run where nothing is tracked. The CPU and unsupported shapes
//! use the Candle-op versions in `decoder_backward.rs` / [`super::fused`],
//! which the tests hold these to.
use super::launch::{alloc, contiguous, grid, launch, row_grid, zeros, Arg};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use cudarc::driver::LaunchConfig;

/// Widest row the RMSNorm weight-gradient kernel takes (32 columns per thread).
const MAX_HIDDEN: usize = 32 * 256;

/// A CUDA operand: its storage and layout.
pub(crate) type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// The operand as a kernel's `T*` from its layout's start.
fn at<'a>((s, l): Operand<'a>) -> Arg<'a> {
    Arg::Buf(s, l.start_offset())
}

/// Runs `f` on the CUDA storages and layouts of the contiguous tensors `ins`
/// (one device), and returns the storage it makes as an untracked tensor of
/// the shape it gives.
fn on_cuda<const N: usize>(
    what: &str,
    ins: [&Tensor; N],
    f: impl FnOnce(&CudaDevice, [Operand<'_>; N]) -> Result<(CudaStorage, Shape)>,
) -> Result<Tensor> {
    let guards = ins.map(|t| t.storage_and_layout());
    let mut ops = Vec::with_capacity(N);
    for (st, l) in &guards {
        let Storage::Cuda(s) = &**st else {
            bail!(
                "{what}: an operand is on {:?}, not CUDA",
                st.device().location()
            );
        };
        contiguous(l, what)?;
        ops.push((s, *l));
    }
    let Ok(ops) = <[Operand<'_>; N]>::try_from(ops) else {
        bail!("{what}: expected {N} operands");
    };
    let dev = ops[0].0.device().clone();
    if ops.iter().any(|(s, _)| !s.device().same_device(&dev)) {
        bail!("{what}: operands on different GPUs");
    }
    let (s, shape) = f(&dev, ops)?;
    drop(guards);
    Ok(Tensor::from_storage(
        Storage::Cuda(s),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// `(2, dims...)`: two results of `l`'s shape stacked in one buffer.
fn stacked(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

/// For `act = silu(gate) * up` on CUDA: `(d_gate, d_up)` in one pass.
pub(crate) fn swiglu_backward(
    d_act: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (a, g, u) = (d_act.contiguous()?, gate.contiguous()?, up.contiguous()?);
    let both = on_cuda("swiglu-bwd", [&a, &g, &u], |dev, [a, g, u]| {
        if a.1.shape() != g.1.shape() || a.1.shape() != u.1.shape() {
            bail!(
                "swiglu-bwd: shapes differ: {:?} {:?} {:?}",
                a.1.shape(),
                g.1.shape(),
                u.1.shape()
            );
        }
        let (n, dt) = (a.1.shape().elem_count(), a.0.dtype());
        // SAFETY: the kernel writes all 2n elements (d_gate, then d_up).
        let out = unsafe { alloc(dev, dt, 2 * n) }?;
        let args = [at(a), at(g), at(u), Arg::Buf(&out, 0), Arg::Usize(n)];
        // SAFETY: three inputs of n elements and an output of 2n, as the kernel reads and writes.
        unsafe { launch(dev, "swiglu_bwd", dt, grid(n), &args) }?;
        Ok((out, stacked(a.1)))
    })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// `f(a, b)` element-wise by the kernel `{kernel}_{dtype}(a, b, out, n)`.
fn binary(name: &str, kernel: &str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    on_cuda(name, [&a, &b], |dev, [x, y]| {
        if x.1.shape() != y.1.shape() || x.0.dtype() != y.0.dtype() {
            bail!(
                "{name}: operands {:?} {:?} and {:?} {:?} differ",
                x.1.shape(),
                x.0.dtype(),
                y.1.shape(),
                y.0.dtype()
            );
        }
        let (n, dt) = (x.1.shape().elem_count(), x.0.dtype());
        // SAFETY: the kernel writes all n elements.
        let out = unsafe { alloc(dev, dt, n) }?;
        let args = [at(x), at(y), Arg::Buf(&out, 0), Arg::Usize(n)];
        // SAFETY: two inputs and an output of n elements, as the kernel indexes.
        unsafe { launch(dev, kernel, dt, grid(n), &args) }?;
        Ok((out, x.1.shape().clone()))
    })
}

/// `silu(gate) * up` on CUDA in one pass (f32 arithmetic, one rounding).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    binary("swiglu-fwd", "swiglu_fwd", gate, up)
}

/// `dh * gelu'(z)` (tanh GELU) on CUDA in one pass.
pub(crate) fn gelu_backward(dh: &Tensor, z: &Tensor) -> Result<Tensor> {
    binary("gelu-bwd", "gelu_bwd", dh, z)
}

/// `(x + r, rms_norm(x + r) w)` on CUDA in one pass over each row.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (x, r, w) = (x.contiguous()?, r.contiguous()?, w.contiguous()?);
    let both = on_cuda("add-rms-norm", [&x, &r, &w], |dev, [x, r, w]| {
        let h = *x.1.dims().last().unwrap_or(&0);
        let same = x.0.dtype() == r.0.dtype() && x.0.dtype() == w.0.dtype();
        if x.1.shape() != r.1.shape() || w.1.dims() != [h] || h == 0 || !same {
            bail!(
                "add-rms-norm: x {:?} {:?}, residual {:?} {:?}, weight {:?} {:?}",
                x.1.shape(),
                x.0.dtype(),
                r.1.shape(),
                r.0.dtype(),
                w.1.shape(),
                w.0.dtype()
            );
        }
        let (n, dt) = (x.1.shape().elem_count(), x.0.dtype());
        // SAFETY: one block per row writes every element of both halves.
        let out = unsafe { alloc(dev, dt, 2 * n) }?;
        let (s, y) = (Arg::Buf(&out, 0), Arg::Buf(&out, n));
        let args = [
            at(x),
            at(r),
            at(w),
            s,
            y,
            Arg::I32(h as i32),
            Arg::F32(eps as f32),
        ];
        // SAFETY: rows x h inputs and two outputs of rows x h, a weight of h.
        unsafe { launch(dev, "add_rms", dt, row_grid(n / h), &args) }?;
        Ok((out, stacked(x.1)))
    })?;
    Ok((both.get(0)?, both.get(1)?))
}

/// RMSNorm's dx `(x, w, g) -> dx` over the last dim, plus `res` (the gradient
/// of a residual branch into the same input) when given.
fn rms_dx(
    dev: &CudaDevice,
    [x, w, g]: [Operand<'_>; 3],
    res: Option<Operand<'_>>,
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let h = rms_dx_hidden(x.1, w.1, g.1)?;
    let (n, rows, dt) = (
        x.1.shape().elem_count(),
        x.1.shape().elem_count() / h.max(1),
        x.0.dtype(),
    );
    check_residual(res.map(|(s, l)| (s.dtype(), l)), x)?;
    // SAFETY: one block per row writes every element of its row.
    let dx = unsafe { alloc(dev, dt, n) }?;
    // The kernel reads no residual through a null pointer.
    let r = res.map_or(Arg::Null, at);
    let args = [
        at(x),
        at(w),
        at(g),
        r,
        Arg::Buf(&dx, 0),
        Arg::I32(h as i32),
        Arg::F32(eps),
    ];
    // SAFETY: rows x h inputs (the residual too, checked above) and output, a
    // weight of h, as the kernel indexes.
    unsafe { launch(dev, "rms_dx", dt, row_grid(rows), &args) }?;
    Ok((dx, x.1.shape().clone()))
}

/// The row length `h` of RMSNorm's dx, after checking that the gradient has
/// x's shape and the weight is `(h,)` (the kernel indexes all three by it).
fn rms_dx_hidden(lx: &Layout, lw: &Layout, lg: &Layout) -> Result<usize> {
    let h = *lx.dims().last().unwrap_or(&0);
    if lx.shape() != lg.shape() || lw.dims() != [h] {
        bail!(
            "rms-norm-dx: x {:?}, weight {:?}, grad {:?}",
            lx.shape(),
            lw.shape(),
            lg.shape()
        );
    }
    Ok(h)
}

/// Fails unless the residual gradient (its dtype and layout), when given, is
/// of x's shape and dtype: the kernel reads it as x's rows.
fn check_residual(res: Option<(DType, &Layout)>, (sx, lx): Operand<'_>) -> Result<()> {
    if let Some((dt, l)) = res {
        if l.shape() != lx.shape() || !l.is_contiguous() || dt != sx.dtype() {
            bail!(
                "rms-norm-dx: residual gradient {:?} {:?} (contiguous: {}) for x {:?} {:?}",
                l.shape(),
                dt,
                l.is_contiguous(),
                lx.shape(),
                sx.dtype()
            );
        }
    }
    Ok(())
}

/// `x -> (rows,)` f32: each row's `1 / sqrt(mean(x^2) + eps)`.
fn rms_rinv(dev: &CudaDevice, [x]: [Operand<'_>; 1], eps: f32) -> Result<(CudaStorage, Shape)> {
    let h = *x.1.dims().last().unwrap_or(&0);
    if h == 0 {
        bail!("rms-norm-rinv: x {:?} has empty rows", x.1.shape());
    }
    let rows = x.1.shape().elem_count() / h;
    // SAFETY: one block per row writes that row's value.
    let rinv = unsafe { alloc(dev, DType::F32, rows) }?;
    let args = [
        at(x),
        Arg::F32Buf(&rinv, 0),
        Arg::I32(h as i32),
        Arg::F32(eps),
    ];
    // SAFETY: rows x h inputs, rows outputs, as the kernel indexes.
    unsafe { launch(dev, "rms_rinv", x.0.dtype(), row_grid(rows), &args) }?;
    Ok((rinv, Shape::from(rows)))
}

/// Row blocks of the weight-gradient kernel: four per SM of an H200 class GPU
/// is plenty; fewer for short inputs.
fn dw_blocks(rows: usize) -> usize {
    rows.clamp(1, 528)
}

/// `(x, g, rinv) -> (blocks, hidden)` f32 partial sums of `g x rinv` over row blocks.
fn rms_dw_partial(dev: &CudaDevice, [x, g, r]: [Operand<'_>; 3]) -> Result<(CudaStorage, Shape)> {
    let h = *x.1.dims().last().unwrap_or(&0);
    if x.1.shape() != g.1.shape() || h == 0 || h > MAX_HIDDEN {
        bail!(
            "rms-norm-dw: x {:?}, grad {:?} (hidden 1..={MAX_HIDDEN})",
            x.1.shape(),
            g.1.shape()
        );
    }
    let rows = x.1.shape().elem_count() / h;
    if r.1.dims() != [rows] {
        bail!("rms-norm-dw: rinv {:?} for {rows} rows", r.1.shape());
    }
    let blocks = dw_blocks(rows);
    let per = rows.div_ceil(blocks);
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // Zeroed: a block past the last row (rows < blocks * per) still writes its zeros.
    let part = zeros(dev, DType::F32, blocks * h)?;
    let args = [
        at(x),
        at(g),
        Arg::F32Buf(&part, 0),
        Arg::Usize(rows),
        Arg::I32(h as i32),
        Arg::F32Buf(r.0, r.1.start_offset()),
        Arg::Usize(per),
    ];
    // SAFETY: rows x h inputs, rows rinv; the output holds blocks x h floats.
    unsafe { launch(dev, "rms_dw", x.0.dtype(), cfg, &args) }?;
    Ok((part, Shape::from((blocks, h))))
}

/// RMSNorm's `(dx, dw)` on CUDA in two passes, `None` for a row wider than
/// the weight-gradient kernel takes (the caller then uses Candle ops).
/// With `res`, `dx` has the residual branch's gradient added in the same pass.
pub(crate) fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    res: Option<&Tensor>,
    eps: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    let h = x.dim(candle_core::D::Minus1)?;
    let res_ok = res.is_none_or(|r| r.dtype() == x.dtype() && r.shape() == x.shape());
    if h > MAX_HIDDEN || w.dtype() != x.dtype() || grad.dtype() != x.dtype() || !res_ok {
        return Ok(None);
    }
    let (x, w, g) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
    let eps = eps as f32;
    let dx = match res.map(|r| r.contiguous()).transpose()? {
        Some(r) => on_cuda("rms-norm-dx", [&x, &w, &g, &r], |dev, [x, w, g, r]| {
            rms_dx(dev, [x, w, g], Some(r), eps)
        })?,
        None => on_cuda("rms-norm-dx", [&x, &w, &g], |dev, ops| {
            rms_dx(dev, ops, None, eps)
        })?,
    };
    let rinv = on_cuda("rms-norm-rinv", [&x], |dev, ops| rms_rinv(dev, ops, eps))?;
    let dw = on_cuda("rms-norm-dw", [&x, &g, &rinv], rms_dw_partial)?
        .sum(0)?
        .to_dtype(w.dtype())?;
    Ok(Some((dx, dw)))
}

/// Per-row cross-entropy losses `(rows,)` f32 of contiguous `logits (rows,
/// vocab)` against u32 `targets (rows,)` (NaN where a target is out of range).
pub(crate) fn cross_entropy_fwd(
    (sx, lx): Operand<'_>,
    (st, lt): Operand<'_>,
) -> Result<CudaStorage> {
    let (ox, ot) = (contiguous(lx, "logits")?, contiguous(lt, "targets")?);
    let (rows, vocab) = lx.shape().dims2()?;
    let dev = sx.device();
    // SAFETY: one block per row writes that row's loss.
    let loss = unsafe { alloc(dev, DType::F32, rows) }?;
    let args = [
        Arg::Buf(sx, ox),
        Arg::U32Buf(st, ot),
        Arg::F32Buf(&loss, 0),
        Arg::I32(vocab as i32),
    ];
    // SAFETY: rows x vocab logits, rows targets and losses, as the kernel indexes.
    unsafe { launch(dev, "ce_fwd", sx.dtype(), row_grid(rows), &args) }?;
    Ok(loss)
}

/// The logits' gradient `(rows, vocab)` in their dtype, from `aux = [loss;
/// grad of loss]` (`2 rows` f32).
pub(crate) fn cross_entropy_bwd(
    (sx, lx): Operand<'_>,
    (st, lt): Operand<'_>,
    (sa, la): Operand<'_>,
) -> Result<CudaStorage> {
    let (ox, ot, oa) = (
        contiguous(lx, "logits")?,
        contiguous(lt, "targets")?,
        contiguous(la, "aux")?,
    );
    let (rows, vocab) = lx.shape().dims2()?;
    if lt.dims() != [rows] || la.dims() != [2 * rows] {
        bail!(
            "cross_entropy backward: logits {:?}, targets {:?}, aux {:?}",
            lx.shape(),
            lt.shape(),
            la.shape()
        );
    }
    let dev = sx.device();
    // SAFETY: one block per row writes every element of its row.
    let d = unsafe { alloc(dev, sx.dtype(), rows * vocab) }?;
    let args = [
        Arg::Buf(sx, ox),
        Arg::U32Buf(st, ot),
        Arg::F32Buf(sa, oa),
        Arg::Buf(&d, 0),
        Arg::I32(vocab as i32),
        Arg::I32(rows as i32),
    ];
    // SAFETY: rows x vocab logits and gradient, rows targets, 2 rows aux.
    unsafe { launch(dev, "ce_bwd", sx.dtype(), row_grid(rows), &args) }?;
    Ok(d)
}

/// `acc (vocab, hidden)` f32 with `acc[ids[t]] += g[t]` over the contiguous
/// `ids (tokens,)` u32 and `g (tokens, hidden)`.
pub(crate) fn embedding_bwd(
    (si, li): Operand<'_>,
    (sg, lg): Operand<'_>,
    vocab: usize,
) -> Result<CudaStorage> {
    let (oi, og) = (contiguous(li, "token ids")?, contiguous(lg, "gradient")?);
    let (tokens, hidden) = lg.shape().dims2()?;
    if li.dims() != [tokens] {
        bail!(
            "embedding backward: ids {:?} for a gradient {:?}",
            li.shape(),
            lg.shape()
        );
    }
    let dev = sg.device();
    let acc = zeros(dev, DType::F32, vocab * hidden)?;
    if tokens == 0 {
        return Ok(acc);
    }
    let args = [
        Arg::U32Buf(si, oi),
        Arg::Buf(sg, og),
        Arg::F32Buf(&acc, 0),
        Arg::I32(hidden as i32),
        Arg::I32(vocab as i32),
    ];
    // SAFETY: tokens ids and tokens x hidden gradients; rows of acc are
    // indexed by ids below vocab only (the kernel skips others).
    unsafe { launch(dev, "embed_bwd", sg.dtype(), row_grid(tokens), &args) }?;
    Ok(acc)
}

/// RoPE fused with the move between rows `(b * n, heads * d)` and head-major
/// `(b, heads, n, d)` (`to_heads`), the inverse rotation with `sign = -1`
/// (`decoder.cu`'s `rope_move`).
fn rope_move(
    src: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    to_heads: bool,
    [b, n, h, d]: [usize; 4],
    sign: f32,
) -> Result<Tensor> {
    let (x, c, s) = (src.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    on_cuda("rope-move", [&x, &c, &s], |dev, [x, c, s]| {
        let out_shape = if to_heads {
            Shape::from((b, h, n, d))
        } else {
            Shape::from((b * n, h * d))
        };
        if x.1.shape().elem_count() != b * n * h * d
            || d % 2 != 0
            || c.1.dims() != [n, d / 2]
            || s.1.dims() != [n, d / 2]
        {
            bail!(
                "rope-move: input {:?}, cos {:?}, sin {:?} for (b, n, heads, d) = {:?}",
                x.1.shape(),
                c.1.shape(),
                s.1.shape(),
                [b, n, h, d]
            );
        }
        let (count, dt) = (b * h * n * d, x.0.dtype());
        let kernel = if to_heads {
            "rope_to_heads"
        } else {
            "rope_to_rows"
        };
        // SAFETY: the kernel writes every element (each pair of halves).
        let out = unsafe { alloc(dev, dt, count) }?;
        let [b32, n32, h32, d32] = [b, n, h, d].map(|v| Arg::I32(v as i32));
        let args = [
            at(x),
            at(c),
            at(s),
            Arg::Buf(&out, 0),
            b32,
            n32,
            h32,
            d32,
            Arg::F32(sign),
        ];
        // SAFETY: input and output of b*n*h*d elements, tables of n*d/2, as indexed.
        unsafe { launch(dev, kernel, dt, grid(count / 2), &args) }?;
        Ok((out, out_shape))
    })
}

/// `p (b * n, heads * d)` rotated into head-major `(b, heads, n, d)`, one pass.
pub(crate) fn rope_to_heads(
    p: &Tensor,
    (b, n, heads): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let d = p.dim(1)? / heads.max(1);
    rope_move(p, cos, sin, true, [b, n, heads, d], 1.0)
}

/// `g (b, heads, n, d)` rotated back (the inverse rotation) into rows
/// `(b * n, heads * d)`, one pass.
pub(crate) fn rope_to_rows(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = g.dims4()?;
    rope_move(g, cos, sin, false, [b, n, h, d], -1.0)
}
