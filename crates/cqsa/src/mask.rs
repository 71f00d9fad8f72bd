//! How scores are formed and masked: [`Scores`] (scale, a band of visible keys,
//! logit soft-capping), resolved from [`AttentionOpts`] by [`Scores::of`].
//!
//! Every path (CPU, CUDA, streamed chunks) takes the same `Scores`: key `j` is
//! visible from query `i` iff `i + lo <= j <= i + hi` (a missing bound is no
//! bound), and a visible score is `s = scale * q_i . k_j`, then
//! `softcap * tanh(s / softcap)` when soft-capping is on. A streamed chunk pair
//! uses the same band shifted by its chunk origins ([`Scores::shifted`]).
use candle_core::{bail, Result};

use crate::{resolve_scale, AttentionOpts, AttentionShape};

/// How one kernel call forms and masks its scores (see the module docs).
///
/// `Scores { scale, lo: None, hi: Some(off), softcap: None }` is the causal mask
/// with offset `off` of [`crate::attention_forward`]; the whole causal call of
/// [`crate::attention`] uses `off = seq_k - seq_q`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    /// Multiplier of `q k^T`.
    pub scale: f32,
    /// Key `j` is visible from query `i` only if `j >= i + lo` (`None`: no bound).
    pub lo: Option<i64>,
    /// Key `j` is visible from query `i` only if `j <= i + hi` (`None`: no bound).
    pub hi: Option<i64>,
    /// Soft-capping `s -> softcap * tanh(s / softcap)` of the scaled scores;
    /// positive and finite when set.
    pub softcap: Option<f32>,
}

/// Where a chunk pair stands against a band.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Coverage {
    /// No (query, key) pair of the chunk is visible.
    Nothing,
    /// Every pair is visible: the chunk runs without a mask.
    Everything,
    /// Some pairs are visible.
    Part,
}

impl Scores {
    /// Unmasked scores with `scale`, for tests and callers of the low-level ops.
    pub fn dense(scale: f32) -> Self {
        Self {
            scale,
            lo: None,
            hi: None,
            softcap: None,
        }
    }

    /// The scores of the call `shape` with options `opts`, checked: the window
    /// fields and `softcap` against their rules (errors name the field and its
    /// value). With `off = seq_k - seq_q` (bottom-right alignment): `lo = off -
    /// window_left`, `hi = off + window_right`, and `hi = off` when causal.
    pub fn of(opts: &AttentionOpts, shape: &AttentionShape) -> Result<Self> {
        if opts.causal && opts.window_right.is_some_and(|w| w != 0) {
            bail!(
                "cqsa: window_right = {:?} contradicts causal = true (causal means window_right = 0; \
                 leave window_right None or Some(0))",
                opts.window_right
            )
        }
        if let Some(s) = opts.scale {
            if !s.is_finite() {
                bail!("cqsa: scale must be finite, got {s}")
            }
        }
        let off = shape.nk as i64 - shape.nq as i64;
        // A window of nq + nk or more hides nothing: clamp so that the i64
        // arithmetic cannot overflow.
        let reach = (shape.nq + shape.nk) as i64;
        let w = |x: usize| (x as u64).min(reach as u64) as i64;
        let lo = opts.window_left.map(|x| off - w(x));
        let hi = if opts.causal {
            Some(off)
        } else {
            opts.window_right.map(|x| off + w(x))
        };
        let scores = Self {
            scale: resolve_scale(opts.scale, shape.d),
            lo,
            hi,
            softcap: opts.softcap,
        };
        scores.check()?;
        Ok(scores)
    }

    /// Checks `softcap` (positive and finite) and `scale` (finite).
    pub fn check(&self) -> Result<()> {
        if let Some(c) = self.softcap {
            if !(c > 0.0 && c.is_finite()) {
                bail!("cqsa: softcap must be a positive finite number, got softcap = {c}")
            }
        }
        if !self.scale.is_finite() {
            bail!("cqsa: scale must be finite, got {}", self.scale)
        }
        Ok(())
    }

    /// These scores without a band: the scale and soft-cap of a packed call,
    /// whose documents carry their own bands.
    pub(crate) fn unbanded(&self) -> Self {
        Self {
            lo: None,
            hi: None,
            ..*self
        }
    }

    /// Whether any key is hidden from some query by the band (before clipping to
    /// the sequence lengths).
    pub fn masked(&self) -> bool {
        self.lo.is_some() || self.hi.is_some()
    }

    /// The band of a sub-block whose query rows start at `i0` and keys at `j0`
    /// (row `r`, key `c` of the block are query `i0 + r`, key `j0 + c`).
    pub(crate) fn shifted(&self, i0: usize, j0: usize) -> Self {
        let d = i0 as i64 - j0 as i64;
        Self {
            lo: self.lo.map(|x| x + d),
            hi: self.hi.map(|x| x + d),
            ..*self
        }
    }

    /// Keys `j0..j1` visible from query `i` among `nk` keys (`j0 == j1`: none).
    #[inline]
    pub(crate) fn keys(&self, i: usize, nk: usize) -> (usize, usize) {
        let n = nk as i64;
        let j0 = self.lo.map_or(0, |lo| (i as i64 + lo).clamp(0, n));
        let j1 = self.hi.map_or(n, |hi| (i as i64 + hi + 1).clamp(0, n));
        (j0 as usize, j1.max(j0) as usize)
    }

    /// Queries `i0..i1` that see key `j` among `nq` queries (`i0 == i1`: none).
    #[inline]
    pub(crate) fn rows(&self, j: usize, nq: usize) -> (usize, usize) {
        let n = nq as i64;
        let i0 = self.hi.map_or(0, |hi| (j as i64 - hi).clamp(0, n));
        let i1 = self.lo.map_or(n, |lo| (j as i64 - lo + 1).clamp(0, n));
        (i0 as usize, i1.max(i0) as usize)
    }

    /// How the block of `nq` queries and `nk` keys stands against the band.
    pub(crate) fn coverage(&self, nq: usize, nk: usize) -> Coverage {
        let (rows, cols) = (nq as i64, nk as i64);
        // Some row r in 0..rows sees some key iff r + hi >= 0 for the last row
        // and r + lo <= cols - 1 for the first (lo <= hi: the band is never empty
        // between its bounds; with lo > hi nothing is visible).
        let lo = self.lo.unwrap_or(i64::MIN / 4);
        let hi = self.hi.unwrap_or(i64::MAX / 4);
        if lo > hi || rows - 1 + hi < 0 || lo > cols - 1 {
            Coverage::Nothing
        } else if rows - 1 + lo <= 0 && hi >= cols - 1 {
            Coverage::Everything
        } else {
            Coverage::Part
        }
    }

    /// Number of visible (query, key) pairs of a block of `nq` queries and `nk`
    /// keys: the work of a masked call (its FLOPs are `4 d` per pair and head).
    pub fn visible_pairs(&self, nq: usize, nk: usize) -> u64 {
        (0..nq)
            .map(|i| {
                let (a, b) = self.keys(i, nk);
                (b - a) as u64
            })
            .sum()
    }

    /// The scaled, soft-capped score of a raw dot product `x = q . k`, and the
    /// factor `d s / d (scale x)` (`1 - tanh^2`, or 1 without soft-capping).
    #[inline]
    pub(crate) fn score(&self, x: f32) -> (f32, f32) {
        let s = x * self.scale;
        match self.softcap {
            None => (s, 1.0),
            Some(c) => {
                let t = (s / c).tanh();
                (c * t, 1.0 - t * t)
            }
        }
    }
}
