//! Sequence-parallel exact attention ("ring attention") over a [`Collective`].
//!
//! The sequence of `N` positions is split across `W` ranks. Under
//! [`SeqSplit::ZigZag`] it is cut into `2W` chunks of `N / 2W` rows and rank `r`
//! holds chunks `r` and `2W - 1 - r` (one early, one late), so under a causal
//! mask every rank has the same work; [`SeqSplit::Contiguous`] gives rank `r`
//! rows `r N / W .. (r + 1) N / W`. Each rank keeps its queries; the key/value
//! blocks travel around the ring (`W - 1` shifts). Every (query chunk, key
//! chunk) pair that can see anything runs as one resident cqsa call
//! ([`cqsa::attention_forward_with`]) with its causal band shifted to the
//! chunks' global positions, and the partial outputs are merged by their
//! log-sum-exp in f32. The backward recomputes the same pairs with the final
//! output and log-sum-exp ([`cqsa::attention_backward_with`], which gives
//! exact partial gradients from them); dq accumulates locally, and dk/dv
//! accumulators travel with their key/value blocks and take one more step home.
//!
//! Exactness: the same sums as single-rank cqsa in another order; f32 results
//! agree to rounding (the tests check 1e-5 relative).
//!
//! Communication is not overlapped with compute in this version: each ring
//! step's shift runs after that step's attention calls.
use std::sync::{Arc, Mutex};

use candle_core::{bail, DType, Result, Tensor};
use cqsa::Scores;

use crate::Collective;

/// How a sequence is split across ranks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SeqSplit {
    /// `2W` chunks, rank `r` holds chunks `r` and `2W - 1 - r`: balanced under
    /// a causal mask. The sequence length must be divisible by `2W`.
    #[default]
    ZigZag,
    /// Rank `r` holds the `r`-th of `W` equal runs. Length divisible by `W`.
    Contiguous,
}

impl SeqSplit {
    /// The global row ranges `(start, len)` of the chunks rank `rank` holds, in
    /// local order, for a sequence of `n` rows over `world` ranks.
    pub fn chunks(self, n: usize, rank: usize, world: usize) -> Result<Vec<(usize, usize)>> {
        crate::collective::check_rank(rank, world)?;
        let parts = match self {
            Self::ZigZag => 2 * world,
            Self::Contiguous => world,
        };
        if n % parts != 0 || n == 0 {
            bail!(
                "streamer-dist: a sequence of {n} rows does not split into {parts} equal non-empty \
                 chunks ({self:?} over {world} ranks); pad it to a multiple of {parts}"
            )
        }
        let c = n / parts;
        Ok(match self {
            Self::ZigZag => vec![(rank * c, c), ((parts - 1 - rank) * c, c)],
            Self::Contiguous => vec![(rank * c, c)],
        })
    }

    /// This rank's part of `x` along `dim` (the global sequence axis).
    pub fn shard(self, x: &Tensor, dim: usize, rank: usize, world: usize) -> Result<Tensor> {
        let n = x.dim(dim)?;
        let parts = self
            .chunks(n, rank, world)?
            .into_iter()
            .map(|(s, l)| x.narrow(dim, s, l))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, dim)
    }

    /// The global tensor from every rank's part (`parts[r]` from rank `r`), the
    /// inverse of [`SeqSplit::shard`].
    pub fn unshard(self, parts: &[Tensor], dim: usize) -> Result<Tensor> {
        let world = parts.len();
        let Some(first) = parts.first() else {
            bail!("streamer-dist: unshard needs at least one part")
        };
        let n = first.dim(dim)? * world;
        let mut pieces = Vec::new();
        for (rank, p) in parts.iter().enumerate() {
            let mut off = 0;
            for (start, len) in self.chunks(n, rank, world)? {
                pieces.push((start, p.narrow(dim, off, len)?));
                off += len;
            }
        }
        pieces.sort_by_key(|(s, _)| *s);
        let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
        Tensor::cat(&pieces, dim)
    }
}

