//! Out-of-core mode: Q/K/V stay in host memory, chunks go to the compute device one
//! subproblem at a time, and partial results are merged by their log-sum-exp.
//!
//! Forward, for each query chunk `Qi`: for each key chunk `(Kj, Vj)` that `Qi` can
//! see, the resident kernel gives `(Oij, lseij)`; the running pair `(O, lse)` is
//! merged with it as `lse' = log(e^lse + e^lseij)`,
//! `O' = O e^(lse - lse') + Oij e^(lseij - lse')` in f32, which is exact because
//! each partial output is already normalised by its own log-sum-exp.
//!
//! Backward, for each key chunk `(Kj, Vj)`: for each query chunk that sees it, the
//! resident backward with the *global* log-sum-exp of the rows (and their global
//! output, which gives the global `delta = do . o`) yields exact partial `dQi`,
//! `dKj`, `dVj`; dK/dV accumulate on the device in f32 across query chunks, dQ in
//! host f32 memory across key chunks.
//!
//! A causal subproblem uses the offset of its chunk pair: key `j0 + c` is visible
//! from query `i0 + r` iff `c <= r + (i0 + seq_k - seq_q - j0)`; pairs that see
//! nothing are skipped, pairs that see everything run unmasked.
//!
//! The op is a `CustomOp3` over host tensors, so autograd sees one node; inputs on
//! a device are first moved to the host (a differentiable copy) and the output is
//! moved back.
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor,
};

use crate::op::{attention_backward, attention_forward};
use crate::{causal_offset, cpu, resolve_scale, AttentionOpts, Dims, Plan};

/// Runs `attention` in streamed mode per `plan`, computing on `exec`.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    plan: &Plan,
    exec: &Device,
    verbose: bool,
) -> Result<Tensor> {
    let dims = crate::validate(q, k, v)?;
    let op = StreamOp {
        dims,
        scale: resolve_scale(opts.scale, dims.d),
        causal: causal_offset(opts.causal, &dims),
        q_chunk: plan.q_chunk.max(1),
        kv_chunk: plan.kv_chunk.max(1),
        exec: exec.clone(),
        verbose,
        lse: Arc::new(Mutex::new(None)),
    };
    let host = |t: &Tensor| -> Result<Tensor> {
        if t.device().is_cpu() {
            t.contiguous()
        } else {
            t.to_device(&Device::Cpu)?.contiguous()
        }
    };
    let (qh, kh, vh) = (host(q)?, host(k)?, host(v)?);
    let o = qh.apply_op3(&kh, &vh, op)?;
    if q.device().is_cpu() {
        Ok(o)
    } else {
        o.to_device(q.device())
    }
}

/// The streamed attention op over host tensors.
struct StreamOp {
    dims: Dims,
    scale: f32,
    causal: Option<i64>,
    q_chunk: usize,
    kv_chunk: usize,
    exec: Device,
    verbose: bool,
    /// Host log-sum-exp `(b, hq, nq)` kept by the forward for the backward.
    lse: Arc<Mutex<Option<Vec<f32>>>>,
}

fn poisoned<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("cqsa: log-sum-exp cell poisoned by a panic".into())
}

/// Rows `r0..r1` of every (batch, head) of a contiguous `(b, h, n, d)` host
/// storage, as a tensor `(b, h, r1 - r0, d)` on `dev`.
fn gather(s: &CpuStorage, l: &Layout, r0: usize, r1: usize, dev: &Device) -> Result<Tensor> {
    let (b, h, n, d) = l.shape().dims4()?;
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("cqsa: streamed input must be contiguous, got layout {l:?}")
    };
    fn pick<T: Copy>(v: &[T], bh: usize, n: usize, d: usize, r0: usize, r1: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(bh * (r1 - r0) * d);
        for x in 0..bh {
            out.extend_from_slice(&v[(x * n + r0) * d..(x * n + r1) * d]);
        }
        out
    }
    let shape = (b, h, r1 - r0, d);
    match s {
        CpuStorage::F32(v) => {
            Tensor::from_slice(&pick(&v[start..], b * h, n, d, r0, r1), shape, dev)
        }
        CpuStorage::F16(v) => {
            Tensor::from_slice(&pick(&v[start..], b * h, n, d, r0, r1), shape, dev)
        }
        CpuStorage::BF16(v) => {
            Tensor::from_slice(&pick(&v[start..], b * h, n, d, r0, r1), shape, dev)
        }
        other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
    }
}

