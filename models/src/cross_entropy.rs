//! Cross-entropy straight from the logits' own dtype.
//!
//! `candle_nn::loss::cross_entropy` on bf16 logits needs them in f32 first
//! (`log_softmax` in bf16 loses the loss), and its backward builds the
//! softmax, the one-hot and their difference as separate full-size tensors. At
//! a real vocabulary that is the largest allocation of a step: 16 x 2048 rows
//! of 128,256 logits are 16.8 GB in f32. Here the forward reads each row once
//! for its log-sum-exp and keeps only one f32 loss per row; the backward reads
//! the logits once more and writes their gradient in their own dtype, the
//! row's log-sum-exp recovered from its loss (`lse = loss + x[target]`).
//! Arithmetic is f32 on CUDA (f64 on the CPU, the reference).
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Mean cross-entropy (an f32 scalar) of `logits (rows, vocab)` (f32, bf16 or
/// f16) against `targets (rows,)` u32 on the same device, differentiable in the
/// logits. A target outside the vocabulary makes that row's loss NaN on CUDA
/// (checked without a device sync) and is an error naming the row on the CPU.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    per_row_cross_entropy(logits, targets)?.mean_all()
}

/// One f32 loss per row (`(rows,)`), as [`cross_entropy`] before the mean.
pub fn per_row_cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if !matches!(logits.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        bail!(
            "cross_entropy: logits must be f32, bf16 or f16, got {:?}",
            logits.dtype()
        );
    }
    if targets.dims() != [rows] || targets.dtype() != DType::U32 {
        bail!(
            "cross_entropy: targets must be ({rows},) u32 for logits ({rows}, {vocab}), got {:?} {:?}",
            targets.dims(),
            targets.dtype()
        );
    }
    if !targets.device().same_device(logits.device()) {
        bail!("cross_entropy: targets and logits are on different devices");
    }
    if rows == 0 || rows > i32::MAX as usize {
        bail!("cross_entropy: {rows} rows of logits is outside 1..=2^31-1");
    }
    if vocab == 0 || vocab > i32::MAX as usize {
        bail!("cross_entropy: vocabulary of {vocab} logits per row is outside 1..=2^31-1");
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CeForward)
}

/// The per-row forward.
struct CeForward;

/// `(logits, targets, [loss; g]) -> d_logits`.
struct CeBackward;

fn rows_of(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    let start = l.start_offset();
    let n = l.shape().elem_count();
    Ok(match s {
        CpuStorage::F32(v) => v[start..start + n].iter().map(|&x| x as f64).collect(),
        CpuStorage::BF16(v) => v[start..start + n].iter().map(|x| x.to_f64()).collect(),
        CpuStorage::F16(v) => v[start..start + n].iter().map(|x| x.to_f64()).collect(),
        s => bail!(
            "cross_entropy: logits must be f32, bf16 or f16, got {:?}",
            s.dtype()
        ),
    })
}

fn targets_of(s: &CpuStorage, l: &Layout, vocab: usize) -> Result<Vec<usize>> {
    let t = token_ids(s, l, vocab, "cross_entropy: target", "row")?;
    Ok(t.iter().map(|&k| k as usize).collect())
}

/// The inputs both CPU passes read: `(rows, vocab)`, the logits row-major in
/// f64 and each row's target.
type CpuInputs = (usize, usize, Vec<f64>, Vec<usize>);

fn logits_and_targets(
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
) -> Result<CpuInputs> {
    let (rows, vocab) = l1.shape().dims2()?;
    Ok((rows, vocab, rows_of(s1, l1)?, targets_of(s2, l2, vocab)?))
}

/// The u32 ids of a CPU tensor, each checked to be below `vocab`; an error
/// names the first other as "`{what}` {id} of `{unit}` {index}".
pub(crate) fn token_ids<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    vocab: usize,
    what: &str,
    unit: &str,
) -> Result<&'a [u32]> {
    let CpuStorage::U32(t) = s else {
        bail!("{what}s must be u32, got {:?}", s.dtype());
    };
    let t = &t[l.start_offset()..l.start_offset() + l.shape().elem_count()];
    if let Some((r, &k)) = t.iter().enumerate().find(|(_, &k)| k as usize >= vocab) {
        bail!("{what} {k} of {unit} {r} is outside the vocabulary of {vocab}");
    }
    Ok(t)
}

