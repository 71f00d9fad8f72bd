//! The CPU path: a rayon multi-threaded, chunked online-softmax attention.
//!
//! Forward: each task owns a block of [`Q_BLOCK`] query rows of one (batch, head)
//! and walks the keys in blocks of [`K_BLOCK`], keeping per row the running maximum,
//! the running sum of exponentials and an un-normalised output accumulator (the
//! online softmax). Nothing of size `seq_q x seq_k` is ever allocated. It returns
//! the output and the natural-log log-sum-exp of every row.
//!
//! Backward recomputes the probabilities from that log-sum-exp:
//! `p = exp(s - lse)`, `ds = p * (do . v - delta)` with `delta = do . o`, then
//! `dq = scale * ds k`, `dk = scale * ds^T q`, `dv = p^T do`. dq is computed by tasks
//! over query blocks and dk/dv by tasks over key blocks (summing the query heads of a
//! grouped-query group), so no two tasks write the same memory.
//!
//! All arithmetic is f32 whatever the storage dtype; f16/bf16 inputs are widened once.
use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, Layout, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::{AttentionShape, Scores};

/// Query rows per task.
const Q_BLOCK: usize = 32;
/// Keys per inner block.
const K_BLOCK: usize = 64;

/// The contiguous elements of `s` described by `l`, widened to f32.
pub(crate) fn to_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [f32]>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("cqsa: cpu input must be contiguous, got layout {l:?}")
    };
    Ok(match s {
        CpuStorage::F32(v) => Cow::Borrowed(&v[a..b]),
        CpuStorage::F16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(v[a..b].iter().map(|x| x.to_f32()).collect()),
        other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
    })
}

/// Narrows f32 results to the storage of `like`'s dtype.
pub(crate) fn from_f32(v: Vec<f32>, like: &CpuStorage) -> Result<CpuStorage> {
    Ok(match like {
        CpuStorage::F32(_) => CpuStorage::F32(v),
        // In parallel: a streamed call's output or gradient can be billions of
        // elements.
        CpuStorage::F16(_) => CpuStorage::F16(v.par_iter().map(|&x| f16::from_f32(x)).collect()),
        CpuStorage::BF16(_) => CpuStorage::BF16(v.par_iter().map(|&x| bf16::from_f32(x)).collect()),
        other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
    })
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Four partial sums let the compiler vectorise without fast-math.
    let mut acc = [0f32; 4];
    let mut ca = a.chunks_exact(4);
    let mut cb = b.chunks_exact(4);
    for (x, y) in (&mut ca).zip(&mut cb) {
        acc[0] += x[0] * y[0];
        acc[1] += x[1] * y[1];
        acc[2] += x[2] * y[2];
        acc[3] += x[3] * y[3];
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Forward on contiguous f32 data laid out `(b, h, n, d)`. Returns the output and
/// the log-sum-exp `(b, hq, nq)`; rows that see no key get output 0 and lse `-inf`.
/// Scores and mask per `sc` (masked keys never enter the row maximum).
pub(crate) fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &AttentionShape,
    sc: &Scores,
) -> (Vec<f32>, Vec<f32>) {
    let AttentionShape { hq, nq, d, .. } = *dims;
    let mut o = vec![0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; dims.b * hq * nq];
    let tasks: Vec<(usize, usize, &mut [f32], &mut [f32])> = o
        .chunks_mut(nq * d)
        .zip(lse.chunks_mut(nq))
        .enumerate()
        .flat_map(|(bh, (ob, lb))| {
            ob.chunks_mut(Q_BLOCK * d)
                .zip(lb.chunks_mut(Q_BLOCK))
                .enumerate()
                .map(move |(qb, (oc, lc))| (bh, qb * Q_BLOCK, oc, lc))
        })
        .collect();
    tasks.into_par_iter().for_each(|(bh, i0, oc, lc)| {
        forward_block(q, k, v, dims, sc, (bh, i0), oc, lc);
    });
    (o, lse)
}

/// One forward task: rows `i0..` (as many as `lc` holds) of head `bh`.
#[allow(clippy::too_many_arguments)]
fn forward_block(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &AttentionShape,
    sc: &Scores,
    (bh, i0): (usize, usize),
    oc: &mut [f32],
    lc: &mut [f32],
) {
    let AttentionShape {
        hq, hkv, nq, nk, d, ..
    } = *dims;
    let (bi, h) = (bh / hq, bh % hq);
    let kvh = bi * hkv + h / (hq / hkv);
    let qs = &q[bh * nq * d..(bh + 1) * nq * d];
    let ks = &k[kvh * nk * d..(kvh + 1) * nk * d];
    let vs = &v[kvh * nk * d..(kvh + 1) * nk * d];
    let rows = lc.len();
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    let mut s = vec![0f32; K_BLOCK];
    // Both bounds grow with the row: the block's keys run from the first row's
    // first key to the last row's last.
    let (first, _) = sc.keys(i0, nk);
    let (_, last) = sc.keys(i0 + rows - 1, nk);
    for j0 in (first..last).step_by(K_BLOCK) {
        let j1 = (j0 + K_BLOCK).min(last);
        for r in 0..rows {
            let i = i0 + r;
            let (ja, jb) = sc.keys(i, nk);
            let (ja, jb) = (ja.max(j0), jb.min(j1));
            if jb <= ja {
                continue;
            }
            let qi = &qs[i * d..(i + 1) * d];
            let mut bmax = f32::NEG_INFINITY;
            for j in ja..jb {
                let (x, _) = sc.score(dot(qi, &ks[j * d..(j + 1) * d]));
                s[j - ja] = x;
                bmax = bmax.max(x);
            }
            let mnew = m[r].max(bmax);
            let corr = (m[r] - mnew).exp(); // 0 when m was -inf
            let acc = &mut oc[r * d..(r + 1) * d];
            if corr != 1.0 {
                acc.iter_mut().for_each(|a| *a *= corr);
            }
            let mut sum = 0f32;
            for j in ja..jb {
                let p = (s[j - ja] - mnew).exp();
                sum += p;
                axpy(acc, p, &vs[j * d..(j + 1) * d]);
            }
            l[r] = l[r] * corr + sum;
            m[r] = mnew;
        }
    }
    for r in 0..rows {
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            oc[r * d..(r + 1) * d].iter_mut().for_each(|a| *a *= inv);
            lc[r] = m[r] + l[r].ln();
        }
    }
}

