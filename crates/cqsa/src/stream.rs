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
//! `dKj`, `dVj`; dK/dV accumulate on the device in f32 across query chunks and
//! land once, in the inputs' dtype; dQ sums in host f32 memory across key chunks.
//!
//! A masked subproblem uses the band of its chunk pair (`Scores::shifted`): key
//! `j0 + c` is visible from query `i0 + r` iff `r + lo + i0 - j0 <= c <= r + hi +
//! i0 - j0`; pairs that see nothing are skipped, pairs that see everything run
//! unmasked (soft-capping, when on, applies to every pair).
//!
//! Results come back to host buffers through the same `Feed`: the merged
//! output and log-sum-exp once per query chunk (forward), dq once per subproblem
//! (added) and dk, dv once per key chunk (backward); the host writes or adds them
//! in parallel over the (batch, head) row runs. Sums are kept in f32; the
//! forward's output, written once per row, lands converted to its own dtype, so
//! the host holds no f32 copy of it (a forward needs Q/K/V/O and the
//! log-sum-exp, little more).
//!
//! On a CUDA compute device the host inputs are page-locked in place
//! (`cuMemHostRegister`) and every subproblem's chunks are copied on a transfer
//! stream of their own while the previous subproblem computes (one subproblem
//! ahead), ordered by explicit events (see `ChunkFeed` in `cuda.rs`). Results go
//! back on a third stream into page-locked staging buffers, reused within the
//! call and kept for later calls ([`crate::staging`]), and the host
//! applies them one subproblem late: after the next subproblem's kernels are
//! issued, so that both the copy and the host's add overlap that compute. On the
//! CPU they are applied at once. Either way every chunk lands in the order it was
//! produced, so the sums (and the results) are the same.
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
use rayon::prelude::*;

use crate::mask::Coverage;
use crate::merge::merge_by_lse;
use crate::op::{attention_backward_with, attention_forward_with};
use crate::{cpu, AttentionShape, Plan, Scores};

/// Runs `attention` in streamed mode as `op` (see [`StreamOp::new`]) says.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, op: StreamOp) -> Result<Tensor> {
    let (qh, kh, vh) = (host(q)?, host(k)?, host(v)?);
    let o = qh.apply_op3(&kh, &vh, op)?;
    to_device_of(&o, q)
}

/// A contiguous host copy of `t` (itself when it already is one).
fn host(t: &Tensor) -> Result<Tensor> {
    streamer_device::to_device_compact(t, &Device::Cpu)?.contiguous()
}

/// Host result `t` on the device of `like`.
fn to_device_of(t: &Tensor, like: &Tensor) -> Result<Tensor> {
    if like.device().is_cpu() {
        Ok(t.clone())
    } else {
        t.to_device(like.device())
    }
}

/// A streamed forward run outside autograd, with what its backward needs: the
/// host inputs and output, and the op holding the log-sum-exp.
pub(crate) struct Saved {
    op: StreamOp,
    host: [Tensor; 4],
    /// The inputs' device, where the gradients go.
    device: Device,
}

/// The streamed forward of [`attention`] without a graph node: returns the
/// output (on the inputs' device) and what [`Saved::backward`] needs.
pub(crate) fn forward_saved(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    op: StreamOp,
) -> Result<(Tensor, Saved)> {
    let (qh, kh, vh) = (host(q)?.detach(), host(k)?.detach(), host(v)?.detach());
    let o = qh.apply_op3_no_bwd(&kh, &vh, &op)?;
    let out = to_device_of(&o, q)?;
    let device = q.device().clone();
    Ok((
        out,
        Saved {
            op,
            host: [qh, kh, vh, o],
            device,
        },
    ))
}

impl Saved {
    /// The forward's output, on the host.
    pub(crate) fn output(&self) -> &Tensor {
        &self.host[3]
    }

