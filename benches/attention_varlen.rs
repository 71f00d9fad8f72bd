//! The varlen row of the attention bench: `docs` causal documents of `len`
//! tokens packed into one row (`cu_seqlens_q = cu_seqlens_k = [0, len, 2 len,
//! ...]`, mask `varlen:{docs}x{len}`), beside the same work as one dense causal
//! call with the documents along the batch axis (`b = docs`, `n = len`), which
//! no packing overhead can beat. Both go through `cqsa::attention` (forward)
//! and `cqsa::attention_saved` with its backward (forward+backward). FLOPs are
//! `4 B H D` per visible pair, `docs * len (len + 1) / 2` pairs,
//! forward+backward 3.5x. The batched call is timed again in `Mode::Resident`,
//! which skips the planner: the default mode's planning overhead.
//! CUDA: 8 x 2048, bf16, H = 16, D = 128; CPU: 4 x 128 in f32.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use cqsa::{attention, attention_saved, AttentionOpts, Mode};
use serde_json::{json, Value};

use super::{median_ms, tflops};

/// (forward ms, forward+backward ms) of `attention(q, k, v, opts)`; the
/// forward+backward through `attention_saved` and its backward for `g`, as
/// the bench's dense rows time theirs (no autograd graph: Candle's `sum_all`,
/// a single-block reduction on CUDA, took milliseconds when the bench used it).
fn timed(
    dev: &Device,
    reps: usize,
    qkvg: &[Tensor; 4],
    opts: &AttentionOpts,
) -> Result<(f64, f64)> {
    let [q, k, v, g] = qkvg;
    let fwd = median_ms(dev, 2, reps, || {
        attention(q, k, v, opts)?;
        Ok(())
    })?;
    let fb = median_ms(dev, 1, reps, || {
        let (_, saved) = attention_saved(q, k, v, opts)?;
        saved.backward(g)?;
        Ok(())
    })?;
    Ok((fwd.gpu, fb.gpu))
}

/// The varlen row and its dense batched counterpart, with their ratio.
pub fn rows(dev: &Device, dtype: DType, (h, d): (usize, usize), reps: usize) -> Result<Value> {
    let (docs, len) = if dev.is_cuda() { (8, 2048) } else { (4, 128) };
    let mask = format!("varlen:{docs}x{len}");
    let pairs = docs * len * (len + 1) / 2;
    let fwd_flops = 4.0 * (h * d) as f64 * pairs as f64;
    let rnd = |b: usize, n: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, (b, h, n, d), dev)?.to_dtype(dtype)?)
    };
    let cu: Vec<usize> = (0..=docs).map(|i| i * len).collect();
    let packed = AttentionOpts {
        causal: true,
        cu_seqlens_q: Some(cu.clone()),
        cu_seqlens_k: Some(cu),
        ..Default::default()
    };
    let batched = AttentionOpts {
        causal: true,
        ..Default::default()
    };
    let mut rows = Vec::new();
    let mut times = Vec::new();
    for (label, b, n, opts) in [
        (mask.as_str(), 1, docs * len, &packed),
        ("none", docs, len, &batched),
    ] {
        let qkvg = [rnd(b, n)?, rnd(b, n)?, rnd(b, n)?, rnd(b, n)?];
        let (fwd, fb) = timed(dev, reps, &qkvg, opts)?;
        println!(
            "varlen {label:>14} B={b} N={n:>6} causal | fwd {fwd:.3} ms {:.1} TF/s | f+b {fb:.3} ms {:.1} TF/s",
            fwd_flops / (fwd * 1e-3) / 1e12,
            3.5 * fwd_flops / (fb * 1e-3) / 1e12
        );
        times.push((fwd, fb));
        rows.push(json!({
            "system": "cqsa", "n": n, "b": b, "h": h, "d": d, "dtype": format!("{dtype:?}"),
            "causal": true, "mask": label, "visible_pairs": pairs,
            "fwd_ms": fwd, "fwdbwd_ms": fb,
            "fwd_tflops": tflops(fwd_flops, Some(fwd)),
            "fwdbwd_tflops": tflops(3.5 * fwd_flops, Some(fb)),
        }));
    }
    // The batched call again with the planner skipped (`Mode::Resident`): what
    // the default mode's planning costs a call that fits the device.
    let resident = AttentionOpts {
        mode: Mode::Resident,
        ..batched
    };
    let qkvg = [
        rnd(docs, len)?,
        rnd(docs, len)?,
        rnd(docs, len)?,
        rnd(docs, len)?,
    ];
    let forced = timed(dev, reps, &qkvg, &resident)?;
    println!(
        "varlen: batched, default mode / Mode::Resident: fwd {:.3} ms / {:.3} ms, f+b {:.3} ms / {:.3} ms",
        times[1].0, forced.0, times[1].1, forced.1
    );
    let ratio = json!({ "fwd": times[0].0 / times[1].0, "fwdbwd": times[0].1 / times[1].1 });
    println!(
        "varlen: packed / batched: fwd {:.3} f+b {:.3}",
        times[0].0 / times[1].0,
        times[0].1 / times[1].1
    );
    Ok(json!({
        "what": "documents packed into one row with cu_seqlens, against the same documents as one batched dense causal call; forward through cqsa::attention, forward+backward through cqsa::attention_saved and its backward",
        "flops_convention": "4*B*H*D per visible (query, key) pair, forward+backward 3.5x forward",
        "docs": docs, "len": len,
        "rows": rows,
        "packed_over_batched": ratio,
        "batched_resident_mode": { "fwd_ms": forced.0, "fwdbwd_ms": forced.1 },
        "batched_default_over_resident_mode": { "fwd": times[1].0 / forced.0, "fwdbwd": times[1].1 / forced.1 },
    }))
}
