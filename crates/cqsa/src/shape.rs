//! The one shape type of the crate, [`AttentionShape`], and its one validator.
//!
//! Every entry point ([`crate::attention`], [`crate::attention_forward`],
//! [`crate::attention_backward`], [`crate::estimate`]) and every path below them
//! (CPU, CUDA, streamed) describes a call by an `AttentionShape`. It is built from
//! tensors by [`AttentionShape::of`] (ranks, dtypes, devices, then sizes) or
//! written by hand for the planner, and in both cases checked by
//! [`AttentionShape::check`] before anything is allocated or launched. Errors name
//! the tensor, its shape and dtype, and the rule that failed.
use candle_core::{bail, DType, Result, Tensor};
use streamer_device::Error;

use crate::MAX_HEAD_DIM;

/// The sizes of one attention call: `q` is `(b, hq, nq, d)`, `k` and `v` are
/// `(b, hkv, nk, d)`, all of dtype `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads (divides `hq`).
    pub hkv: usize,
    /// Query sequence length.
    pub nq: usize,
    /// Key/value sequence length.
    pub nk: usize,
    /// Head dimension.
    pub d: usize,
    /// Element type of q, k, v.
    pub dtype: DType,
    /// Causal mask. The planner's cost model reads it; the kernels take their
    /// mask from [`crate::Scores`].
    pub causal: bool,
}

/// `name` with its shape and dtype, for error messages: `q (shape [1, 2, 8, 16], F32)`.
pub(crate) fn describe(name: &str, t: &Tensor) -> String {
    format!("{name} (shape {:?}, {:?})", t.dims(), t.dtype())
}

fn supported(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

impl AttentionShape {
    /// The shape of the call `(q, k, v)`, validated: ranks 4, one supported dtype
    /// (f32, f16, bf16), one device, matching batch and head dim, `k` and `v` of
    /// one shape, then [`AttentionShape::check`]. `causal` is recorded for the
    /// planner.
    pub fn of(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Self> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 4 {
                return Err(Error::Shape {
                    what: format!("cqsa: {name} ({:?})", t.dtype()),
                    got: t.dims().to_vec(),
                    expected: "rank 4 (batch, heads, seq, head_dim)".into(),
                }
                .into());
            }
            if !supported(t.dtype()) {
                return Err(Error::Dtype {
                    what: format!("cqsa: {name} (shape {:?})", t.dims()),
                    got: t.dtype(),
                    expected: "f32, f16 or bf16".into(),
                }
                .into());
            }
        }
        if let Some((name, t)) = [("k", k), ("v", v)]
            .into_iter()
            .find(|(_, t)| t.dtype() != q.dtype())
        {
            return Err(Error::Dtype {
                what: format!("cqsa: {name} (shape {:?})", t.dims()),
                got: t.dtype(),
                expected: format!("{:?}, q's (q, k, v must share one dtype)", q.dtype()),
            }
            .into());
        }
        if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
            bail!(
                "cqsa: q, k, v must be on one device, got {:?}, {:?}, {:?}",
                q.device().location(),
                k.device().location(),
                v.device().location()
            )
        }
        let (b, hq, nq, d) = q.dims4()?;
        let (bk, hkv, nk, dk) = k.dims4()?;
        if k.dims() != v.dims() {
            return Err(Error::Shape {
                what: "cqsa: v".into(),
                got: v.dims().to_vec(),
                expected: format!("{:?}, k's shape (k and v must have one shape)", k.dims()),
            }
            .into());
        }
        if b != bk {
            bail!(
                "cqsa: batch of {} ({b}) differs from batch of {} ({bk})",
                describe("q", q),
                describe("k", k)
            )
        }
        if d != dk {
            bail!(
                "cqsa: head_dim of {} ({d}) differs from head_dim of {} ({dk})",
                describe("q", q),
                describe("k", k)
            )
        }
        let shape = Self {
            b,
            hq,
            hkv,
            nq,
            nk,
            d,
            dtype: q.dtype(),
            causal,
        };
        shape.check()?;
        Ok(shape)
    }

    /// Checks the sizes and dtype: head dim in `1..=MAX_HEAD_DIM`, `hq` a
    /// positive multiple of `hkv`, no empty dimension, dtype f32, f16 or bf16.
    pub fn check(&self) -> Result<()> {
        let s = self;
        if s.d == 0 || s.d > MAX_HEAD_DIM {
            bail!(
                "cqsa: head_dim must be in 1..={MAX_HEAD_DIM}, got {} ({s})",
                s.d
            )
        }
        if s.hkv == 0 || s.hq == 0 || s.hq % s.hkv != 0 {
            bail!(
                "cqsa: heads_q ({}) must be a positive multiple of heads_kv ({}) ({s})",
                s.hq,
                s.hkv
            )
        }
        if s.b == 0 || s.nq == 0 || s.nk == 0 {
            bail!(
                "cqsa: empty input: batch {}, seq_q {}, seq_k {} ({s})",
                s.b,
                s.nq,
                s.nk
            )
        }
        if !supported(s.dtype) {
            bail!(
                "cqsa: dtype {:?}, supported are f32, f16 and bf16 ({s})",
                s.dtype
            )
        }
        Ok(())
    }

    /// The shape `(b, hq, nq)` of the log-sum-exp of a call.
    pub(crate) fn lse_dims(&self) -> [usize; 3] {
        [self.b, self.hq, self.nq]
    }

    /// Forward FLOPs by the usual convention: `4 b hq nq nk d`, halved when causal.
    pub fn forward_flops(&self) -> f64 {
        let f = 4.0 * (self.b * self.hq) as f64 * self.nq as f64 * self.nk as f64 * self.d as f64;
        if self.causal {
            f / 2.0
        } else {
            f
        }
    }
}

impl std::fmt::Display for AttentionShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "q [{}, {}, {}, {}], k/v [{}, {}, {}, {}], {:?}{}",
            self.b,
            self.hq,
            self.nq,
            self.d,
            self.b,
            self.hkv,
            self.nk,
            self.d,
            self.dtype,
            if self.causal { ", causal" } else { "" }
        )
    }
}