/// Options of [`ring_attention`].
#[derive(Debug, Clone, Default)]
pub struct RingOpts {
    /// Causal mask over the global positions.
    pub causal: bool,
    /// Multiplier of `q k^T`; `None`: `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Logit soft-capping, as [`cqsa::AttentionOpts::softcap`].
    pub softcap: Option<f32>,
    /// How the sequence is split across ranks (the same on every rank).
    pub split: SeqSplit,
}

/// The pairs one ring step computes: (query chunk, key chunk, their scores).
fn pairs(
    opts: &RingOpts,
    scale: f32,
    q_chunks: &[(usize, usize)],
    k_chunks: &[(usize, usize)],
) -> Vec<(usize, usize, Scores)> {
    let mut out = Vec::new();
    for (a, &(qs, ql)) in q_chunks.iter().enumerate() {
        for (b, &(ks, kl)) in k_chunks.iter().enumerate() {
            let mut s = Scores {
                scale,
                lo: None,
                hi: None,
                softcap: opts.softcap,
            };
            if opts.causal {
                // Global key ks + j is visible from query qs + i iff
                // ks + j <= qs + i, i.e. j <= i + (qs - ks).
                let hi = qs as i64 - ks as i64;
                if hi + ql as i64 - 1 < 0 {
                    continue; // no query of the chunk sees any key of it
                }
                if hi < kl as i64 - 1 {
                    s.hi = Some(hi); // only part of the pair is visible
                }
            }
            out.push((a, b, s));
        }
    }
    out
}

/// What the forward and backward check and derive from `(q, k, v)`.
struct Plan {
    rank: usize,
    world: usize,
    scale: f32,
    /// This rank's query chunks: global `(start, len)` and local offset.
    q_chunks: Vec<(usize, usize)>,
}

impl Plan {
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        coll: &dyn Collective,
        opts: &RingOpts,
    ) -> Result<Self> {
        let (rank, world) = (coll.rank(), coll.world_size());
        let op = "ring_attention";
        let shape = cqsa::AttentionShape::of(q, k, v, opts.causal)
            .map_err(|e| crate::collective::err(rank, op, e))?;
        if shape.nq != shape.nk {
            return Err(crate::collective::err(
                rank,
                op,
                format!(
                    "q and k/v must hold the same positions on every rank, got {} query rows and {} key rows",
                    shape.nq, shape.nk
                ),
            ));
        }
        if !q.device().same_device(coll.device()) {
            return Err(crate::collective::err(
                rank,
                op,
                format!(
                    "q is on {:?} but this rank computes on {:?}",
                    q.device().location(),
                    coll.device().location()
                ),
            ));
        }
        let n = shape.nq * world;
        let q_chunks = opts.split.chunks(n, rank, world)?;
        let scale = opts.scale.unwrap_or(1.0 / (shape.d as f64).sqrt()) as f32;
        Ok(Self {
            rank,
            world,
            scale,
            q_chunks,
        })
    }

    /// The chunks the key/value block held at ring step `step` came from.
    fn k_chunks(&self, opts: &RingOpts, step: usize) -> Result<Vec<(usize, usize)>> {
        let src = (self.rank + self.world - step % self.world) % self.world;
        let n = self.q_chunks.iter().map(|c| c.1).sum::<usize>() * self.world;
        opts.split.chunks(n, src, self.world)
    }
}

/// Local row offsets of chunks of the given lengths.
fn offsets(chunks: &[(usize, usize)]) -> Vec<usize> {
    chunks
        .iter()
        .scan(0, |off, c| {
            let o = *off;
            *off += c.1;
            Some(o)
        })
        .collect()
}

