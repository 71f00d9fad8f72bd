//! Merging two partial attention results over disjoint key sets: what the
//! out-of-core forward does between key chunks and ring attention between
//! ranks.
use candle_core::{Result, Tensor};

/// Merges two normalised partial results `(o1, l1)` and `(o2, l2)` by their
/// log-sum-exp: `lse = log(e^l1 + e^l2)`, `o = o1 e^(l1 - lse) + o2 e^(l2 -
/// lse)`. f32 tensors, `o` `(batch, heads, rows, head_dim)` and `l` `(batch,
/// heads, rows)`; a row whose `l` is `-inf` saw no key and weighs nothing.
pub fn merge_by_lse(
    o1: &Tensor,
    l1: &Tensor,
    o2: &Tensor,
    l2: &Tensor,
) -> Result<(Tensor, Tensor)> {
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
    Ok((o, (m + tot.log()?)?))
}