/// Adds (or writes, when `add` is false) a chunk `(b, h, r1 - r0, d)` into rows
/// `r0..r1` of the f32 host buffer `dst` laid out `(b, h, n, d)`.
fn scatter(dst: &mut [f32], chunk: &Tensor, n: usize, r0: usize, add: bool) -> Result<()> {
    let (b, h, c, d) = chunk.dims4()?;
    let src = chunk
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for x in 0..b * h {
        let dst = &mut dst[(x * n + r0) * d..(x * n + r0 + c) * d];
        let src = &src[x * c * d..(x + 1) * c * d];
        if add {
            dst.iter_mut().zip(src).for_each(|(a, b)| *a += b);
        } else {
            dst.copy_from_slice(src);
        }
    }
    Ok(())
}

/// Merges two normalised partial results by their log-sum-exp (f32 tensors).
fn merge(o1: &Tensor, l1: &Tensor, o2: &Tensor, l2: &Tensor) -> Result<(Tensor, Tensor)> {
    // -inf (a row that saw nothing) becomes a finite floor so that no inf - inf
    // appears; exp(floor - m) is then 0 against any real log-sum-exp.
    let l1 = l1.maximum(-1e30f32)?;
    let l2 = l2.maximum(-1e30f32)?;
    let m = l1.maximum(&l2)?;
    let w1 = (&l1 - &m)?.exp()?;
    let w2 = (&l2 - &m)?.exp()?;
    let tot = (&w1 + &w2)?;
    let o = (o1.broadcast_mul(&(&w1 / &tot)?.unsqueeze(3)?)?
        + o2.broadcast_mul(&(&w2 / &tot)?.unsqueeze(3)?)?)?;
    let lse = (m + tot.log()?)?;
    Ok((o, lse))
}

/// Causal offset of the chunk pair `(i0..i1, j0..j1)`: `Err(())` when it sees
/// nothing, `Ok(None)` when it sees everything, `Ok(Some(off))` otherwise.
#[allow(clippy::result_unit_err)]
fn pair_offset(
    causal: Option<i64>,
    i0: usize,
    i1: usize,
    j0: usize,
    j1: usize,
) -> std::result::Result<Option<i64>, ()> {
    let Some(off) = causal else { return Ok(None) };
    let local = i0 as i64 + off - j0 as i64; // key c visible from row r iff c <= r + local
    if local + (i1 - i0) as i64 - 1 < 0 {
        Err(())
    } else if (j1 - j0) as i64 - 1 <= local {
        Ok(None)
    } else {
        Ok(Some(local))
    }
}

struct Progress {
    on: bool,
    what: &'static str,
    total: usize,
    done: usize,
    start: Instant,
}

impl Progress {
    fn new(on: bool, what: &'static str, total: usize) -> Self {
        Self {
            on,
            what,
            total,
            done: 0,
            start: Instant::now(),
        }
    }

    fn tick(&mut self) {
        self.done += 1;
        if self.on {
            let t = self.start.elapsed().as_secs_f64();
            let eta = t / self.done as f64 * (self.total.saturating_sub(self.done)) as f64;
            eprint!(
                "\rcqsa: {} {}/{} subproblems, {:.1} s, ~{:.1} s left   ",
                self.what, self.done, self.total, t, eta
            );
        }
    }

    fn finish(&self) {
        if self.on {
            eprintln!(
                "\rcqsa: {} done in {:.2} s ({} subproblems)                ",
                self.what,
                self.start.elapsed().as_secs_f64(),
                self.done
            );
        }
    }
}

impl StreamOp {
    fn chunks(n: usize, c: usize) -> Vec<(usize, usize)> {
        (0..n).step_by(c).map(|a| (a, (a + c).min(n))).collect()
    }

    fn count(&self) -> usize {
        let Dims { nq, nk, .. } = self.dims;
        let mut n = 0;
        for (i0, i1) in Self::chunks(nq, self.q_chunk) {
            for (j0, j1) in Self::chunks(nk, self.kv_chunk) {
                n += usize::from(pair_offset(self.causal, i0, i1, j0, j1).is_ok());
            }
        }
        n
    }
}