/// Log-sum-exp of one row (f64).
fn lse(row: &[f64]) -> f64 {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

impl CustomOp2 for CeForward {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab, x, t) = logits_and_targets((s1, l1), (s2, l2))?;
        let loss = (0..rows)
            .map(|r| {
                let row = &x[r * vocab..(r + 1) * vocab];
                (lse(row) - row[t[r]]) as f32
            })
            .collect();
        Ok((CpuStorage::F32(loss), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, _) = l1.shape().dims2()?;
        let loss = crate::ops::decoder::cross_entropy_fwd((s1, l1), (s2, l2))?;
        Ok((loss, Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let aux = Tensor::cat(
            &[res.detach(), grad_res.to_dtype(DType::F32)?.contiguous()?],
            0,
        )?;
        let d = logits
            .contiguous()?
            .apply_op3_no_bwd(targets, &aux, &CeBackward)?;
        Ok((Some(d), None))
    }
}

impl CustomOp3 for CeBackward {
    fn name(&self) -> &'static str {
        "cross-entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab, x, t) = logits_and_targets((s1, l1), (s2, l2))?;
        let CpuStorage::F32(aux) = s3 else {
            bail!("cross_entropy backward: aux must be f32");
        };
        let g = &aux[l3.start_offset() + rows..l3.start_offset() + 2 * rows];
        let mut d = vec![0f64; rows * vocab];
        for r in 0..rows {
            let row = &x[r * vocab..(r + 1) * vocab];
            let l = lse(row);
            for (j, (o, &v)) in d[r * vocab..(r + 1) * vocab]
                .iter_mut()
                .zip(row)
                .enumerate()
            {
                *o = g[r] as f64 * ((v - l).exp() - if j == t[r] { 1.0 } else { 0.0 });
            }
        }
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(d.iter().map(|&v| v as f32).collect()),
            DType::BF16 => CpuStorage::BF16(d.iter().map(|&v| half::bf16::from_f64(v)).collect()),
            DType::F16 => CpuStorage::F16(d.iter().map(|&v| half::f16::from_f64(v)).collect()),
            dt => bail!("cross_entropy backward: unsupported dtype {dt:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = crate::ops::decoder::cross_entropy_bwd((s1, l1), (s2, l2), (s3, l3))?;
        Ok((d, l1.shape().clone()))
    }
}

/// Rows of logits one chunk of [`linear_cross_entropy`] holds: about 512 MiB
/// of them in `dtype` (at least one row).
pub fn linear_cross_entropy_chunk(vocab: usize, dtype: DType) -> usize {
    ((512usize << 20) / (vocab * dtype.size_in_bytes()).max(1)).max(1)
}

/// Mean cross-entropy of the logits `h w^T` (`h (rows, hidden)`, `w (vocab,
/// hidden)`, one dtype) against `targets (rows,)` u32, computed `chunk` rows
/// at a time, so that no `(rows, vocab)` tensor exists: at 8 x 2048 tokens
/// and a 128,256-token vocabulary the logits and their gradient would be
/// 8.4 GB of bf16. Differentiable in `h` and `w`; equal to
/// `cross_entropy(&h.matmul(&w.t()?)?, targets)`.
///
/// The loss ends the graph and its upstream gradient is a scalar, so when
/// `h` or `w` wants a gradient each chunk's logits give its losses and its
/// gradients at once (for an upstream gradient of 1): the backward scales
/// them, rather than computing every chunk's logits again (a third of the
/// head's work). They are handed over at the first backward; a second one
/// (a kept graph) computes them again. `w`'s gradient is summed over chunks
/// in f32.
pub fn linear_cross_entropy(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk: usize,
) -> Result<Tensor> {
    let (rows, hidden) = h.dims2()?;
    let (_, w_hidden) = w.dims2()?;
    if w_hidden != hidden || h.dtype() != w.dtype() {
        bail!(
            "linear_cross_entropy: h {:?} {:?} and w {:?} {:?} do not multiply",
            h.dims(),
            h.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    if chunk == 0 {
        bail!("linear_cross_entropy: chunk must be positive");
    }
    let head = ChunkedHead {
        hd: h.detach().contiguous()?,
        wd: w.detach(),
        t: targets.contiguous()?,
        spans: (0..rows)
            .step_by(chunk)
            .map(|s| (s, chunk.min(rows - s)))
            .collect(),
        rows,
    };
    let want_w = w.track_op();
    if !(want_w || h.track_op()) {
        return head.losses()?.mean_all();
    }
    let (per_row, dh, dw) = head.run(
        &head.row_gradient(&Tensor::ones((), DType::F32, h.device())?)?,
        None,
        want_w,
    )?;
    let loss = per_row.mean_all()?;
    let ready = std::sync::Mutex::new(Some((dh, dw)));
    let backward = move |g: &Tensor| -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let taken = ready
            .lock()
            .map_err(|_| candle_core::Error::Msg("linear_cross_entropy: poisoned".into()))?
            .take();
        let Some((dh, dw)) = taken else {
            let (_, dh, dw) = head.run(&head.row_gradient(g)?, Some(&per_row), want_w)?;
            return Ok((Some(dh), dw, None));
        };
        let scale = |t: Tensor| -> Result<Tensor> { t.broadcast_mul(&g.to_dtype(t.dtype())?) };
        Ok((Some(scale(dh)?), dw.map(scale).transpose()?, None))
    };
    streamer_device::with_backward3(
        "linear-cross-entropy",
        h,
        w,
        targets,
        loss.detach(),
        backward,
    )
}

/// A chunked head and loss: `h` and `w` detached, the targets, and the row
/// spans of the chunks.
struct ChunkedHead {
    hd: Tensor,
    wd: Tensor,
    t: Tensor,
    spans: Vec<(usize, usize)>,
    rows: usize,
}

impl ChunkedHead {
    /// The logits of the rows `s..s + n`.
    fn logits(&self, (s, n): (usize, usize)) -> Result<Tensor> {
        self.hd.narrow(0, s, n)?.matmul(&self.wd.t()?)?.contiguous()
    }

    /// Every row's loss (f32).
    fn losses(&self) -> Result<Tensor> {
        let parts = self
            .spans
            .iter()
            .map(|&(s, n)| per_row_cross_entropy(&self.logits((s, n))?, &self.t.narrow(0, s, n)?))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    }

    /// d loss / d (a row's loss) for an upstream gradient `g` of the mean:
    /// `g / rows`, as a one-element f32 tensor.
    fn row_gradient(&self, g: &Tensor) -> Result<Tensor> {
        g.to_dtype(DType::F32)?.reshape(1)? / self.rows as f64
    }

    /// Every row's loss (or the `known` ones) and the gradients of `h` and
    /// (`want_w`) `w` for a gradient of `g_row` on each row's loss, each
    /// chunk's logits computed once.
    fn run(
        &self,
        g_row: &Tensor,
        known: Option<&Tensor>,
        want_w: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let (mut losses, mut dh) = (Vec::new(), Vec::new());
        let mut dw: Option<Tensor> = None;
        for &(s, n) in &self.spans {
            let logits = self.logits((s, n))?;
            let t = self.t.narrow(0, s, n)?;
            let per_row = match known {
                Some(k) => k.narrow(0, s, n)?,
                None => per_row_cross_entropy(&logits, &t)?,
            };
            let aux = Tensor::cat(&[per_row.clone(), g_row.broadcast_as(n)?.contiguous()?], 0)?;
            let d = logits.apply_op3_no_bwd(&t, &aux, &CeBackward)?;
            dh.push(d.matmul(&self.wd)?);
            if want_w {
                let part = d
                    .t()?
                    .matmul(&self.hd.narrow(0, s, n)?)?
                    .to_dtype(DType::F32)?;
                dw = Some(match dw {
                    None => part,
                    Some(acc) => (acc + part)?,
                });
            }
            losses.push(per_row);
        }
        let dw = dw.map(|d| d.to_dtype(self.wd.dtype())).transpose()?;
        Ok((Tensor::cat(&losses, 0)?, Tensor::cat(&dh, 0)?, dw))
    }
}