    /// `(dq, dk, dv)` on the inputs' device for the output's gradient `grad_o`.
    pub(crate) fn backward(&self, grad_o: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let [q, k, v, o] = &self.host;
        let (dq, dk, dv) = self.op.backward_host(q, k, v, o, grad_o)?;
        let back = |t: Tensor| -> Result<Tensor> {
            if self.device.is_cpu() {
                Ok(t)
            } else {
                t.to_device(&self.device)
            }
        };
        Ok((back(dq)?, back(dk)?, back(dv)?))
    }
}

/// The streamed attention op over host tensors.
pub(crate) struct StreamOp {
    dims: AttentionShape,
    scores: Scores,
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

/// A host result laid out `(b, h, rows, w)` (`w` the head dim, or 1 for the
/// log-sum-exp), which result chunks of rows land in.
struct Sink {
    data: SinkData,
    rows: usize,
}

/// A sink's elements: f32 where chunks add up (gradients, the log-sum-exp),
/// or the output's own dtype where every row is written once (the forward's
/// output). The latter never holds an f32 copy of the output on the host, whose
/// memory bounds how long an out-of-core call can be.
enum SinkData {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
}

impl Sink {
    fn new(len: usize, rows: usize, fill: f32) -> Self {
        Self {
            data: SinkData::F32(vec![fill; len]),
            rows,
        }
    }

    /// A zeroed sink in the dtype of `like` (f16, bf16 or f32), written once per row.
    /// Zeroed by the allocator (zero bits as `u16`): `vec![bf16::ZERO; len]` would
    /// write every element up front, 16 GiB before the first subproblem of a 4M-token
    /// call; this way each page is first touched when its rows land.
    fn written_as(len: usize, rows: usize, like: &CpuStorage) -> Result<Self> {
        use half::vec::HalfBitsVecExt;
        let data = match like {
            CpuStorage::F32(_) => SinkData::F32(vec![0.0; len]),
            CpuStorage::F16(_) => SinkData::F16(vec![0u16; len].reinterpret_into()),
            CpuStorage::BF16(_) => SinkData::BF16(vec![0u16; len].reinterpret_into()),
            other => bail!("cqsa: unsupported dtype {:?}", other.dtype()),
        };
        Ok(Self { data, rows })
    }
}

impl SinkData {
    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::BF16(v) => v.len(),
        }
    }

    /// The elements as a host storage of their dtype.
    fn into_storage(self) -> CpuStorage {
        match self {
            Self::F32(v) => CpuStorage::F32(v),
            Self::F16(v) => CpuStorage::F16(v),
            Self::BF16(v) => CpuStorage::BF16(v),
        }
    }

    /// The elements of an f32 sink.
    fn into_f32(self) -> Result<Vec<f32>> {
        match self {
            Self::F32(v) => Ok(v),
            _ => bail!("cqsa: an accumulating result sink must be f32"),
        }
    }
}

/// Adds (or writes, when `add` is false) `chunk`, the elements of a `(runs, c, w)`
/// block of rows, into rows `r0..r0 + c` of every (batch, head) run of `sink`.
/// Parallel over pieces of the runs; each element gets the one operation a
/// sequential loop would give it, so the result does not depend on the threads.
fn land(
    sink: &mut Sink,
    chunk: &[f32],
    shape: (usize, usize, usize),
    r0: usize,
    add: bool,
) -> Result<()> {
    /// Elements per parallel task (256 KiB): many tasks even for few runs.
    const PIECE: usize = 1 << 16;
    let (runs, c, w) = shape;
    let (run, stride) = (c * w, sink.rows * w);
    if chunk.len() != runs * run || sink.data.len() != runs * stride || r0 + c > sink.rows {
        bail!(
            "cqsa: result chunk {shape:?} at row {r0} does not fit {} rows of {} elements",
            sink.rows,
            sink.data.len()
        )
    }
    if run == 0 {
        return Ok(());
    }
    /// Applies `op` to each element of rows `r0..` of every run and its chunk value.
    fn each<T: Send>(
        data: &mut [T],
        chunk: &[f32],
        (stride, run, at): (usize, usize, usize),
        op: impl Fn(&mut T, f32) + Sync,
    ) {
        data.par_chunks_mut(stride)
            .zip(chunk.par_chunks(run))
            .flat_map(|(dst, src)| {
                dst[at..at + run]
                    .par_chunks_mut(PIECE)
                    .zip(src.par_chunks(PIECE))
            })
            .for_each(|(dst, src)| dst.iter_mut().zip(src).for_each(|(a, &b)| op(a, b)));
    }
    let geometry = (stride, run, r0 * w);
    match &mut sink.data {
        SinkData::F32(d) if add => each(d, chunk, geometry, |a, b| *a += b),
        SinkData::F32(d) => each(d, chunk, geometry, |a, b| *a = b),
        _ if add => bail!("cqsa: results can only add up in an f32 sink"),
        SinkData::F16(d) => each(d, chunk, geometry, |a, b| *a = half::f16::from_f32(b)),
        SinkData::BF16(d) => each(d, chunk, geometry, |a, b| *a = half::bf16::from_f32(b)),
    }
    Ok(())
}