/// Ring forward without autograd: this rank's output `(batch, heads_q,
/// local_seq, head_dim)` in the inputs' dtype and its log-sum-exp `(batch,
/// heads_q, local_seq)` in f32, for local shards `q`, `k`, `v` (laid out by
/// `opts.split`; see [`SeqSplit::shard`]). Every rank must call it together.
pub fn ring_attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    coll: &dyn Collective,
    opts: &RingOpts,
) -> Result<(Tensor, Tensor)> {
    let plan = Plan::new(q, k, v, coll, opts)?;
    let (q, mut k, mut v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let qo = offsets(&plan.q_chunks);
    let (b, h, n, d) = q.dims4()?;
    let mut acc: Vec<(Tensor, Tensor)> = plan
        .q_chunks
        .iter()
        .map(|&(_, l)| -> Result<(Tensor, Tensor)> {
            let o = Tensor::zeros((b, h, l, d), DType::F32, q.device())?;
            let lse = Tensor::full(f32::NEG_INFINITY, (b, h, l), q.device())?;
            Ok((o, lse))
        })
        .collect::<Result<_>>()?;
    for step in 0..plan.world {
        let k_chunks = plan.k_chunks(opts, step)?;
        let ko = offsets(&k_chunks);
        for (a, c, scores) in pairs(opts, plan.scale, &plan.q_chunks, &k_chunks) {
            let qa = q.narrow(2, qo[a], plan.q_chunks[a].1)?;
            let kc = k.narrow(2, ko[c], k_chunks[c].1)?;
            let vc = v.narrow(2, ko[c], k_chunks[c].1)?;
            let (o, lse) =
                cqsa::attention_forward_with(&qa, &kc.contiguous()?, &vc.contiguous()?, &scores)?;
            acc[a] = cqsa::merge_by_lse(&acc[a].0, &acc[a].1, &o.to_dtype(DType::F32)?, &lse)?;
        }
        if step + 1 < plan.world {
            let kv = coll.ring_shift(&Tensor::stack(&[&k, &v], 0)?)?;
            (k, v) = (kv.get(0)?.contiguous()?, kv.get(1)?.contiguous()?);
        }
    }
    let o = Tensor::cat(&acc.iter().map(|x| &x.0).collect::<Vec<_>>(), 2)?;
    let lse = Tensor::cat(&acc.iter().map(|x| &x.1).collect::<Vec<_>>(), 2)?;
    debug_assert_eq!(o.dim(2)?, n);
    Ok((o.to_dtype(q.dtype())?, lse))
}

/// Ring backward without autograd: `(dq, dk, dv)` of this rank's shards, shaped
/// and typed like `(q, k, v)`, from the forward's inputs, this rank's output
/// `o`, its gradient `grad_o` and log-sum-exp `lse` (from
/// [`ring_attention_forward`]). Every rank must call it together.
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    grad_o: &Tensor,
    lse: &Tensor,
    coll: &dyn Collective,
    opts: &RingOpts,
) -> Result<(Tensor, Tensor, Tensor)> {
    let plan = Plan::new(q, k, v, coll, opts)?;
    let (q, mut k, mut v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (o, g) = (
        o.to_dtype(q.dtype())?.contiguous()?,
        grad_o.to_dtype(q.dtype())?.contiguous()?,
    );
    let qo = offsets(&plan.q_chunks);
    let dev = q.device();
    let f32_zeros = |t: &Tensor, len: usize| -> Result<Tensor> {
        let (b, h, _, d) = t.dims4()?;
        Tensor::zeros((b, h, len, d), DType::F32, dev)
    };
    let mut dq: Vec<Tensor> = plan
        .q_chunks
        .iter()
        .map(|c| f32_zeros(&q, c.1))
        .collect::<Result<_>>()?;
    // dk and dv of the block held now, travelling with it: stacked, f32.
    let mut dkv = Tensor::stack(&[f32_zeros(&k, k.dim(2)?)?, f32_zeros(&k, k.dim(2)?)?], 0)?;
    for step in 0..plan.world {
        let k_chunks = plan.k_chunks(opts, step)?;
        let ko = offsets(&k_chunks);
        let mut dk: Vec<Tensor> = Vec::new();
        let mut dv: Vec<Tensor> = Vec::new();
        for (c, &(_, len)) in k_chunks.iter().enumerate() {
            dk.push(dkv.get(0)?.narrow(2, ko[c], len)?);
            dv.push(dkv.get(1)?.narrow(2, ko[c], len)?);
        }
        for (a, c, scores) in pairs(opts, plan.scale, &plan.q_chunks, &k_chunks) {
            let (qa, qn) = (qo[a], plan.q_chunks[a].1);
            let (kc, kn) = (ko[c], k_chunks[c].1);
            let rows = |t: &Tensor, off, len| t.narrow(2, off, len)?.contiguous();
            let (dqa, dkc, dvc) = cqsa::attention_backward_with(
                &rows(&q, qa, qn)?,
                &rows(&k, kc, kn)?,
                &rows(&v, kc, kn)?,
                &rows(&o, qa, qn)?,
                &rows(&g, qa, qn)?,
                &lse.narrow(2, qa, qn)?.contiguous()?,
                &scores,
            )?;
            dq[a] = (&dq[a] + dqa.to_dtype(DType::F32)?)?;
            dk[c] = (&dk[c] + dkc.to_dtype(DType::F32)?)?;
            dv[c] = (&dv[c] + dvc.to_dtype(DType::F32)?)?;
        }
        // The accumulators move one rank on every step, and once more at the
        // end, which brings each home to the rank whose block it belongs to.
        let here = Tensor::stack(&[Tensor::cat(&dk, 2)?, Tensor::cat(&dv, 2)?], 0)?;
        dkv = coll.ring_shift(&here)?;
        if step + 1 < plan.world {
            let kv = coll.ring_shift(&Tensor::stack(&[&k, &v], 0)?)?;
            (k, v) = (kv.get(0)?.contiguous()?, kv.get(1)?.contiguous()?);
        }
    }
    let dt = q.dtype();
    Ok((
        Tensor::cat(&dq, 2)?.to_dtype(dt)?,
        dkv.get(0)?.to_dtype(dt)?,
        dkv.get(1)?.to_dtype(dt)?,
    ))
}

/// Exact sequence-parallel attention, differentiable: this rank's output
/// `(batch, heads_q, local_seq, head_dim)` for its shards `q` `(batch,
/// heads_q, local_seq, head_dim)` and `k`, `v` `(batch, heads_kv, local_seq,
/// head_dim)`, split by `opts.split` (see [`SeqSplit::shard`]), computed on
/// `coll.device()`. Equals the matching rows of single-rank causal or full
/// cqsa attention over the whole sequence. Every rank calls it together, and
/// every rank must run backward through it exactly once (the ring backward is
/// collective too). Errors before any work on bad shapes, dtypes, a device
/// other than the collective's, or a local length that does not split.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    coll: Arc<dyn Collective>,
    opts: &RingOpts,
) -> Result<Tensor> {
    let (out, lse) = ring_attention_forward(q, k, v, coll.as_ref(), opts)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    // The forward ran first (it needs the collective and whole tensors); the
    // graph node hands its output to Candle and runs the ring backward once.
    let saved = [q.detach(), k.detach(), v.detach(), out.clone()];
    let (opts, done) = (opts.clone(), Mutex::new(false));
    streamer_core::with_backward3("ring attention", &q, &k, &v, out, move |grad_o| {
        let mut done = done.lock().unwrap_or_else(|p| p.into_inner());
        if *done {
            // A second backward would need every rank to repeat it too.
            bail!(
                "ring attention: backward ran twice through one call on rank {}; every rank must \
                 backpropagate each call exactly once",
                coll.rank()
            )
        }
        *done = true;
        let [q, k, v, o] = &saved;
        let (dq, dk, dv) = ring_attention_backward(q, k, v, o, grad_o, &lse, coll.as_ref(), &opts)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    })
}
