//! The decoder backward's fused element-wise pieces on CUDA (kernels in
//! `kernels/src/decoder.cu`), as Candle custom ops without a backward of
//! their own (they are the backward). The CPU and unsupported shapes use the
//! Candle-op versions in `decoder_backward.rs` / `fused_ops.rs`, which the
//! tests hold these to.
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Widest row the RMSNorm weight-gradient kernel takes (32 columns per thread).
const MAX_HIDDEN: usize = 32 * 256;

fn contiguous(l: &Layout, what: &str) -> Result<usize> {
    if !l.is_contiguous() {
        bail!(
            "decoder kernels: {what} must be contiguous, got {:?}",
            l.shape()
        );
    }
    Ok(l.start_offset())
}

fn suffix(dt: DType) -> Result<&'static str> {
    streamer_core::kernel_suffix(dt, "decoder kernels")
}

fn func(dev: &candle_core::CudaDevice, name: &str) -> Result<cudarc::driver::CudaFunction> {
    streamer_kernels::function(dev, &streamer_kernels::DECODER, name)
        .map(streamer_kernels::Kernel::into_function)
}

use streamer_device::grid_stride as grid;

/// `$go!(T)` for the dtype's element type (bf16, f16 or f32), or an error
/// naming `$what` for any other dtype: every op below launches this way.
macro_rules! by_dtype {
    ($dt:expr, $what:expr, $go:ident) => {
        match $dt {
            DType::BF16 => $go!(half::bf16),
            DType::F16 => $go!(half::f16),
            DType::F32 => $go!(f32),
            dt => bail!("{}: unsupported dtype {dt:?}", $what),
        }
    };
}

/// `(d_act, gate, up) -> [d_gate; d_up]` stacked as `(2, ...)`.
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("swiglu-bwd: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(
        &self,
        sa: &CudaStorage,
        la: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
        su: &CudaStorage,
        lu: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (oa, og, ou) = (
            contiguous(la, "d_act")?,
            contiguous(lg, "gate")?,
            contiguous(lu, "up")?,
        );
        if la.shape() != lg.shape() || la.shape() != lu.shape() {
            bail!(
                "swiglu-bwd: shapes differ: {:?} {:?} {:?}",
                la.shape(),
                lg.shape(),
                lu.shape()
            );
        }
        let n = la.shape().elem_count();
        let dev = sa.device().clone();
        let f = func(&dev, &format!("swiglu_bwd_{}", suffix(sa.dtype())?))?;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($t:ty) => {{
                let (a, g, u) = (sa.as_cuda_slice::<$t>()?.slice(oa..), sg.as_cuda_slice::<$t>()?.slice(og..), su.as_cuda_slice::<$t>()?.slice(ou..));
                // SAFETY: the kernel writes all 2n elements before anything reads them.
                let out = unsafe { dev.alloc::<$t>(2 * n) }?;
                let mut b = stream.launch_builder(&f);
                b.arg(&a).arg(&g).arg(&u).arg(&out).arg(&n);
                // SAFETY: three inputs of n elements and an output of 2n, as the kernel reads and writes.
                unsafe { b.launch(grid(n)) }.map_err(candle_core::Error::wrap)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = by_dtype!(sa.dtype(), "swiglu-bwd", go);
        let mut dims = vec![2];
        dims.extend_from_slice(la.dims());
        Ok((out, Shape::from(dims)))
    }
}

/// For `act = silu(gate) * up` on CUDA: `(d_gate, d_up)` in one pass.
pub(crate) fn swiglu_backward(
    d_act: &Tensor,
    gate: &Tensor,
    up: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let both = d_act
        .contiguous()?
        .apply_op3(&gate.contiguous()?, &up.contiguous()?, SwiGluBwd)?;
    Ok((both.get(0)?, both.get(1)?))
}

/// `(a, b) -> f(a, b)` element-wise, one kernel `{kernel}_{dtype}(a, b, out, n)`.
struct Binary {
    name: &'static str,
    kernel: &'static str,
}

impl candle_core::CustomOp2 for Binary {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("{}: CUDA only (the CPU uses Candle ops)", self.name)
    }

    fn cuda_fwd(
        &self,
        sg: &CudaStorage,
        lg: &Layout,
        su: &CudaStorage,
        lu: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (og, ou) = (
            contiguous(lg, "first operand")?,
            contiguous(lu, "second operand")?,
        );
        if lg.shape() != lu.shape() || sg.dtype() != su.dtype() {
            bail!(
                "{}: operands {:?} {:?} and {:?} {:?} differ",
                self.name,
                lg.shape(),
                sg.dtype(),
                lu.shape(),
                su.dtype()
            );
        }
        let n = lg.shape().elem_count();
        let dev = sg.device().clone();
        let f = func(&dev, &format!("{}_{}", self.kernel, suffix(sg.dtype())?))?;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($t:ty) => {{
                let (g, u) = (
                    sg.as_cuda_slice::<$t>()?.slice(og..),
                    su.as_cuda_slice::<$t>()?.slice(ou..),
                );
                // SAFETY: the kernel writes all n elements before anything reads them.
                let out = unsafe { dev.alloc::<$t>(n) }?;
                let mut b = stream.launch_builder(&f);
                b.arg(&g).arg(&u).arg(&out).arg(&n);
                // SAFETY: two inputs and an output of n elements, as the kernel indexes.
                unsafe { b.launch(grid(n)) }.map_err(candle_core::Error::wrap)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = by_dtype!(sg.dtype(), self.name, go);
        Ok((out, lg.shape().clone()))
    }
}

/// `silu(gate) * up` on CUDA in one pass (f32 arithmetic, one rounding).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let op = Binary {
        name: "swiglu-fwd",
        kernel: "swiglu_fwd",
    };
    gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &op)
}