/// The inputs of a backward call, contiguous f32.
pub(crate) struct BackwardInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub g: &'a [f32],
    pub lse: &'a [f32],
}

/// Gradients of the inputs given the output `o`, its gradient `g` and the forward's
/// `lse`, all contiguous f32. Returns `(dq, dk, dv)` shaped like `(q, k, v)`.
/// With soft-capping, the gradient of a score passes through `1 - tanh^2`.
pub(crate) fn backward(
    x: &BackwardInputs<'_>,
    dims: &AttentionShape,
    sc: &Scores,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let BackwardInputs { q, k, v, o, g, lse } = *x;
    let AttentionShape {
        hq, hkv, nq, nk, d, ..
    } = *dims;
    let group = hq / hkv;
    let delta: Vec<f32> = o
        .par_chunks(d)
        .zip(g.par_chunks(d))
        .map(|(o, g)| dot(o, g))
        .collect();
    // dS of one (row, key) pair given p's inputs: (p, ds * d s / d(scale x)).
    let pds = |qi: &[f32], gi: &[f32], kj: &[f32], vj: &[f32], li: f32, di: f32| {
        let (s, dsdx) = sc.score(dot(qi, kj));
        let p = (s - li).exp();
        (p, p * (dot(gi, vj) - di) * dsdx)
    };

    // dq: tasks over blocks of query rows.
    let mut dq = vec![0f32; q.len()];
    dq.par_chunks_mut(Q_BLOCK * d)
        .enumerate()
        .for_each(|(t, dqc)| {
            // Blocks never straddle two heads only if nq is a multiple of Q_BLOCK, so
            // locate every row separately.
            for (r, dqi) in dqc.chunks_mut(d).enumerate() {
                let row = t * Q_BLOCK + r; // global row over (b, hq, nq)
                let (bh, i) = (row / nq, row % nq);
                let kvh = (bh / hq) * hkv + (bh % hq) / group;
                if lse[row] == f32::NEG_INFINITY {
                    continue;
                }
                let (qi, gi) = (&q[row * d..(row + 1) * d], &g[row * d..(row + 1) * d]);
                let (ja, jb) = sc.keys(i, nk);
                for j in ja..jb {
                    let kj = &k[(kvh * nk + j) * d..(kvh * nk + j + 1) * d];
                    let vj = &v[(kvh * nk + j) * d..(kvh * nk + j + 1) * d];
                    let (_, ds) = pds(qi, gi, kj, vj, lse[row], delta[row]);
                    axpy(dqi, ds * sc.scale, kj);
                }
            }
        });

    // dk, dv: tasks over blocks of keys of one (batch, kv head).
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    dk.par_chunks_mut(K_BLOCK * d)
        .zip(dv.par_chunks_mut(K_BLOCK * d))
        .enumerate()
        .for_each(|(t, (dkc, dvc))| {
            for (r, (dkj, dvj)) in dkc.chunks_mut(d).zip(dvc.chunks_mut(d)).enumerate() {
                let col = t * K_BLOCK + r; // global key over (b, hkv, nk)
                let (kvh, j) = (col / nk, col % nk);
                let (bi, hk) = (kvh / hkv, kvh % hkv);
                let (kj, vj) = (&k[col * d..(col + 1) * d], &v[col * d..(col + 1) * d]);
                let (ia, ib) = sc.rows(j, nq);
                for h in hk * group..(hk + 1) * group {
                    for i in ia..ib {
                        let row = (bi * hq + h) * nq + i;
                        if lse[row] == f32::NEG_INFINITY {
                            continue;
                        }
                        let (qi, gi) = (&q[row * d..(row + 1) * d], &g[row * d..(row + 1) * d]);
                        let (p, ds) = pds(qi, gi, kj, vj, lse[row], delta[row]);
                        axpy(dvj, p, gi);
                        axpy(dkj, ds * sc.scale, qi);
                    }
                }
            }
        });
    (dq, dk, dv)
}