/// Rates (bytes per second) of the streamed forward's three merges, measured
/// on `bytes` of f32 output, median of `reps` after a warm-up: merging a bf16
/// partial into a running f32 result on `dev` (the partial's conversion
/// included), landing results in a fresh host buffer (its pages touched for the
/// first time, as a forward's output is), and converting the host f32 output to
/// bf16.
pub(crate) fn measure_merges(dev: &Device, bytes: usize, reps: usize) -> Result<(f64, f64, f64)> {
    let (h, d) = (1usize, 128usize);
    let n = (bytes / (4 * h * d)).max(1);
    let bytes = (n * h * d * 4) as f64;
    let o1 = Tensor::randn(0f32, 1.0, (1, h, n, d), dev)?;
    let o2 = Tensor::randn(0f32, 1.0, (1, h, n, d), dev)?.to_dtype(DType::BF16)?;
    let l1 = Tensor::randn(0f32, 1.0, (1, h, n), dev)?;
    let l2 = Tensor::randn(0f32, 1.0, (1, h, n), dev)?;
    let device = crate::timing::time_median(dev, reps, || {
        merge_by_lse(&o1, &l1, &o2.to_dtype(DType::F32)?, &l2).map(|_| ())
    })?;
    let chunk: Vec<f32> = (0..n * h * d).map(|i| (i % 7) as f32).collect();
    let cpu = Device::Cpu;
    let host = crate::timing::time_median(&cpu, reps, || {
        let mut sink = Sink::new(chunk.len(), n, 0.0);
        land(&mut sink, &chunk, (h, n, d), 0, false)?;
        std::hint::black_box(&sink.data);
        Ok(())
    })?;
    // The forward's output lands converted to the inputs' dtype (bf16 here).
    let like = CpuStorage::BF16(Vec::new());
    let converted = crate::timing::time_median(&cpu, reps, || {
        let mut sink = Sink::written_as(chunk.len(), n, &like)?;
        land(&mut sink, &chunk, (h, n, d), 0, false)?;
        std::hint::black_box(&sink.data);
        Ok(())
    })?;
    Ok((bytes / device, bytes / host, bytes / converted))
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

    /// Says how long the setup before the first subproblem took (the result
    /// buffers and, on CUDA, page-locking the inputs): a cost the planner
    /// models only through the calibrated page-locking rate.
    fn set_up(&self) {
        if self.on {
            eprintln!(
                "cqsa: {} set up in {:.2} s (result buffers, inputs made ready to copy)",
                self.what,
                self.start.elapsed().as_secs_f64()
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
    /// The op of a streamed call of `q, k, v` per `plan`, computing on `exec`.
    pub(crate) fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scores: &Scores,
        plan: &Plan,
        exec: &Device,
        verbose: bool,
    ) -> Result<Self> {
        Ok(Self {
            dims: AttentionShape::of(q, k, v, scores.hi.is_some())?,
            scores: *scores,
            q_chunk: plan.q_chunk.max(1),
            kv_chunk: plan.kv_chunk.max(1),
            exec: exec.clone(),
            verbose,
            lse: Arc::new(Mutex::new(None)),
        })
    }

    fn chunks(n: usize, c: usize) -> Vec<(usize, usize)> {
        (0..n).step_by(c).map(|a| (a, (a + c).min(n))).collect()
    }

    /// The chunk pairs that see at least one key, with their bands;
    /// query-major (`by_query`) for the forward, key-major for the backward.
    fn pairs(&self, by_query: bool) -> Vec<Pair> {
        let AttentionShape { nq, nk, .. } = self.dims;
        let (qs, ks) = (
            Self::chunks(nq, self.q_chunk),
            Self::chunks(nk, self.kv_chunk),
        );
        let mut out = Vec::new();
        let (outer, inner) = if by_query { (&qs, &ks) } else { (&ks, &qs) };
        for &a in outer {
            for &b in inner {
                let (q, k) = if by_query { (a, b) } else { (b, a) };
                let band = self.scores.shifted(q.0, k.0);
                let scores = match band.coverage(q.1 - q.0, k.1 - k.0) {
                    Coverage::Nothing => continue,
                    Coverage::Everything => Scores {
                        lo: None,
                        hi: None,
                        ..band
                    },
                    Coverage::Part => band,
                };
                out.push(Pair { q, k, scores });
            }
        }
        out
    }
}

/// One subproblem: query rows `q.0..q.1` against keys `k.0..k.1`.
#[derive(Clone, Copy)]
struct Pair {
    q: (usize, usize),
    k: (usize, usize),
    /// The pair's scores: the call's band shifted to the pair, or none at all
    /// when the pair sees every key.
    scores: Scores,
}

/// Moves row chunks of host storages to the compute device, and result chunks
/// back into `N` host f32 sinks. On CUDA the input copies are issued ahead on a
/// transfer stream from page-locked memory (`prefetch`), so the next subproblem's
/// inputs travel while the current one computes, and results land one subproblem
/// late (`put`, `settle`), so their copies and the host's adds overlap the next
/// subproblem's compute; elsewhere both are plain copies made when asked for.
struct Feed<'a, const N: usize> {
    exec: Device,
    sinks: [Sink; N],
    /// Print where the host's time went at `finish` (CUDA only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    verbose: bool,
    /// Declared before `pending` and the landings: on drop it synchronizes its
    /// streams before the pending chunks' buffers are freed (the landings also
    /// wait for their own copies when dropped).
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::ChunkFeed<'a>>,
    #[cfg(feature = "cuda")]
    pending: Vec<((usize, usize, usize), crate::cuda::Fetched)>,
    /// Results put during the previous subproblem: they land at the next `settle`.
    #[cfg(feature = "cuda")]
    previous: Vec<Landing>,
    /// Results put during the current subproblem.
    #[cfg(feature = "cuda")]
    current: Vec<Landing>,
    #[cfg(not(feature = "cuda"))]
    _host: std::marker::PhantomData<&'a CpuStorage>,
}

/// A result chunk whose copy back to the host was issued: where it lands, and its
/// shape `(runs, rows, w)`.
#[cfg(feature = "cuda")]
struct Landing {
    sink: usize,
    r0: usize,
    shape: (usize, usize, usize),
    add: bool,
    data: crate::cuda::Drained,
}

/// A host storage, its layout, and a tag that names it in the prefetch cache.
type Src<'a> = (usize, &'a CpuStorage, &'a Layout);

impl<'a, const N: usize> Feed<'a, N> {
    fn new(
        exec: &Device,
        sources: &[&'a CpuStorage],
        sinks: [Sink; N],
        verbose: bool,
    ) -> Result<Self> {
        let _ = sources;
        Ok(Self {
            exec: exec.clone(),
            sinks,
            verbose,
            #[cfg(feature = "cuda")]
            cuda: match exec {
                Device::Cuda(dev) => Some(crate::cuda::ChunkFeed::new(dev, sources)?),
                _ => None,
            },
            #[cfg(feature = "cuda")]
            pending: Vec::new(),
            #[cfg(feature = "cuda")]
            previous: Vec::new(),
            #[cfg(feature = "cuda")]
            current: Vec::new(),
            #[cfg(not(feature = "cuda"))]
            _host: std::marker::PhantomData,
        })
    }

    /// Starts moving rows `r0..r1` of `src` to the device (CUDA only).
    fn prefetch(&mut self, src: Src<'a>, r0: usize, r1: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(feed) = &self.cuda {
            let key = (src.0, r0, r1);
            if !self.pending.iter().any(|(k, _)| *k == key) {
                self.pending.push((key, feed.fetch(src.1, src.2, r0, r1)?));
            }
        }
        let _ = (src, r0, r1);
        Ok(())
    }

    /// Rows `r0..r1` of `src` on the device, ready for the compute stream.
    fn get(&mut self, src: Src<'a>, r0: usize, r1: usize) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(feed) = &self.cuda {
            let key = (src.0, r0, r1);
            let fetched = match self.pending.iter().position(|(k, _)| *k == key) {
                Some(i) => self.pending.swap_remove(i).1,
                None => feed.fetch(src.1, src.2, r0, r1)?,
            };
            return fetched.ready(feed);
        }
        gather(src.1, src.2, r0, r1, &self.exec)
    }

    /// Writes (or adds, when `add`) `chunk` `(b, h, c, w)`, a result of kernels
    /// already issued, into rows `r0..r0 + c` of sink `sink`. On CUDA this only
    /// issues its copy back: it lands at the `settle` that ends the next
    /// subproblem. Elsewhere it lands now.
    fn put(&mut self, sink: usize, chunk: &Tensor, r0: usize, add: bool) -> Result<()> {
        let chunk = chunk.to_dtype(DType::F32)?;
        let (b, h, c, w) = chunk.dims4()?;
        let shape = (b * h, c, w);
        #[cfg(feature = "cuda")]
        if let Some(feed) = &mut self.cuda {
            let data = feed.drain(&chunk.contiguous()?)?;
            self.current.push(Landing {
                sink,
                r0,
                shape,
                add,
                data,
            });
            return Ok(());
        }
        let data = chunk.flatten_all()?.to_vec1::<f32>()?;
        land(&mut self.sinks[sink], &data, shape, r0, add)
    }

    /// Ends a subproblem, once its kernels and results are issued: the previous
    /// subproblem's results, copied back meanwhile, land now, while the device
    /// computes this one.
    fn settle(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let previous = std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
            self.receive(previous)?;
        }
        Ok(())
    }

    /// Waits for the copies of `landings` and applies them, in order.
    #[cfg(feature = "cuda")]
    fn receive(&mut self, landings: Vec<Landing>) -> Result<()> {
        let Some(feed) = &mut self.cuda else {
            return Ok(()); // landings are only made by a CUDA feed
        };
        for l in landings {
            let sink = &mut self.sinks[l.sink];
            feed.receive(l.data, |data| land(sink, data, l.shape, l.r0, l.add))?;
        }
        Ok(())
    }

    /// Lands the results still on their way, waits for outstanding copies,
    /// releases page-locked memory and returns the sinks' data. A chunk still
    /// pending is first waited for by the compute stream, so that freeing its
    /// buffer (stream-ordered there) cannot overtake its copy. On an early exit the
    /// same holds by drop order: the CUDA feed's `Drop` synchronizes its streams
    /// before `pending` and the landings are dropped (here too: `pending` is
    /// declared before `feed`, so it is dropped after it).
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    fn finish(mut self) -> Result<[SinkData; N]> {
        #[cfg(feature = "cuda")]
        {
            let mut last = std::mem::take(&mut self.previous);
            last.append(&mut self.current);
            self.receive(last)?;
            let mut pending = std::mem::take(&mut self.pending);
            if let Some(feed) = self.cuda.take() {
                while let Some((_, fetched)) = pending.pop() {
                    drop(fetched.ready(&feed)?);
                }
                let times = feed.finish()?;
                if self.verbose {
                    eprintln!("cqsa: host side: {times}");
                }
            }
        }
        Ok(self.sinks.map(|s| s.data))
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
        let AttentionShape { b, hq, nq, d, .. } = self.dims;
        let pairs = self.pairs(true);
        let mut progress = Progress::new(self.verbose, "forward", pairs.len());
        let (q, k, v): (Src, Src, Src) = ((0, sq, lq), (1, sk, lk), (2, sv, lv));
        // Sinks: the output and the log-sum-exp.
        const OUT: usize = 0;
        const LSE: usize = 1;
        let sinks = [
            Sink::written_as(b * hq * nq * d, nq, sq)?,
            Sink::new(b * hq * nq, nq, f32::NEG_INFINITY),
        ];
        let mut feed = Feed::new(&self.exec, &[sq, sk, sv], sinks, self.verbose)?;
        progress.set_up();
        let mut qc: Option<((usize, usize), Tensor)> = None;
        let mut acc: Option<(Tensor, Tensor)> = None;
        for (p, pair) in pairs.iter().enumerate() {
            let next = pairs.get(p + 1);
            // Issue the next subproblem's copies before this one's kernels.
            if let Some(n) = next {
                if n.q != pair.q {
                    feed.prefetch(q, n.q.0, n.q.1)?;
                }
                feed.prefetch(k, n.k.0, n.k.1)?;
                feed.prefetch(v, n.k.0, n.k.1)?;
            }
            let qt = match qc.take() {
                Some((r, t)) if r == pair.q => t,
                _ => feed.get(q, pair.q.0, pair.q.1)?,
            };
            let kc = feed.get(k, pair.k.0, pair.k.1)?;
            let vc = feed.get(v, pair.k.0, pair.k.1)?;
            let (o, l) = attention_forward_with(&qt, &kc, &vc, &pair.scores)?;
            let o = o.to_dtype(DType::F32)?;
            acc = Some(match acc.take() {
                None => (o, l),
                Some((ao, al)) => merge_by_lse(&ao, &al, &o, &l)?,
            });
            qc = Some((pair.q, qt));
            progress.tick();
            // Last key chunk of this query chunk: write its merged rows to the host.
            if next.is_none_or(|n| n.q != pair.q) {
                if let Some((o, l)) = acc.take() {
                    feed.put(OUT, &o, pair.q.0, false)?;
                    feed.put(LSE, &l.unsqueeze(3)?, pair.q.0, false)?;
                }
            }
            feed.settle()?;
        }
        let [out, lse_all] = feed.finish()?;
        let mut lse_all = lse_all.into_f32()?;
        progress.finish();
        // A row that saw no key keeps merge's finite floor: make it -inf again.
        for l in &mut lse_all {
            if *l < -1e29 {
                *l = f32::NEG_INFINITY;
            }
        }
        *self.lse.lock().map_err(poisoned)? = Some(lse_all);
        Ok((out.into_storage(), lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = self.backward_host(q, k, v, o, grad_o)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl StreamOp {
    /// The gradients of host inputs `q, k, v` (output `o`) for `grad_o`, as host
    /// tensors in the inputs' dtype.
    fn backward_host(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(lse) = self.lse.lock().map_err(poisoned)?.clone() else {
            bail!("cqsa: streamed backward called before its forward")
        };
        let AttentionShape { b, hq, nq, .. } = self.dims;
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
        let srcs: [Src; 6] = [
            (0, sq, lq),
            (1, sk, lk),
            (2, sv, lv),
            (3, so, lo),
            (4, sg, lg),
            (5, sl, ll),
        ];
        let [dq, dk, dv] = self.backward_pairs(srcs)?;
        let wrap = |x: CpuStorage, shape: &Shape| -> Tensor {
            Tensor::from_storage(Storage::Cpu(x), shape, BackpropOp::none(), false)
        };
        Ok((
            wrap(cpu::from_f32(dq.into_f32()?, sq)?, q.shape()),
            wrap(dk.into_storage(), k.shape()),
            wrap(dv.into_storage(), v.shape()),
        ))
    }

    /// The backward's loop over key-major chunk pairs: `srcs` are the host q, k,
    /// v, o, grad_o and lse; returns the host dq (f32: it sums over key chunks)
    /// and dk, dv (in the inputs' dtype: each is written once, complete).
    fn backward_pairs(&self, srcs: [Src<'_>; 6]) -> Result<[SinkData; 3]> {
        let AttentionShape {
            b,
            hq,
            hkv,
            nq,
            nk,
            d,
            ..
        } = self.dims;
        let pairs = self.pairs(false);
        let mut progress = Progress::new(self.verbose, "backward", pairs.len());
        let [qs, ks, vs, os, gs, ls] = srcs;
        // Sinks: the gradients.
        const DQ: usize = 0;
        const DK: usize = 1;
        const DV: usize = 2;
        let like = qs.1;
        let sinks = [
            Sink::new(b * hq * nq * d, nq, 0.0),
            Sink::written_as(b * hkv * nk * d, nk, like)?,
            Sink::written_as(b * hkv * nk * d, nk, like)?,
        ];
        let mut feed = Feed::new(&self.exec, &srcs.map(|s| s.1), sinks, self.verbose)?;
        progress.set_up();
        let mut kvc: Option<((usize, usize), Tensor, Tensor)> = None;
        let mut acc: Option<(Tensor, Tensor)> = None;
        for (p, pair) in pairs.iter().enumerate() {
            let next = pairs.get(p + 1);
            if let Some(n) = next {
                if n.k != pair.k {
                    feed.prefetch(ks, n.k.0, n.k.1)?;
                    feed.prefetch(vs, n.k.0, n.k.1)?;
                }
                for src in [qs, os, gs, ls] {
                    feed.prefetch(src, n.q.0, n.q.1)?;
                }
            }
            let (kc, vc) = match kvc.take() {
                Some((r, kc, vc)) if r == pair.k => (kc, vc),
                _ => (
                    feed.get(ks, pair.k.0, pair.k.1)?,
                    feed.get(vs, pair.k.0, pair.k.1)?,
                ),
            };
            let (i0, i1) = pair.q;
            let qc = feed.get(qs, i0, i1)?;
            let oc = feed.get(os, i0, i1)?;
            let gc = feed.get(gs, i0, i1)?;
            let lc = feed.get(ls, i0, i1)?.squeeze(3)?;
            let (dqc, dkc, dvc) =
                attention_backward_with(&qc, &kc, &vc, &oc, &gc, &lc, &pair.scores)?;
            let (dkc, dvc) = (dkc.to_dtype(DType::F32)?, dvc.to_dtype(DType::F32)?);
            acc = Some(match acc.take() {
                None => (dkc, dvc),
                Some((ak, av)) => ((ak + dkc)?, (av + dvc)?),
            });
            kvc = Some((pair.k, kc, vc));
            feed.put(DQ, &dqc, i0, true)?;
            progress.tick();
            // Last query chunk of this key chunk: its dk, dv are complete.
            if next.is_none_or(|n| n.k != pair.k) {
                if let Some((ak, av)) = acc.take() {
                    feed.put(DK, &ak, pair.k.0, false)?;
                    feed.put(DV, &av, pair.k.0, false)?;
                }
            }
            feed.settle()?;
        }
        let [dq, dk, dv] = feed.finish()?;
        progress.finish();
        Ok([dq, dk, dv])
    }
}