impl CustomOp3 for StreamOp {
    fn name(&self) -> &'static str {
        "cqsa-attention-streamed"
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
        let Dims {
            b, hq, nq, nk, d, ..
        } = self.dims;
        let mut out = vec![0f32; b * hq * nq * d];
        let mut lse_all = vec![f32::NEG_INFINITY; b * hq * nq];
        let mut progress = Progress::new(self.verbose, "forward", self.count());
        for (i0, i1) in Self::chunks(nq, self.q_chunk) {
            let qc = gather(sq, lq, i0, i1, &self.exec)?;
            let mut acc: Option<(Tensor, Tensor)> = None;
            for (j0, j1) in Self::chunks(nk, self.kv_chunk) {
                let Ok(off) = pair_offset(self.causal, i0, i1, j0, j1) else {
                    continue;
                };
                let kc = gather(sk, lk, j0, j1, &self.exec)?;
                let vc = gather(sv, lv, j0, j1, &self.exec)?;
                let (o, l) = attention_forward(&qc, &kc, &vc, self.scale, off)?;
                let o = o.to_dtype(DType::F32)?;
                acc = Some(match acc {
                    None => (o, l),
                    Some((ao, al)) => merge(&ao, &al, &o, &l)?,
                });
                progress.tick();
            }
            if let Some((o, l)) = acc {
                scatter(&mut out, &o, nq, i0, false)?;
                let l = l.flatten_all()?.to_vec1::<f32>()?;
                let c = i1 - i0;
                for x in 0..b * hq {
                    for r in 0..c {
                        let val = l[x * c + r];
                        lse_all[x * nq + i0 + r] =
                            if val < -1e29 { f32::NEG_INFINITY } else { val };
                    }
                }
            }
        }
        progress.finish();
        *self.lse.lock().map_err(poisoned)? = Some(lse_all);
        Ok((cpu::from_f32(out, sq)?, lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().map_err(poisoned)?.clone() else {
            bail!("cqsa: streamed backward called before its forward")
        };
        let Dims {
            b,
            hq,
            hkv,
            nq,
            nk,
            d,
        } = self.dims;
        let lse = Tensor::from_vec(lse, (b, hq, nq, 1), &Device::Cpu)?;
        let to_host = |t: &Tensor| -> Result<Tensor> {
            let t = if t.device().is_cpu() {
                t.clone()
            } else {
                t.to_device(&Device::Cpu)?
            };
            t.to_dtype(q.dtype())?.contiguous()
        };
        let (o, g) = (to_host(o)?, to_host(grad_o)?);
        let (sq, lq) = q.storage_and_layout();
        let (sk, lk) = k.storage_and_layout();
        let (sv, lv) = v.storage_and_layout();
        let (so, lo) = o.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        let (sl, ll) = lse.storage_and_layout();
        let (
            Storage::Cpu(sq),
            Storage::Cpu(sk),
            Storage::Cpu(sv),
            Storage::Cpu(so),
            Storage::Cpu(sg),
            Storage::Cpu(sl),
        ) = (&*sq, &*sk, &*sv, &*so, &*sg, &*sl)
        else {
            bail!("cqsa: streamed backward expects host tensors")
        };
        let mut dq = vec![0f32; b * hq * nq * d];
        let mut dk = vec![0f32; b * hkv * nk * d];
        let mut dv = vec![0f32; b * hkv * nk * d];
        let mut progress = Progress::new(self.verbose, "backward", self.count());
        for (j0, j1) in Self::chunks(nk, self.kv_chunk) {
            let kc = gather(sk, lk, j0, j1, &self.exec)?;
            let vc = gather(sv, lv, j0, j1, &self.exec)?;
            let mut acc: Option<(Tensor, Tensor)> = None;
            for (i0, i1) in Self::chunks(nq, self.q_chunk) {
                let Ok(off) = pair_offset(self.causal, i0, i1, j0, j1) else {
                    continue;
                };
                let qc = gather(sq, lq, i0, i1, &self.exec)?;
                let oc = gather(so, lo, i0, i1, &self.exec)?;
                let gc = gather(sg, lg, i0, i1, &self.exec)?;
                let lc = gather(sl, ll, i0, i1, &self.exec)?.squeeze(3)?;
                let (dqc, dkc, dvc) =
                    attention_backward(&qc, &kc, &vc, &oc, &gc, &lc, self.scale, off)?;
                scatter(&mut dq, &dqc, nq, i0, true)?;
                let (dkc, dvc) = (dkc.to_dtype(DType::F32)?, dvc.to_dtype(DType::F32)?);
                acc = Some(match acc {
                    None => (dkc, dvc),
                    Some((ak, av)) => ((ak + dkc)?, (av + dvc)?),
                });
                progress.tick();
            }
            if let Some((ak, av)) = acc {
                scatter(&mut dk, &ak, nk, j0, false)?;
                scatter(&mut dv, &av, nk, j0, false)?;
            }
        }
        progress.finish();
        let wrap = |x: Vec<f32>, shape: &Shape| -> Result<Tensor> {
            Ok(Tensor::from_storage(
                Storage::Cpu(cpu::from_f32(x, sq)?),
                shape,
                BackpropOp::none(),
                false,
            ))
        };
        Ok((
            Some(wrap(dq, q.shape())?),
            Some(wrap(dk, k.shape())?),
            Some(wrap(dv, v.shape())?),
        ))
    }
}
