//! Variable-length packed sequences (`cu_seqlens_q`, `cu_seqlens_k` as in
//! flash-attn's `flash_attn_varlen`): several documents along the sequence axis,
//! no attention across documents, no compute on padding.
//!
//! Document `i` holds query rows `cu_seqlens_q[i]..cu_seqlens_q[i + 1]` and keys
//! `cu_seqlens_k[i]..cu_seqlens_k[i + 1]` of every (batch, head) row. Each
//! document is its own attention call (forward and backward through Candle's
//! autograd of `narrow` and `cat`), with the call's masks applied inside the
//! document and aligned bottom-right to it, as flash-attn does. A document with
//! no keys gives output 0 (its rows see nothing); an empty one nothing. The cost
//! is one call per document: right for documents of hundreds of tokens or
//! more; thousands of tiny documents pay a launch each (a fused varlen kernel is
//! not written yet).
use candle_core::{bail, Result, Tensor};

use crate::AttentionOpts;

/// One document: its query rows `q0..q1` and keys `k0..k1`.
pub(crate) type Document = ((usize, usize), (usize, usize));

/// Checks one `cu_seqlens` array against the sequence length `n`: starts at 0,
/// never decreases (equal neighbours are an empty document), ends at `n`.
fn check(name: &str, cu: &[usize], n: usize) -> Result<()> {
    if cu.len() < 2 {
        bail!("cqsa: {name} must hold at least 2 offsets (one document), got {cu:?}")
    }
    if cu[0] != 0 {
        bail!("cqsa: {name} must start at 0, got {name}[0] = {}", cu[0])
    }
    if let Some(i) = (1..cu.len()).find(|&i| cu[i] < cu[i - 1]) {
        bail!(
            "cqsa: {name} must not decrease, got {name}[{}] = {} > {name}[{i}] = {}",
            i - 1,
            cu[i - 1],
            cu[i]
        )
    }
    let last = cu[cu.len() - 1];
    if last != n {
        bail!("cqsa: {name} must end at the sequence length {n}, got {last}")
    }
    Ok(())
}

/// The documents of a varlen call: `(q rows, keys)` ranges, checked against the
/// sequence lengths `nq`, `nk`. `None` when `opts` asks for no varlen.
pub(crate) fn documents(
    opts: &AttentionOpts,
    nq: usize,
    nk: usize,
) -> Result<Option<Vec<Document>>> {
    let (cq, ck) = match (&opts.cu_seqlens_q, &opts.cu_seqlens_k) {
        (None, None) => return Ok(None),
        (Some(cq), Some(ck)) => (cq, ck),
        (q, k) => bail!(
            "cqsa: cu_seqlens_q and cu_seqlens_k go together, got cu_seqlens_q {} and cu_seqlens_k {}",
            if q.is_some() { "set" } else { "None" },
            if k.is_some() { "set" } else { "None" }
        ),
    };
    check("cu_seqlens_q", cq, nq)?;
    check("cu_seqlens_k", ck, nk)?;
    if cq.len() != ck.len() {
        bail!(
            "cqsa: cu_seqlens_q ({} documents) and cu_seqlens_k ({} documents) must describe as many documents",
            cq.len() - 1,
            ck.len() - 1
        )
    }
    Ok(Some(
        (0..cq.len() - 1)
            .map(|i| ((cq[i], cq[i + 1]), (ck[i], ck[i + 1])))
            .collect(),
    ))
}

/// Runs `attend` (one attention call with the varlen fields cleared) on every
/// document and concatenates the outputs along the sequence axis.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    docs: &[Document],
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(docs.len());
    for &((q0, q1), (k0, k1)) in docs {
        if q1 == q0 {
            continue;
        }
        let qd = q.narrow(2, q0, q1 - q0)?;
        if k1 == k0 {
            // Rows that see no key: output 0, gradient 0.
            outs.push(qd.zeros_like()?);
            continue;
        }
        outs.push(attend(
            &qd,
            &k.narrow(2, k0, k1 - k0)?,
            &v.narrow(2, k0, k1 - k0)?,
        )?);
    }
    Tensor::cat(&outs, 2)
}