/// `dh * gelu'(z)` (tanh GELU) on CUDA in one pass.
pub(crate) fn gelu_backward(dh: &Tensor, z: &Tensor) -> Result<Tensor> {
    let op = Binary {
        name: "gelu-bwd",
        kernel: "gelu_bwd",
    };
    dh.contiguous()?.apply_op2_no_bwd(&z.contiguous()?, &op)
}

/// `(x, r, w) -> [x + r; rms_norm(x + r) w]` stacked as `(2, ...)`.
struct AddRms {
    eps: f32,
}

impl CustomOp3 for AddRms {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("add-rms-norm: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(
        &self,
        sx: &CudaStorage,
        lx: &Layout,
        sr: &CudaStorage,
        lr: &Layout,
        sw: &CudaStorage,
        lw: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (ox, or, ow) = (
            contiguous(lx, "x")?,
            contiguous(lr, "residual")?,
            contiguous(lw, "weight")?,
        );
        let h = *lx.dims().last().unwrap_or(&0);
        let same = sx.dtype() == sr.dtype() && sx.dtype() == sw.dtype();
        if lx.shape() != lr.shape() || lw.dims() != [h] || h == 0 || !same {
            bail!(
                "add-rms-norm: x {:?} {:?}, residual {:?} {:?}, weight {:?} {:?}",
                lx.shape(),
                sx.dtype(),
                lr.shape(),
                sr.dtype(),
                lw.shape(),
                sw.dtype()
            );
        }
        let n = lx.shape().elem_count();
        let dev = sx.device().clone();
        let f = func(&dev, &format!("add_rms_{}", suffix(sx.dtype())?))?;
        let stream = dev.cuda_stream();
        let (h32, eps) = (h as i32, self.eps);
        macro_rules! go {
            ($t:ty) => {{
                let (x, r, w) = (
                    sx.as_cuda_slice::<$t>()?.slice(ox..),
                    sr.as_cuda_slice::<$t>()?.slice(or..),
                    sw.as_cuda_slice::<$t>()?.slice(ow..),
                );
                // SAFETY: one block per row writes every element of both halves.
                let out = unsafe { dev.alloc::<$t>(2 * n) }?;
                {
                    let (s, y) = (out.slice(..n), out.slice(n..));
                    let mut b = stream.launch_builder(&f);
                    b.arg(&x)
                        .arg(&r)
                        .arg(&w)
                        .arg(&s)
                        .arg(&y)
                        .arg(&h32)
                        .arg(&eps);
                    // SAFETY: rows x h inputs and two outputs of rows x h, a weight of h.
                    unsafe { b.launch(row_grid(n / h)) }.map_err(candle_core::Error::wrap)?;
                }
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = by_dtype!(sx.dtype(), "add-rms-norm", go);
        let mut dims = vec![2];
        dims.extend_from_slice(lx.dims());
        Ok((out, Shape::from(dims)))
    }
}

/// `(x + r, rms_norm(x + r) w)` on CUDA in one pass over each row.
pub(crate) fn add_rms_norm(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let both = x.contiguous()?.apply_op3_no_bwd(
        &r.contiguous()?,
        &w.contiguous()?,
        &AddRms { eps: eps as f32 },
    )?;
    Ok((both.get(0)?, both.get(1)?))
}

/// `(x, w, g) -> dx` of RMSNorm over the last dim, plus `res` (the gradient
/// of a residual branch into the same input, x's shape and dtype) when given.
struct RmsDx {
    eps: f32,
    res: Option<Tensor>,
}

impl CustomOp3 for RmsDx {
    fn name(&self) -> &'static str {
        "rms-norm-dx"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("rms-norm-dx: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(
        &self,
        sx: &CudaStorage,
        lx: &Layout,
        sw: &CudaStorage,
        lw: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (ox, ow, og) = (
            contiguous(lx, "x")?,
            contiguous(lw, "weight")?,
            contiguous(lg, "grad")?,
        );
        let h = rms_dx_hidden(lx, lw, lg)?;
        let (n, rows) = (lx.shape().elem_count(), lx.shape().elem_count() / h.max(1));
        let res = self.res.as_ref().map(|t| t.storage_and_layout());
        check_residual(res.as_ref().map(|(st, l)| (st.dtype(), *l)), sx, lx)?;
        let dev = sx.device().clone();
        let f = func(&dev, &format!("rms_dx_{}", suffix(sx.dtype())?))?;
        let stream = dev.cuda_stream();
        let cfg = row_grid(rows);
        let (h32, eps) = (h as i32, self.eps);
        macro_rules! go {
            ($t:ty) => {{
                let (x, w, g) = (
                    sx.as_cuda_slice::<$t>()?.slice(ox..),
                    sw.as_cuda_slice::<$t>()?.slice(ow..),
                    sg.as_cuda_slice::<$t>()?.slice(og..),
                );
                let r = match &res {
                    Some((st, l)) => match &**st {
                        candle_core::Storage::Cuda(c) => {
                            Some(c.as_cuda_slice::<$t>()?.slice(l.start_offset()..))
                        }
                        _ => bail!("rms-norm-dx: the residual gradient is not on CUDA"),
                    },
                    None => None,
                };
                // The kernel reads no residual through a null pointer.
                let null = 0u64;
                // SAFETY: one block per row writes every element of its row.
                let dx = unsafe { dev.alloc::<$t>(n) }?;
                let mut b = stream.launch_builder(&f);
                b.arg(&x).arg(&w).arg(&g);
                match &r {
                    Some(r) => b.arg(r),
                    None => b.arg(&null),
                };
                b.arg(&dx).arg(&h32).arg(&eps);
                // SAFETY: rows x h inputs (the residual too, checked above) and
                // output, a weight of h, as the kernel indexes.
                unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
                CudaStorage::wrap_cuda_slice(dx, dev.clone())
            }};
        }
        let dx = by_dtype!(sx.dtype(), "rms-norm-dx", go);
        Ok((dx, lx.shape().clone()))
    }
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
/// contiguous and of x's shape and dtype: the kernel reads it as x's rows.
fn check_residual(res: Option<(DType, &Layout)>, sx: &CudaStorage, lx: &Layout) -> Result<()> {
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
struct RmsRinv {
    eps: f32,
}

impl candle_core::CustomOp1 for RmsRinv {
    fn name(&self) -> &'static str {
        "rms-norm-rinv"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("rms-norm-rinv: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(&self, sx: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
        let ox = contiguous(lx, "x")?;
        let h = *lx.dims().last().unwrap_or(&0);
        if h == 0 {
            bail!("rms-norm-rinv: x {:?} has empty rows", lx.shape());
        }
        let rows = lx.shape().elem_count() / h;
        let dev = sx.device().clone();
        let f = func(&dev, &format!("rms_rinv_{}", suffix(sx.dtype())?))?;
        let stream = dev.cuda_stream();
        // SAFETY: one block per row writes that row's value.
        let rinv = unsafe { dev.alloc::<f32>(rows) }?;
        let (h32, eps) = (h as i32, self.eps);
        macro_rules! go {
            ($t:ty) => {{
                let x = sx.as_cuda_slice::<$t>()?.slice(ox..);
                let mut b = stream.launch_builder(&f);
                b.arg(&x).arg(&rinv).arg(&h32).arg(&eps);
                // SAFETY: rows x h inputs, rows outputs, as the kernel indexes.
                unsafe { b.launch(row_grid(rows)) }.map_err(candle_core::Error::wrap)?;
            }};
        }
        by_dtype!(sx.dtype(), "rms-norm-rinv", go);
        Ok((CudaStorage::wrap_cuda_slice(rinv, dev), Shape::from(rows)))
    }
}

/// `(x, g, rinv) -> (blocks, hidden)` f32 partial sums of `g x rinv` over row blocks.
struct RmsDwPartial;

/// Row blocks of the weight-gradient kernel: four per SM of an H200 class GPU
/// is plenty; fewer for short inputs.
fn dw_blocks(rows: usize) -> usize {
    rows.clamp(1, 528)
}

impl CustomOp3 for RmsDwPartial {
    fn name(&self) -> &'static str {
        "rms-norm-dw"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("rms-norm-dw: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(
        &self,
        sx: &CudaStorage,
        lx: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
        sr: &CudaStorage,
        lr: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (ox, og, or) = (
            contiguous(lx, "x")?,
            contiguous(lg, "grad")?,
            contiguous(lr, "rinv")?,
        );
        let h = *lx.dims().last().unwrap_or(&0);
        if lx.shape() != lg.shape() || h == 0 || h > MAX_HIDDEN {
            bail!(
                "rms-norm-dw: x {:?}, grad {:?} (hidden 1..={MAX_HIDDEN})",
                lx.shape(),
                lg.shape()
            );
        }
        let rows = lx.shape().elem_count() / h;
        if lr.dims() != [rows] {
            bail!("rms-norm-dw: rinv {:?} for {rows} rows", lr.shape());
        }
        let blocks = dw_blocks(rows);
        let per = rows.div_ceil(blocks);
        let dev = sx.device().clone();
        let f = func(&dev, &format!("rms_dw_{}", suffix(sx.dtype())?))?;
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let h32 = h as i32;
        // Zeroed: a block past the last row (rows < blocks * per) still writes its zeros.
        let part = dev.alloc_zeros::<f32>(blocks * h)?;
        let rinv = sr.as_cuda_slice::<f32>()?.slice(or..);
        macro_rules! go {
            ($t:ty) => {{
                let (x, g) = (
                    sx.as_cuda_slice::<$t>()?.slice(ox..),
                    sg.as_cuda_slice::<$t>()?.slice(og..),
                );
                let mut b = stream.launch_builder(&f);
                b.arg(&x)
                    .arg(&g)
                    .arg(&part)
                    .arg(&rows)
                    .arg(&h32)
                    .arg(&rinv)
                    .arg(&per);
                // SAFETY: rows x h inputs, rows rinv; the output holds blocks x h floats.
                unsafe { b.launch(cfg) }.map_err(candle_core::Error::wrap)?;
            }};
        }
        by_dtype!(sx.dtype(), "rms-norm-dw", go);
        Ok((
            CudaStorage::wrap_cuda_slice(part, dev),
            Shape::from((blocks, h)),
        ))
    }
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
    let res = res.map(|r| r.contiguous()).transpose()?;
    let dx = x.apply_op3_no_bwd(
        &w,
        &g,
        &RmsDx {
            eps: eps as f32,
            res,
        },
    )?;
    let rinv = x.apply_op1_no_bwd(&RmsRinv { eps: eps as f32 })?;
    let dw = x
        .apply_op3_no_bwd(&g, &rinv, &RmsDwPartial)?
        .sum(0)?
        .to_dtype(w.dtype())?;
    Ok(Some((dx, dw)))
}

/// Per-row cross-entropy losses `(rows,)` f32 of contiguous `logits (rows,
/// vocab)` against u32 `targets (rows,)` (NaN where a target is out of range).
pub(crate) fn cross_entropy_fwd(
    sx: &CudaStorage,
    lx: &Layout,
    st: &CudaStorage,
    lt: &Layout,
) -> Result<CudaStorage> {
    let (ox, ot) = (contiguous(lx, "logits")?, contiguous(lt, "targets")?);
    let (rows, vocab) = lx.shape().dims2()?;
    let dev = sx.device().clone();
    let f = func(&dev, &format!("ce_fwd_{}", suffix(sx.dtype())?))?;
    let stream = dev.cuda_stream();
    let t = st.as_cuda_slice::<u32>()?.slice(ot..);
    // SAFETY: one block per row writes that row's loss.
    let loss = unsafe { dev.alloc::<f32>(rows) }?;
    let v = vocab as i32;
    macro_rules! go {
        ($t:ty) => {{
            let x = sx.as_cuda_slice::<$t>()?.slice(ox..);
            let mut b = stream.launch_builder(&f);
            b.arg(&x).arg(&t).arg(&loss).arg(&v);
            // SAFETY: rows x vocab logits, rows targets and losses, as the kernel indexes.
            unsafe { b.launch(row_grid(rows)) }.map_err(candle_core::Error::wrap)?;
        }};
    }
    by_dtype!(sx.dtype(), "cross_entropy", go);
    Ok(CudaStorage::wrap_cuda_slice(loss, dev))
}

/// The logits' gradient `(rows, vocab)` in their dtype, from `aux = [loss;
/// grad of loss]` (`2 rows` f32).
pub(crate) fn cross_entropy_bwd(
    sx: &CudaStorage,
    lx: &Layout,
    st: &CudaStorage,
    lt: &Layout,
    sa: &CudaStorage,
    la: &Layout,
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
    let dev = sx.device().clone();
    let f = func(&dev, &format!("ce_bwd_{}", suffix(sx.dtype())?))?;
    let stream = dev.cuda_stream();
    let t = st.as_cuda_slice::<u32>()?.slice(ot..);
    let a = sa.as_cuda_slice::<f32>()?.slice(oa..);
    let (v, n) = (vocab as i32, rows as i32);
    macro_rules! go {
        ($t:ty) => {{
            let x = sx.as_cuda_slice::<$t>()?.slice(ox..);
            // SAFETY: one block per row writes every element of its row.
            let d = unsafe { dev.alloc::<$t>(rows * vocab) }?;
            let mut b = stream.launch_builder(&f);
            b.arg(&x).arg(&t).arg(&a).arg(&d).arg(&v).arg(&n);
            // SAFETY: rows x vocab logits and gradient, rows targets, 2 rows aux.
            unsafe { b.launch(row_grid(rows)) }.map_err(candle_core::Error::wrap)?;
            CudaStorage::wrap_cuda_slice(d, dev.clone())
        }};
    }
    Ok(by_dtype!(sx.dtype(), "cross_entropy backward", go))
}

/// One 256-thread block per row.
fn row_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `acc (vocab, hidden)` f32 with `acc[ids[t]] += g[t]` over the contiguous
/// `ids (tokens,)` u32 and `g (tokens, hidden)`.
pub(crate) fn embedding_bwd(
    si: &CudaStorage,
    li: &Layout,
    sg: &CudaStorage,
    lg: &Layout,
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
    let dev = sg.device().clone();
    let f = func(&dev, &format!("embed_bwd_{}", suffix(sg.dtype())?))?;
    let stream = dev.cuda_stream();
    let acc = dev.alloc_zeros::<f32>(vocab * hidden)?;
    if tokens == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(acc, dev));
    }
    let ids = si.as_cuda_slice::<u32>()?.slice(oi..);
    let (h, v) = (hidden as i32, vocab as i32);
    macro_rules! go {
        ($t:ty) => {{
            let g = sg.as_cuda_slice::<$t>()?.slice(og..);
            let mut b = stream.launch_builder(&f);
            b.arg(&ids).arg(&g).arg(&acc).arg(&h).arg(&v);
            // SAFETY: tokens ids and tokens x hidden gradients; rows of acc
            // are indexed by ids below vocab only (the kernel skips others).
            unsafe { b.launch(row_grid(tokens)) }.map_err(candle_core::Error::wrap)?;
        }};
    }
    by_dtype!(sg.dtype(), "embedding backward", go);
    Ok(CudaStorage::wrap_cuda_slice(acc, dev))
}

/// `(src, cos, sin) -> dst`: RoPE fused with the move between rows
/// `(b * n, heads * d)` and head-major `(b, heads, n, d)` (`to_heads`), the
/// inverse rotation with `sign = -1` (`decoder.cu`'s `rope_move`).
struct RopeMove {
    to_heads: bool,
    dims: [usize; 4],
    sign: f32,
}

impl CustomOp3 for RopeMove {
    fn name(&self) -> &'static str {
        "rope-move"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("rope-move: CUDA only (the CPU uses Candle ops)")
    }

    fn cuda_fwd(
        &self,
        sx: &CudaStorage,
        lx: &Layout,
        sc: &CudaStorage,
        lc: &Layout,
        ss: &CudaStorage,
        ls: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (ox, oc, os) = (
            contiguous(lx, "input")?,
            contiguous(lc, "cos")?,
            contiguous(ls, "sin")?,
        );
        let [b, n, h, d] = self.dims;
        let out_shape = if self.to_heads {
            Shape::from((b, h, n, d))
        } else {
            Shape::from((b * n, h * d))
        };
        if lx.shape().elem_count() != b * n * h * d
            || d % 2 != 0
            || lc.dims() != [n, d / 2]
            || ls.dims() != [n, d / 2]
        {
            bail!(
                "rope-move: input {:?}, cos {:?}, sin {:?} for (b, n, heads, d) = {:?}",
                lx.shape(),
                lc.shape(),
                ls.shape(),
                self.dims
            );
        }
        let count = b * h * n * d;
        let dev = sx.device().clone();
        let which = if self.to_heads {
            "rope_to_heads"
        } else {
            "rope_to_rows"
        };
        let f = func(&dev, &format!("{which}_{}", suffix(sx.dtype())?))?;
        let stream = dev.cuda_stream();
        let (b32, n32, h32, d32, sign) = (b as i32, n as i32, h as i32, d as i32, self.sign);
        macro_rules! go {
            ($t:ty) => {{
                let (x, c, s) = (
                    sx.as_cuda_slice::<$t>()?.slice(ox..),
                    sc.as_cuda_slice::<$t>()?.slice(oc..),
                    ss.as_cuda_slice::<$t>()?.slice(os..),
                );
                // SAFETY: the kernel writes every element (each pair of halves).
                let out = unsafe { dev.alloc::<$t>(count) }?;
                let mut l = stream.launch_builder(&f);
                l.arg(&x).arg(&c).arg(&s).arg(&out);
                l.arg(&b32).arg(&n32).arg(&h32).arg(&d32).arg(&sign);
                // SAFETY: input and output of b*n*h*d elements, tables of n*d/2, as indexed.
                unsafe { l.launch(grid(count / 2)) }.map_err(candle_core::Error::wrap)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            }};
        }
        let out = by_dtype!(sx.dtype(), "rope-move", go);
        Ok((out, out_shape))
    }
}

/// `p (b * n, heads * d)` rotated into head-major `(b, heads, n, d)`, one pass.
pub(crate) fn rope_to_heads(
    p: &Tensor,
    (b, n, heads): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let d = p.dim(1)? / heads.max(1);
    let op = RopeMove {
        to_heads: true,
        dims: [b, n, heads, d],
        sign: 1.0,
    };
    p.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// `g (b, heads, n, d)` rotated back (the inverse rotation) into rows
/// `(b * n, heads * d)`, one pass.
pub(crate) fn rope_to_rows(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, h, n, d) = g.dims4()?;
    let op = RopeMove {
        to_heads: false,
        dims: [b, n, h, d],
        sign: -1.0,
    };
    g.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}
