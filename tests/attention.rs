//! Tests: `cqsa` exact chunked attention, forward and backward, resident and
//! streamed, against an f64 naive reference computed on the host and against
//! Candle's naive attention (`softmax(q k^T * scale + mask) v` with candle ops).
//!
//! Tolerances are max |error| / max |reference| over the whole tensor: f32 1e-5
//! (forward) and 1e-4 (gradients, which sum over the sequence); f16 3e-3 and bf16
//! 2e-2 (the output is rounded to the dtype, and the tensor-core path rounds the
//! probabilities before multiplying by v).
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use cqsa::{attention, estimate, AttentionOpts, AttentionShape, Budget, Mode};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// A `(b, h, n, d)` tensor of uniform values in [-1, 1), deterministic in `seed`.
fn rand_t(
    shape: (usize, usize, usize, usize),
    dtype: DType,
    dev: &Device,
    seed: u64,
) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

fn host_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?)
}

/// f64 naive attention with the crate's conventions: GQA, bottom-right causal
/// alignment, output 0 for a row that sees no key.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Vec<f64>> {
    let (b, hq, nq, d) = q.dims4()?;
    let (_, hkv, nk, _) = k.dims4()?;
    let (q, k, v) = (host_f64(q)?, host_f64(k)?, host_f64(v)?);
    let mut out = vec![0f64; b * hq * nq * d];
    for bi in 0..b {
        for h in 0..hq {
            let kh = bi * hkv + h / (hq / hkv);
            for i in 0..nq {
                let row = (bi * hq + h) * nq + i;
                let visible = if causal {
                    (i as i64 + nk as i64 - nq as i64 + 1).clamp(0, nk as i64) as usize
                } else {
                    nk
                };
                if visible == 0 {
                    continue;
                }
                let s: Vec<f64> = (0..visible)
                    .map(|j| {
                        (0..d)
                            .map(|x| q[row * d + x] * k[(kh * nk + j) * d + x])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                for x in 0..d {
                    out[row * d + x] = (0..visible)
                        .map(|j| p[j] * v[(kh * nk + j) * d + x])
                        .sum::<f64>()
                        / l;
                }
            }
        }
    }
    Ok(out)
}

/// Candle's naive attention: k/v heads repeated for GQA, full score matrix,
/// `-inf` bottom-right causal mask, softmax in f32. Needs `seq_q <= seq_k` when
/// causal (otherwise some rows see nothing and softmax gives NaN).
fn naive(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
    let (b, hq, nq, d) = q.dims4()?;
    let (_, hkv, nk, _) = k.dims4()?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        Ok(t.unsqueeze(2)?
            .broadcast_as((b, hkv, hq / hkv, nk, d))?
            .reshape((b, hq, nk, d))?)
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let mut s = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    if causal {
        let off = nk as i64 - nq as i64;
        let mask: Vec<f32> = (0..nq)
            .flat_map(|i| {
                (0..nk).map(move |j| {
                    if j as i64 <= i as i64 + off {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (nq, nk), q.device())?.to_dtype(q.dtype())?;
        s = s.broadcast_add(&mask)?;
    }
    let p = candle_nn::ops::softmax(&s, candle_core::D::Minus1)?;
    Ok(p.matmul(&v)?)
}

/// max |a - b| / max |b|.
fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

use crate::common::{ensure_close, expect_err, rel_err as rel_err_t};

/// (b, hq, hkv, nq, nk, d, causal)
type Case = (usize, usize, usize, usize, usize, usize, bool);

const CASES: &[Case] = &[
    (1, 1, 1, 1, 1, 16, false),
    (1, 2, 2, 1, 37, 32, true),
    (2, 4, 2, 37, 37, 64, true),
    (1, 2, 1, 50, 77, 80, true),
    (1, 2, 2, 77, 50, 128, true),
    (1, 3, 1, 65, 33, 128, false),
    (1, 2, 2, 70, 70, 256, true),
    (1, 1, 1, 129, 130, 16, true),
];

fn run_forward_cases(dev: &Device, dtype: DType, tol: f64) -> Result<()> {
    for (n, &(b, hq, hkv, nq, nk, d, causal)) in CASES.iter().enumerate() {
        let seed = 100 * n as u64;
        let q = rand_t((b, hq, nq, d), dtype, dev, seed)?;
        let k = rand_t((b, hkv, nk, d), dtype, dev, seed + 1)?;
        let v = rand_t((b, hkv, nk, d), dtype, dev, seed + 2)?;
        let scale = 1.0 / (d as f64).sqrt();
        let opts = AttentionOpts {
            causal,
            ..Default::default()
        };
        let o = attention(&q, &k, &v, &opts)?;
        ensure!(
            o.dims() == q.dims() && o.dtype() == dtype,
            "shape/dtype {:?} {:?}",
            o.dims(),
            o.dtype()
        );
        ensure!(o.device().same_device(dev), "output left the device");
        let err = rel_err(&host_f64(&o)?, &reference(&q, &k, &v, causal, scale)?);
        ensure!(
            err <= tol,
            "{dtype:?} case {:?}: error vs f64 reference {err:e} > {tol:e}",
            CASES[n]
        );
        if !causal || nq <= nk {
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let nv = naive(&f(&q)?, &f(&k)?, &f(&v)?, causal, scale)?;
            let err = rel_err_t(&o, &nv)?;
            ensure!(
                err <= tol,
                "{dtype:?} case {:?}: error vs candle naive {err:e} > {tol:e}",
                CASES[n]
            );
        }
    }
    Ok(())
}

fn attention_f32_matches_reference_and_naive(dev: &Device) -> Result<()> {
    run_forward_cases(dev, DType::F32, 1e-5)
}
candle_streamer::test_device!(attention_f32_matches_reference_and_naive);

fn attention_f16_within_tolerance(dev: &Device) -> Result<()> {
    run_forward_cases(dev, DType::F16, 3e-3)
}
candle_streamer::test_device!(attention_f16_within_tolerance);

fn attention_bf16_within_tolerance(dev: &Device) -> Result<()> {
    run_forward_cases(dev, DType::BF16, 2e-2)
}
candle_streamer::test_device!(attention_bf16_within_tolerance);

/// The head dims the tensor-core path is tuned for, at a size of several tiles.
fn attention_tuned_head_dims_multi_tile(dev: &Device) -> Result<()> {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 3e-3)] {
        for d in [64, 128] {
            let (q, k, v) = (
                rand_t((1, 2, 100, d), dtype, dev, 7)?,
                rand_t((1, 1, 150, d), dtype, dev, 8)?,
                rand_t((1, 1, 150, d), dtype, dev, 9)?,
            );
            for causal in [false, true] {
                let o = attention(
                    &q,
                    &k,
                    &v,
                    &AttentionOpts {
                        causal,
                        ..Default::default()
                    },
                )?;
                let err = rel_err(
                    &host_f64(&o)?,
                    &reference(&q, &k, &v, causal, 1.0 / (d as f64).sqrt())?,
                );
                ensure!(
                    err <= tol,
                    "{dtype:?} d={d} causal={causal}: {err:e} > {tol:e}"
                );
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_tuned_head_dims_multi_tile);

fn attention_custom_scale_and_noncontiguous(dev: &Device) -> Result<()> {
    // q built as (b, n, h, d) and transposed: a non-contiguous input.
    let q = rand_t((1, 20, 2, 32), DType::F32, dev, 1)?.transpose(1, 2)?;
    let k = rand_t((1, 2, 24, 32), DType::F32, dev, 2)?;
    let v = rand_t((1, 2, 24, 32), DType::F32, dev, 3)?;
    ensure!(!q.is_contiguous());
    let opts = AttentionOpts {
        causal: true,
        scale: Some(0.3),
        ..Default::default()
    };
    let o = attention(&q, &k, &v, &opts)?;
    let err = rel_err(&host_f64(&o)?, &reference(&q, &k, &v, true, 0.3)?);
    ensure!(err <= 1e-5, "error {err:e}");
    Ok(())
}
candle_streamer::test_device!(attention_custom_scale_and_noncontiguous);

/// Gradients of q, k, v of `sum(o * w)` through cqsa and through Candle's naive
/// attention with autograd; returns the max relative error over the three.
fn grad_error(dev: &Device, case: Case, dtype: DType, opts_extra: AttentionOpts) -> Result<f64> {
    let (b, hq, hkv, nq, nk, d, causal) = case;
    let q = rand_t((b, hq, nq, d), dtype, dev, 11)?;
    let k = rand_t((b, hkv, nk, d), dtype, dev, 12)?;
    let v = rand_t((b, hkv, nk, d), dtype, dev, 13)?;
    let w = rand_t((b, hq, nq, d), DType::F32, dev, 14)?;
    let scale = 1.0 / (d as f64).sqrt();

    let (vq, vk, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let opts = AttentionOpts {
        causal,
        ..opts_extra
    };
    let o = attention(vq.as_tensor(), vk.as_tensor(), vv.as_tensor(), &opts)?;
    let loss = (o.to_dtype(DType::F32)? * &w)?.sum_all()?;
    let g = loss.backward()?;

    let f = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
    let (nq_, nk_, nv_) = (f(&q)?, f(&k)?, f(&v)?);
    let on = naive(
        nq_.as_tensor(),
        nk_.as_tensor(),
        nv_.as_tensor(),
        causal,
        scale,
    )?;
    let nloss = (on * &w)?.sum_all()?;
    let ng = nloss.backward()?;

    let mut worst = 0f64;
    for (ours, theirs, name) in [(&vq, &nq_, "dq"), (&vk, &nk_, "dk"), (&vv, &nv_, "dv")] {
        let a = g
            .get(ours.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no {name} from cqsa"))?;
        let b = ng
            .get(theirs.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no {name} from naive"))?;
        ensure!(
            a.dims() == ours.dims() && a.dtype() == dtype,
            "{name} shape/dtype"
        );
        worst = worst.max(rel_err_t(a, b)?);
    }
    Ok(worst)
}

const GRAD_CASES: &[Case] = &[
    (1, 1, 1, 1, 5, 16, false),
    (1, 2, 2, 19, 19, 32, true),
    (2, 4, 2, 33, 47, 64, true),
    (1, 2, 1, 40, 25, 80, false),
    (1, 2, 2, 65, 70, 128, true),
    (1, 1, 1, 17, 20, 256, true),
];

fn attention_grads_match_naive_autograd(dev: &Device) -> Result<()> {
    for &case in GRAD_CASES {
        let err = grad_error(dev, case, DType::F32, AttentionOpts::default())?;
        ensure!(err <= 1e-4, "f32 grads {case:?}: {err:e}");
    }
    Ok(())
}
candle_streamer::test_device!(attention_grads_match_naive_autograd);

fn attention_grads_half_precision(dev: &Device) -> Result<()> {
    for &case in &GRAD_CASES[1..4] {
        for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
            let err = grad_error(dev, case, dtype, AttentionOpts::default())?;
            ensure!(err <= tol, "{dtype:?} grads {case:?}: {err:e} > {tol:e}");
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_grads_half_precision);

/// The head dims of the tensor-core backward (f16/bf16 at 64 and 128 on CUDA)
/// over several key blocks and query tiles: GQA, causal with seq_q < seq_k, a
/// single query row, non-causal with seq_q > seq_k; gradients against Candle's
/// naive autograd in f32.
fn attention_grads_tensor_core_head_dims(dev: &Device) -> Result<()> {
    let cases: &[Case] = &[
        (1, 4, 2, 100, 150, 64, true),
        (2, 2, 1, 130, 70, 64, false),
        (1, 2, 1, 1, 33, 64, true),
        (1, 2, 2, 97, 200, 128, true),
        (1, 4, 1, 70, 70, 128, false),
        (1, 2, 2, 1, 65, 128, true),
    ];
    for &case in cases {
        for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
            let err = grad_error(dev, case, dtype, AttentionOpts::default())?;
            ensure!(err <= tol, "{dtype:?} grads {case:?}: {err:e} > {tol:e}");
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_grads_tensor_core_head_dims);

/// Output and gradients of q, k, v of `sum(o * w)` through cqsa (o in f32).
fn cqsa_grads(q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor, causal: bool) -> Result<Vec<Tensor>> {
    let (vq, vk, vv) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let opts = AttentionOpts {
        causal,
        ..Default::default()
    };
    let o =
        attention(vq.as_tensor(), vk.as_tensor(), vv.as_tensor(), &opts)?.to_dtype(DType::F32)?;
    let g = (&o * w)?.sum_all()?.backward()?;
    let mut out = vec![o];
    for t in [&vq, &vk, &vv] {
        out.push(
            g.get(t.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("missing grad"))?
                .to_dtype(DType::F32)?,
        );
    }
    Ok(out)
}

/// Causal with seq_q > seq_k: the leading rows see no key (output and dq 0).
/// Half-precision output and gradients (the tensor-core kernels on CUDA at head
/// dims 64 and 128) against the f32 path on the same rounded inputs.
fn attention_half_rows_without_keys_match_f32(dev: &Device) -> Result<()> {
    for d in [64, 128] {
        for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
            let q = rand_t((1, 2, 150, d), dtype, dev, 51)?;
            let k = rand_t((1, 1, 90, d), dtype, dev, 52)?;
            let v = rand_t((1, 1, 90, d), dtype, dev, 53)?;
            let w = rand_t((1, 2, 150, d), DType::F32, dev, 54)?;
            let half = cqsa_grads(&q, &k, &v, &w, true)?;
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            let full = cqsa_grads(&f(&q)?, &f(&k)?, &f(&v)?, &w, true)?;
            for (i, (a, b)) in half.iter().zip(&full).enumerate() {
                let err = rel_err_t(a, b)?;
                ensure!(err <= tol, "{dtype:?} d={d} tensor {i}: {err:e} > {tol:e}");
            }
            // Rows 0..60 see no key: their output and dq are exactly zero.
            for t in [&half[0], &half[1]] {
                let lead = t.narrow(2, 0, 60)?.abs()?.max_all()?.to_scalar::<f32>()?;
                ensure!(
                    lead == 0.0,
                    "{dtype:?} d={d}: leading rows not zero ({lead})"
                );
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_half_rows_without_keys_match_f32);

/// A budget far below what a resident call needs forces the streamed mode; its
/// output and gradients equal the resident ones.
fn attention_streamed_equals_resident(dev: &Device) -> Result<()> {
    let cases: &[Case] = &[
        (1, 2, 1, 100, 130, 32, true),
        (1, 2, 2, 130, 90, 64, true), // seq_q > seq_k: leading rows see nothing
        (2, 2, 2, 70, 70, 16, false),
    ];
    for &(b, hq, hkv, nq, nk, d, causal) in cases {
        let shape = AttentionShape {
            b,
            hq,
            hkv,
            nq,
            nk,
            d,
            dtype: DType::F32,
            causal,
        };
        let budget = Budget::new(shape.resident_bytes() / 3);
        let plan = estimate(&shape, &budget)?;
        ensure!(plan.mode == Mode::Streamed, "plan {plan}");
        ensure!(plan.q_chunk < nq || plan.kv_chunk < nk, "plan {plan}");
        ensure!(plan.device_bytes <= budget.device_bytes, "plan {plan}");
        let q = rand_t((b, hq, nq, d), DType::F32, dev, 21)?;
        let k = rand_t((b, hkv, nk, d), DType::F32, dev, 22)?;
        let v = rand_t((b, hkv, nk, d), DType::F32, dev, 23)?;
        let resident = attention(
            &q,
            &k,
            &v,
            &AttentionOpts {
                causal,
                mode: Mode::Resident,
                ..Default::default()
            },
        )?;
        let streamed_opts = AttentionOpts {
            causal,
            budget: Some(budget),
            ..Default::default()
        };
        let streamed = attention(&q, &k, &v, &streamed_opts)?;
        ensure!(
            streamed.device().same_device(dev),
            "streamed output left the device"
        );
        let err = rel_err_t(&streamed, &resident)?;
        ensure!(err <= 1e-5, "streamed vs resident {err:e}");
        let err = rel_err(
            &host_f64(&streamed)?,
            &reference(&q, &k, &v, causal, 1.0 / (d as f64).sqrt())?,
        );
        ensure!(err <= 1e-5, "streamed vs reference {err:e}");
        if nq <= nk || !causal {
            let err = grad_error(
                dev,
                (b, hq, hkv, nq, nk, d, causal),
                DType::F32,
                streamed_opts.clone(),
            )?;
            ensure!(err <= 1e-4, "streamed grads {err:e}");
        }
    }
    // Explicit small chunks, bf16, and the grads of a seq_q > seq_k causal call
    // against the resident op's grads.
    let opts = crate::common::streamed_opts(true, (16, 24));
    let q = Var::from_tensor(&rand_t((1, 2, 50, 32), DType::BF16, dev, 31)?)?;
    let k = Var::from_tensor(&rand_t((1, 1, 40, 32), DType::BF16, dev, 32)?)?;
    let v = Var::from_tensor(&rand_t((1, 1, 40, 32), DType::BF16, dev, 33)?)?;
    let run = |opts: &AttentionOpts| -> Result<Vec<Tensor>> {
        let o = attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), opts)?;
        let g = o.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
        let mut out = vec![o];
        for t in [&q, &k, &v] {
            out.push(
                g.get(t.as_tensor())
                    .ok_or_else(|| anyhow::anyhow!("missing grad"))?
                    .clone(),
            );
        }
        Ok(out)
    };
    let a = run(&opts)?;
    let b = run(&AttentionOpts {
        causal: true,
        mode: Mode::Resident,
        ..Default::default()
    })?;
    for (x, y) in a.iter().zip(&b) {
        let err = rel_err_t(x, y)?;
        ensure!(err <= 2e-2, "bf16 streamed vs resident {err:e}");
    }
    Ok(())
}
candle_streamer::test_device!(attention_streamed_equals_resident);

/// A host budget that holds a streamed forward but not the backward after it:
/// `estimate` plans it (its check is the forward's) and inputs no gradient can
/// reach run, equal to the resident call; inputs that are variables are
/// refused with both byte counts, before any work.
fn attention_forward_only_needs_forward_host_memory(dev: &Device) -> Result<()> {
    let shape = AttentionShape {
        b: 1,
        hq: 2,
        hkv: 2,
        nq: 128,
        nk: 128,
        d: 32,
        dtype: DType::F32,
        causal: true,
    };
    let device_bytes = shape.resident_bytes() / 3;
    let roomy = estimate(
        &shape,
        &Budget {
            device_bytes,
            host_bytes: 1 << 40,
        },
    )?;
    ensure!(
        roomy.mode == Mode::Streamed && roomy.backward_host_bytes > 0,
        "{roomy}"
    );
    let budget = Budget {
        device_bytes,
        host_bytes: roomy.host_bytes + roomy.backward_host_bytes / 2,
    };
    let plan = estimate(&shape, &budget)?;
    ensure!(
        plan.host_bytes <= budget.host_bytes
            && plan.host_bytes + plan.backward_host_bytes > budget.host_bytes,
        "{plan}"
    );
    let q = rand_t((1, 2, 128, 32), DType::F32, dev, 41)?;
    let k = rand_t((1, 2, 128, 32), DType::F32, dev, 42)?;
    let v = rand_t((1, 2, 128, 32), DType::F32, dev, 43)?;
    let opts = |mode, budget| AttentionOpts {
        causal: true,
        mode,
        budget,
        ..Default::default()
    };
    let resident = attention(&q, &k, &v, &opts(Mode::Resident, None))?;
    let streamed = attention(&q, &k, &v, &opts(Mode::Auto, Some(budget)))?;
    let e = rel_err_t(&streamed, &resident)?;
    ensure!(e <= 1e-5, "forward-only streamed vs resident {e:e}");
    let qv = Var::from_tensor(&q)?;
    let err = attention(qv.as_tensor(), &k, &v, &opts(Mode::Auto, Some(budget))).unwrap_err();
    ensure!(
        streamer_device::Error::is_out_of_memory(&err)
            && err.to_string().contains("more for the backward"),
        "{err}"
    );
    Ok(())
}
candle_streamer::test_device!(attention_forward_only_needs_forward_host_memory);

/// Host inputs computed on `dev` (streamed from host memory when forced): the
/// output stays on the host.
fn attention_host_inputs_on_device(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let q = rand_t((1, 2, 60, 64), DType::F32, &cpu, 41)?;
    let k = rand_t((1, 2, 60, 64), DType::F32, &cpu, 42)?;
    let v = rand_t((1, 2, 60, 64), DType::F32, &cpu, 43)?;
    let want = reference(&q, &k, &v, true, 0.125)?;
    for mode in [Mode::Resident, Mode::Streamed] {
        let opts = AttentionOpts {
            causal: true,
            device: Some(dev.clone()),
            mode,
            q_chunk: Some(32),
            kv_chunk: Some(16),
            ..Default::default()
        };
        let o = attention(&q, &k, &v, &opts)?;
        ensure!(o.device().is_cpu(), "output should stay on the host");
        let err = rel_err(&host_f64(&o)?, &want);
        ensure!(err <= 1e-5, "{mode:?}: {err:e}");
    }
    Ok(())
}
candle_streamer::test_device!(attention_host_inputs_on_device);

/// `attention_saved` (forward outside autograd, explicit backward) against
/// Candle's naive attention with autograd (independent) and against the same
/// call through `attention()` and autograd: resident, streamed in small
/// chunks, and host inputs computed on `dev`; causal GQA with seq_q > seq_k,
/// and a sliding window. A bad `grad_o` is refused.
fn attention_saved_matches_autograd(dev: &Device) -> Result<()> {
    let cpu = Device::Cpu;
    let (q, k, v) = (
        rand_t((1, 4, 50, 64), DType::F32, dev, 51)?,
        rand_t((1, 2, 40, 64), DType::F32, dev, 52)?,
        rand_t((1, 2, 40, 64), DType::F32, dev, 53)?,
    );
    let w = rand_t((1, 4, 50, 64), DType::F32, dev, 54)?;
    let chunks = |mode| AttentionOpts {
        causal: true,
        mode,
        q_chunk: Some(16),
        kv_chunk: Some(24),
        ..Default::default()
    };
    let grads_of = |o: &Tensor, vars: &[Var]| -> Result<Vec<Tensor>> {
        let g = (o * &w)?.sum_all()?.backward()?;
        let mut out = vec![o.clone()];
        for x in vars {
            out.push(
                g.get(x.as_tensor())
                    .ok_or_else(|| anyhow::anyhow!("no grad"))?
                    .clone(),
            );
        }
        Ok(out)
    };
    let vars = [
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    ];
    let on = naive(&vars[0], &vars[1], &vars[2], true, 0.125)?;
    let naive_grads = grads_of(&on, &vars)?;
    for (name, opts, host) in [
        ("resident", chunks(Mode::Resident), false),
        ("streamed", chunks(Mode::Streamed), false),
        (
            "host inputs, streamed",
            AttentionOpts {
                device: Some(dev.clone()),
                ..chunks(Mode::Streamed)
            },
            true,
        ),
        (
            "window",
            AttentionOpts {
                window_left: Some(7),
                ..chunks(Mode::Streamed)
            },
            false,
        ),
    ] {
        let place = |t: &Tensor| {
            if host {
                t.to_device(&cpu)
            } else {
                Ok(t.clone())
            }
        };
        let (qi, ki, vi, wi) = (place(&q)?, place(&k)?, place(&v)?, place(&w)?);
        let (o, saved) = cqsa::attention_saved(&qi, &ki, &vi, &opts)?;
        ensure!(
            !o.track_op(),
            "{name}: the saved forward's output must be detached"
        );
        let (dq, dk, dv) = saved.backward(&wi)?;
        let ours = [o, dq, dk, dv];
        for (t, like) in ours.iter().zip([&qi, &qi, &ki, &vi]) {
            ensure!(
                t.device().same_device(like.device()) && t.dims() == like.dims(),
                "{name}: placement"
            );
        }
        // The same call through attention() and autograd.
        let vars = [
            Var::from_tensor(&qi)?,
            Var::from_tensor(&ki)?,
            Var::from_tensor(&vi)?,
        ];
        let oa = attention(&vars[0], &vars[1], &vars[2], &opts)?;
        let g = (&oa * &wi)?.sum_all()?.backward()?;
        let auto = [
            oa.clone(),
            g.get(vars[0].as_tensor()).unwrap().clone(),
            g.get(vars[1].as_tensor()).unwrap().clone(),
            g.get(vars[2].as_tensor()).unwrap().clone(),
        ];
        for (i, (a, b)) in ours.iter().zip(&auto).enumerate() {
            let err = rel_err_t(a, b)?;
            ensure!(err <= 1e-6, "{name}: result {i} vs autograd {err:e}");
        }
        if opts.window_left.is_none() {
            for (i, (a, b)) in ours.iter().zip(&naive_grads).enumerate() {
                let err = rel_err_t(a, b)?;
                ensure!(err <= 1e-4, "{name}: result {i} vs naive autograd {err:e}");
            }
        }
        let bad = |g: &Tensor, needle: &str| -> Result<()> {
            match saved.backward(g) {
                Ok(_) => anyhow::bail!("{name}: a bad grad_o was accepted"),
                Err(e) => ensure!(e.to_string().contains(needle), "{name}: error {e}"),
            }
            Ok(())
        };
        bad(&wi.narrow(2, 0, 49)?, "grad_o")?;
        bad(&wi.to_dtype(DType::F16)?, "F32")?;
    }
    Ok(())
}
candle_streamer::test_device!(attention_saved_matches_autograd);

/// The call `opts` on `(q, k, v)` through autograd (of `sum(o * w)`) and through
/// `attention_saved` and its backward (with `w` as the output's gradient): the
/// outputs and the gradients must agree within `tol` (relative) and have the
/// inputs' shapes. Returns autograd's output and gradients of q, k, v.
fn saved_matches_autograd(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    w: &Tensor,
    opts: &AttentionOpts,
    tol: f64,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = [
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    ];
    let o = attention(&vars[0], &vars[1], &vars[2], opts)?;
    let g = (o.to_dtype(DType::F32)? * w.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?;
    let auto: Vec<Tensor> = vars
        .iter()
        .map(|x| {
            g.get(x.as_tensor())
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("no grad"))
        })
        .collect::<Result<_>>()?;
    let (os, saved) = cqsa::attention_saved(q, k, v, opts)?;
    let (dq, dk, dv) = saved.backward(w)?;
    ensure!(rel_err_t(&os, &o)? <= tol, "saved output differs");
    for (name, a, b) in [
        ("dq", &dq, &auto[0]),
        ("dk", &dk, &auto[1]),
        ("dv", &dv, &auto[2]),
    ] {
        ensure!(a.dims() == b.dims(), "{name}: shape {:?}", a.dims());
        let err = rel_err_t(a, b)?;
        ensure!(
            err <= tol,
            "saved {name} differs from autograd: {err:e} > {tol:e}"
        );
    }
    Ok((o, auto))
}

/// A packed call's gradients, through autograd and through `attention_saved`,
/// against each document run alone through autograd on copies of its slices.
/// Documents: 37 queries / 50 keys; 64 queries that see no key (output and dq
/// 0); 10 keys that no query sees (dk, dv 0); 1 query / 10 keys. Streamed
/// documents too (chunks of 16 x 24).
fn attention_varlen_saved_matches_documents(dev: &Device) -> Result<()> {
    let (cq, ck) = (vec![0, 37, 101, 101, 102], vec![0, 50, 50, 60, 70]);
    let q = rand_t((1, 4, 102, 32), DType::F32, dev, 61)?;
    let k = rand_t((1, 2, 70, 32), DType::F32, dev, 62)?;
    let v = rand_t((1, 2, 70, 32), DType::F32, dev, 63)?;
    let w = rand_t((1, 4, 102, 32), DType::F32, dev, 64)?;
    for mode in [Mode::Resident, Mode::Streamed] {
        let opts = AttentionOpts {
            causal: true,
            mode,
            q_chunk: Some(16),
            kv_chunk: Some(24),
            cu_seqlens_q: Some(cq.clone()),
            cu_seqlens_k: Some(ck.clone()),
            ..Default::default()
        };
        let (o, auto) =
            saved_matches_autograd((&q, &k, &v), &w, &opts, 1e-6).context(format!("{mode:?}"))?;
        // Rows without keys, keys without rows: exactly 0.
        let abs_sum = |t: &Tensor, at: usize, len: usize| -> Result<f32> {
            Ok(t.narrow(2, at, len)?.abs()?.sum_all()?.to_scalar::<f32>()?)
        };
        ensure!(
            abs_sum(&o, 37, 64)? == 0.0 && abs_sum(&auto[0], 37, 64)? == 0.0,
            "{mode:?}: keyless rows"
        );
        ensure!(
            abs_sum(&auto[1], 50, 10)? == 0.0 && abs_sum(&auto[2], 50, 10)? == 0.0,
            "{mode:?}: unseen keys"
        );
        // Each document with queries and keys, alone.
        for ((q0, q1), (k0, k1)) in [((0, 37), (0, 50)), ((101, 102), (60, 70))] {
            let one = |t: &Tensor, a: usize, b: usize| -> Result<Var> {
                Ok(Var::from_tensor(&t.narrow(2, a, b - a)?.contiguous()?)?)
            };
            let (dq_, dk_, dv_) = (one(&q, q0, q1)?, one(&k, k0, k1)?, one(&v, k0, k1)?);
            let alone = AttentionOpts {
                causal: true,
                ..Default::default()
            };
            let od = attention(dq_.as_tensor(), dk_.as_tensor(), dv_.as_tensor(), &alone)?;
            let gd = (&od * &w.narrow(2, q0, q1 - q0)?)?.sum_all()?.backward()?;
            ensure!(
                rel_err_t(&o.narrow(2, q0, q1 - q0)?, &od)? <= 1e-5,
                "{mode:?}: output of {q0}..{q1}"
            );
            for (name, packed, var, (a, b)) in [
                ("dq", &auto[0], &dq_, (q0, q1)),
                ("dk", &auto[1], &dk_, (k0, k1)),
                ("dv", &auto[2], &dv_, (k0, k1)),
            ] {
                let want = gd
                    .get(var.as_tensor())
                    .ok_or_else(|| anyhow::anyhow!("no {name}"))?;
                let err = rel_err_t(&packed.narrow(2, a, b - a)?, want)?;
                ensure!(
                    err <= 1e-5,
                    "{mode:?}: {name} of document {q0}..{q1}: {err:e}"
                );
            }
        }
        let (_, saved) = cqsa::attention_saved(&q, &k, &v, &opts)?;
        let bad = saved.backward(&w.narrow(2, 0, 101)?);
        ensure!(
            bad.is_err_and(|e| e.to_string().contains("grad_o")),
            "{mode:?}: a bad grad_o was accepted"
        );
    }
    Ok(())
}
candle_streamer::test_device!(attention_varlen_saved_matches_documents);

fn attention_rejects_bad_input(dev: &Device) -> Result<()> {
    let o = AttentionOpts::default();
    let t = |s: (usize, usize, usize, usize), dt: DType| Tensor::zeros(s, dt, dev);
    let q = t((1, 4, 8, 16), DType::F32)?;
    let kv = t((1, 2, 8, 16), DType::F32)?;
    // rank
    let q3 = Tensor::zeros((4, 8, 16), DType::F32, dev)?;
    expect_err(attention(&q3, &kv, &kv, &o), &["rank 4", "[4, 8, 16]"])?;
    // dtype mix and unsupported dtype
    let kv16 = kv.to_dtype(DType::F16)?;
    expect_err(attention(&q, &kv16, &kv, &o), &["F32", "F16"])?;
    let q64 = q.to_dtype(DType::F64)?;
    expect_err(attention(&q64, &kv, &kv, &o), &["F64"])?;
    use streamer_device::Error;
    let e = attention(&q64, &kv, &kv, &o).unwrap_err();
    ensure!(
        matches!(
            Error::find(&e),
            Some(&Error::Dtype {
                got: DType::F64,
                ..
            })
        ),
        "{e}"
    );
    let e = attention(&q3, &kv, &kv, &o).unwrap_err();
    ensure!(
        matches!(Error::find(&e), Some(Error::Shape { got, .. }) if got == &[4, 8, 16]),
        "{e}"
    );
    // heads that do not divide
    let kv3 = t((1, 3, 8, 16), DType::F32)?;
    expect_err(
        attention(&q, &kv3, &kv3, &o),
        &["heads_q (4)", "heads_kv (3)"],
    )?;
    // head_dim 0 and above the maximum
    let q0 = t((1, 4, 8, 0), DType::F32)?;
    let kv0 = t((1, 2, 8, 0), DType::F32)?;
    expect_err(attention(&q0, &kv0, &kv0, &o), &["head_dim", "got 0"])?;
    let qbig = t((1, 1, 2, 300), DType::F32)?;
    let kvbig = t((1, 1, 2, 300), DType::F32)?;
    expect_err(attention(&qbig, &kvbig, &kvbig, &o), &["head_dim", "300"])?;
    // mismatched head_dim, batch and k/v shapes
    let kvd = t((1, 2, 8, 32), DType::F32)?;
    expect_err(attention(&q, &kvd, &kvd, &o), &["(16)", "(32)"])?;
    let kvb = t((2, 2, 8, 16), DType::F32)?;
    expect_err(attention(&q, &kvb, &kvb, &o), &["batch"])?;
    let v9 = t((1, 2, 9, 16), DType::F32)?;
    expect_err(
        attention(&q, &kv, &v9, &o),
        &["[1, 2, 8, 16]", "[1, 2, 9, 16]"],
    )?;
    // mismatched devices (only possible when dev is not the CPU)
    if !dev.is_cpu() {
        let kv_host = kv.to_device(&Device::Cpu)?;
        expect_err(attention(&q, &kv_host, &kv, &o), &["one device"])?;
    }
    // nothing fits
    let opts = AttentionOpts {
        budget: Some(Budget {
            device_bytes: 16,
            host_bytes: 1 << 40,
        }),
        ..Default::default()
    };
    expect_err(
        attention(&q, &kv, &kv, &opts),
        &["nothing fits", "budget is 16"],
    )?;
    Ok(())
}
candle_streamer::test_device!(attention_rejects_bad_input);

fn estimate_plans_without_allocating(dev: &Device) -> Result<()> {
    let _ = dev;
    let small = AttentionShape {
        b: 1,
        hq: 4,
        hkv: 4,
        nq: 128,
        nk: 128,
        d: 64,
        dtype: DType::BF16,
        causal: true,
    };
    let big = AttentionShape {
        nq: 1 << 20,
        nk: 1 << 20,
        hq: 16,
        hkv: 16,
        d: 128,
        ..small
    };
    let budget = Budget {
        device_bytes: 8 << 30,
        host_bytes: 1 << 40,
    };
    let p = estimate(&small, &budget)?;
    ensure!(
        p.mode == Mode::Resident && p.q_chunk == 128 && p.subproblems == 1,
        "{p}"
    );
    // N = 1M, 16 heads, d 128, bf16: 4 GiB per input tensor; the plan streams.
    let p = estimate(&big, &budget)?;
    ensure!(p.mode == Mode::Streamed, "{p}");
    ensure!(
        p.device_bytes <= budget.device_bytes && p.resident_bytes > budget.device_bytes,
        "{p}"
    );
    ensure!(
        p.subproblems > 1 && p.forward_seconds > 0.0 && p.host_bytes > 0,
        "{p}"
    );
    // Causal skips the upper triangle of chunk pairs.
    let full = estimate(
        &AttentionShape {
            causal: false,
            ..big
        },
        &budget,
    )?;
    ensure!(p.subproblems < full.subproblems, "{p} vs {full}");
    Ok(())
}
candle_streamer::test_device!(estimate_plans_without_allocating);

// ------------------------------------------------------------------ masks
// Sliding windows and logit soft-capping (flash-attn semantics, see
// `cqsa::AttentionOpts`): against an f64 reference written from the documented
// rule, and against Candle's naive attention with an additive mask and
// `softcap * tanh(s / softcap)` built from candle ops (autograd for gradients).
// Tolerances as above.

/// A mask of the tests: causal, windows and soft-cap as in `AttentionOpts`.
#[derive(Debug, Clone, Copy, Default)]
struct Mask {
    causal: bool,
    wl: Option<usize>,
    wr: Option<usize>,
    cap: Option<f32>,
}

impl Mask {
    fn opts(&self) -> AttentionOpts {
        AttentionOpts {
            causal: self.causal,
            window_left: self.wl,
            window_right: self.wr,
            softcap: self.cap,
            ..Default::default()
        }
    }

    /// The documented rule: with `i' = i + nk - nq`, key `j` is visible iff
    /// `i' - wl <= j <= i' + wr` (`wr = 0` when causal; `None`: no bound).
    fn visible(&self, i: usize, j: usize, nq: usize, nk: usize) -> bool {
        let ia = i as i64 + nk as i64 - nq as i64;
        let j = j as i64;
        let right = if self.causal {
            Some(0)
        } else {
            self.wr.map(|w| w as i64)
        };
        self.wl.is_none_or(|w| j >= ia - w as i64) && right.is_none_or(|w| j <= ia + w)
    }

    fn cap_f64(&self, s: f64) -> f64 {
        match self.cap {
            Some(c) => c as f64 * (s / c as f64).tanh(),
            None => s,
        }
    }
}

/// f64 attention under `mask`: output and natural-log lse (`-inf`, output 0 for
/// a row that sees no key).
fn reference_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Mask,
    scale: f64,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (b, hq, nq, d) = q.dims4()?;
    let (_, hkv, nk, _) = k.dims4()?;
    let (q, k, v) = (host_f64(q)?, host_f64(k)?, host_f64(v)?);
    let mut out = vec![0f64; b * hq * nq * d];
    let mut lse = vec![f64::NEG_INFINITY; b * hq * nq];
    for bi in 0..b {
        for h in 0..hq {
            let kh = bi * hkv + h / (hq / hkv);
            for i in 0..nq {
                let row = (bi * hq + h) * nq + i;
                let keys: Vec<usize> = (0..nk).filter(|&j| mask.visible(i, j, nq, nk)).collect();
                if keys.is_empty() {
                    continue;
                }
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let x: f64 = (0..d)
                            .map(|x| q[row * d + x] * k[(kh * nk + j) * d + x])
                            .sum();
                        mask.cap_f64(x * scale)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let l: f64 = p.iter().sum();
                lse[row] = m + l.ln();
                for x in 0..d {
                    out[row * d + x] = keys
                        .iter()
                        .zip(&p)
                        .map(|(&j, p)| p * v[(kh * nk + j) * d + x])
                        .sum::<f64>()
                        / l;
                }
            }
        }
    }
    Ok((out, lse))
}

/// Candle's naive attention under `mask` (f32 ops, differentiable): repeated kv
/// heads, `softcap * tanh(s / softcap)`, an additive 0 / -inf mask, softmax.
/// Every row must see a key (softmax of all -inf is NaN).
fn naive_masked(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: f64) -> Result<Tensor> {
    let (nq, nk) = (q.dim(2)?, k.dim(2)?);
    naive_visible(q, k, v, &|i, j| mask.visible(i, j, nq, nk), mask.cap, scale)
}

/// Candle's naive attention where key `j` is visible from query `i` iff
/// `visible(i, j)`, scores soft-capped by `cap`.
fn naive_visible(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    visible: &dyn Fn(usize, usize) -> bool,
    cap: Option<f32>,
    scale: f64,
) -> Result<Tensor> {
    let (b, hq, nq, d) = q.dims4()?;
    let (_, hkv, nk, _) = k.dims4()?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        Ok(t.unsqueeze(2)?
            .broadcast_as((b, hkv, hq / hkv, nk, d))?
            .reshape((b, hq, nk, d))?)
    };
    let (k, v) = (rep(k)?, rep(v)?);
    let mut s = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    if let Some(c) = cap {
        s = ((s / c as f64)?.tanh()? * c as f64)?;
    }
    let add: Vec<f32> = (0..nq)
        .flat_map(|i| {
            (0..nk).map(move |j| {
                if visible(i, j) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let add = Tensor::from_vec(add, (nq, nk), q.device())?;
    let p = candle_nn::ops::softmax(&s.broadcast_add(&add)?, candle_core::D::Minus1)?;
    Ok(p.matmul(&v)?)
}

/// Whether every query row sees at least one key under `mask`.
fn every_row_sees(mask: &Mask, nq: usize, nk: usize) -> bool {
    (0..nq).all(|i| (0..nk).any(|j| mask.visible(i, j, nq, nk)))
}

/// The masks of the tests for a window `w`: left only, both sides, causal with a
/// left window, and each soft-capped with GQA shapes elsewhere.
fn window_masks(w: usize) -> Vec<Mask> {
    vec![
        Mask {
            wl: Some(w),
            ..Default::default()
        },
        Mask {
            wl: Some(w),
            wr: Some(w),
            ..Default::default()
        },
        Mask {
            causal: true,
            wl: Some(w),
            ..Default::default()
        },
        Mask {
            wr: Some(w),
            ..Default::default()
        },
    ]
}

/// Soft-capping alone, with causal, with a window (and causal).
fn softcap_masks() -> Vec<Mask> {
    let cap = Some(5.0);
    vec![
        Mask {
            cap,
            ..Default::default()
        },
        Mask {
            cap,
            causal: true,
            ..Default::default()
        },
        Mask {
            cap,
            causal: true,
            wl: Some(17),
            ..Default::default()
        },
        Mask {
            cap: Some(30.0),
            wl: Some(1),
            wr: Some(17),
            ..Default::default()
        },
    ]
}

/// Forward of `mask` on `case` (causal flag of the case ignored) in `dtype`:
/// output and lse against the f64 reference, output against Candle naive when
/// every row sees a key.
fn check_masked_forward(
    dev: &Device,
    case: Case,
    mask: &Mask,
    dtype: DType,
    tol: f64,
) -> Result<()> {
    let (b, hq, hkv, nq, nk, d, _) = case;
    let seed = (nq * 31 + nk * 7 + d) as u64;
    let q = (rand_t((b, hq, nq, d), dtype, dev, seed)? * 2.0)?;
    let k = (rand_t((b, hkv, nk, d), dtype, dev, seed + 1)? * 2.0)?;
    let v = rand_t((b, hkv, nk, d), dtype, dev, seed + 2)?;
    let scale = 1.0 / (d as f64).sqrt();
    let o = attention(&q, &k, &v, &mask.opts())?;
    ensure!(o.dims() == q.dims() && o.dtype() == dtype, "shape/dtype");
    let (want, want_lse) = reference_masked(&q, &k, &v, mask, scale)?;
    let got = host_f64(&o)?;
    ensure!(
        got.iter().all(|x| x.is_finite()),
        "{mask:?} {case:?}: non-finite output"
    );
    let err = rel_err(&got, &want);
    ensure!(
        err <= tol,
        "{dtype:?} {mask:?} {case:?}: error vs f64 reference {err:e} > {tol:e}"
    );
    // The log-sum-exp of the low-level op with the same scores.
    let scores = cqsa::Scores::of(
        &mask.opts(),
        &cqsa::AttentionShape::of(&q, &k, &v, mask.causal)?,
    )?;
    let (_, lse) = cqsa::attention_forward_with(&q, &k, &v, &scores)?;
    for (i, (a, b)) in host_f64(&lse)?.iter().zip(&want_lse).enumerate() {
        let ok = if b.is_finite() {
            (a - b).abs() <= 10.0 * tol * b.abs().max(1.0)
        } else {
            *a == f64::NEG_INFINITY
        };
        ensure!(
            ok,
            "{dtype:?} {mask:?} {case:?}: lse of row {i}: {a} vs {b}"
        );
    }
    if every_row_sees(mask, nq, nk) {
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let nv = naive_masked(&f(&q)?, &f(&k)?, &f(&v)?, mask, scale)?;
        let err = rel_err_t(&o, &nv)?;
        ensure!(
            err <= tol,
            "{dtype:?} {mask:?} {case:?}: error vs candle naive {err:e} > {tol:e}"
        );
    }
    Ok(())
}

/// Sliding windows 0, 1, 17 and >= N, alone, two-sided, with causal, GQA, seq_q
/// below, equal to and above seq_k, head dims of both CUDA families (64 and 128
/// on the tensor cores for f16/bf16; 40 and the f32 kernels elsewhere).
fn attention_window_matches_reference_and_naive(dev: &Device) -> Result<()> {
    let cases: &[Case] = &[
        (1, 4, 2, 150, 150, 64, false),
        (2, 2, 1, 97, 200, 128, false),
        (1, 2, 2, 200, 90, 40, false),
    ];
    for &case in cases {
        let big = case.3 + case.4; // a window >= N
        for w in [0, 1, 17, big] {
            for mask in window_masks(w) {
                for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 3e-3)] {
                    // Half precision at windows 1 and 17 (the other sizes cut no
                    // tile differently); the simple kernels' d = 40 at 17 only.
                    if dtype != DType::F32 && (w == 0 || w == big || (case.5 == 40 && w != 17)) {
                        continue;
                    }
                    check_masked_forward(dev, case, &mask, dtype, tol)?;
                }
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_window_matches_reference_and_naive);

/// A window far smaller than the sequence over many tiles (the CUDA kernels skip
/// the tiles no row of a block sees): N = 700 forward and N = 500 gradients,
/// window 17 causal and 64 + 3 two-sided.
fn attention_window_long_sequence(dev: &Device) -> Result<()> {
    for d in [64, 128] {
        for (wl, wr, causal) in [(17, None, true), (64, Some(3), false)] {
            let mask = Mask {
                causal,
                wl: Some(wl),
                wr,
                cap: None,
            };
            for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 3e-3)] {
                check_masked_forward(dev, (1, 2, 1, 700, 700, d, false), &mask, dtype, tol)?;
            }
            // Gradients over many key blocks and query tiles (the CUDA backward
            // visits only the tiles that see its keys).
            for (dtype, tol) in [(DType::BF16, 5e-2), (DType::F16, 1e-2)] {
                let case = (1, 2, 1, 500, 520, d, false);
                let err = masked_grad_error(dev, case, dtype, &mask, AttentionOpts::default())?;
                ensure!(
                    err <= tol,
                    "{dtype:?} grads {mask:?} {case:?}: {err:e} > {tol:e}"
                );
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_window_long_sequence);

/// Soft-capping alone, with causal, with windows and GQA, all dtypes.
fn attention_softcap_matches_reference_and_naive(dev: &Device) -> Result<()> {
    let cases: &[Case] = &[
        (1, 4, 2, 130, 130, 64, false),
        (1, 2, 1, 70, 150, 128, false),
        (2, 2, 2, 50, 40, 24, false),
    ];
    for &case in cases {
        for mask in softcap_masks() {
            for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 3e-3)] {
                check_masked_forward(dev, case, &mask, dtype, tol)?;
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_softcap_matches_reference_and_naive);

/// Held by the test that flips the Hopper switch (it is process-wide) and by
/// tests that must run under its default, so that the flips never reach them.
static HOPPER_SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn hold_hopper_switch() -> std::sync::MutexGuard<'static, ()> {
    HOPPER_SWITCH.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts the Hopper switch back as it was when dropped (it is process-wide).
struct HopperRestore(bool);
impl Drop for HopperRestore {
    fn drop(&mut self) {
        cqsa::set_hopper_kernels(self.0);
    }
}

/// The Hopper kernels (the default on a GPU of compute capability 9.0) and the
/// portable ones (`cqsa::set_hopper_kernels(false)`) on the same inputs: each
/// forward against the f64 reference (lse included, via `check_masked_forward`)
/// and against the other; gradients of each against naive autograd. Head dims 64, 128 and 256 (256 only on the Hopper and
/// simple kernels), sizes that are not tile multiples, GQA, causal with
/// bottom-right offsets, windows and soft-capping. On other devices both runs
/// take the same kernels and only the reference checks bite.
fn attention_hopper_and_portable_agree(dev: &Device) -> Result<()> {
    let _switch = hold_hopper_switch();
    let default = cqsa::hopper_kernels_enabled();
    let cases: &[Case] = &[
        (1, 4, 2, 300, 300, 128, false),
        (2, 2, 1, 129, 257, 64, false),
        (1, 2, 2, 257, 130, 256, false),
        (1, 8, 2, 1000, 1000, 128, false),
    ];
    let masks = [
        Mask::default(),
        Mask {
            causal: true,
            ..Default::default()
        },
        Mask {
            causal: true,
            wl: Some(17),
            ..Default::default()
        },
        Mask {
            wl: Some(100),
            wr: Some(3),
            ..Default::default()
        },
        Mask {
            cap: Some(5.0),
            causal: true,
            ..Default::default()
        },
    ];
    // On the CPU both runs are the CPU kernel: one case and dtype keep CI short.
    let (cases, dtypes) = if dev.is_cuda() {
        (cases, &[(DType::BF16, 2e-2), (DType::F16, 3e-3)][..])
    } else {
        (&cases[..1], &[(DType::BF16, 2e-2)][..])
    };
    for &case in cases {
        let (b, hq, hkv, nq, nk, d, _) = case;
        for &(dtype, tol) in dtypes {
            let q = (rand_t((b, hq, nq, d), dtype, dev, 5)? * 2.0)?;
            let k = (rand_t((b, hkv, nk, d), dtype, dev, 6)? * 2.0)?;
            let v = rand_t((b, hkv, nk, d), dtype, dev, 7)?;
            for mask in masks {
                let mut outs = Vec::new();
                for hopper in [true, false] {
                    cqsa::set_hopper_kernels(hopper);
                    let _restore = HopperRestore(default);
                    outs.push(host_f64(&attention(&q, &k, &v, &mask.opts())?)?);
                    check_masked_forward(dev, case, &mask, dtype, tol)?;
                }
                let (want, _) = reference_masked(&q, &k, &v, &mask, 1.0 / (d as f64).sqrt())?;
                for (o, name) in outs.iter().zip(["default", "portable"]) {
                    let err = rel_err(o, &want);
                    ensure!(
                        err <= tol,
                        "{dtype:?} {mask:?} {case:?} {name}: {err:e} > {tol:e}"
                    );
                }
                let err = rel_err(&outs[0], &outs[1]);
                ensure!(
                    err <= tol,
                    "{dtype:?} {mask:?} {case:?}: default vs portable {err:e} > {tol:e}"
                );
                // Gradients of q, k, v through each path against naive autograd
                // (the Hopper backward covers head dims 64 and 128).
                if case.5 != 256 && case.3 <= 300 && every_row_sees(&mask, case.3, case.4) {
                    let gtol = if dtype == DType::BF16 { 5e-2 } else { 1e-2 };
                    for hopper in [true, false] {
                        cqsa::set_hopper_kernels(hopper);
                        let _restore = HopperRestore(default);
                        let err = masked_grad_error(dev, case, dtype, &mask, Default::default())?;
                        ensure!(
                            err <= gtol,
                            "{dtype:?} grads {mask:?} {case:?} hopper={hopper}: {err:e} > {gtol:e}"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_hopper_and_portable_agree);

/// Gradients of q, k, v of `sum(o * w)` under `mask` through cqsa (with
/// `extra` options: mode, budget, chunks) and through Candle's naive attention
/// with autograd in f32; the max relative error over the three.
fn masked_grad_error(
    dev: &Device,
    case: Case,
    dtype: DType,
    mask: &Mask,
    extra: AttentionOpts,
) -> Result<f64> {
    let (b, hq, hkv, nq, nk, d, _) = case;
    let q = rand_t((b, hq, nq, d), dtype, dev, 61)?;
    let k = (rand_t((b, hkv, nk, d), dtype, dev, 62)? * 2.0)?;
    let v = rand_t((b, hkv, nk, d), dtype, dev, 63)?;
    let w = rand_t((b, hq, nq, d), DType::F32, dev, 64)?;
    let (vq, vk, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let opts = AttentionOpts {
        causal: mask.causal,
        window_left: mask.wl,
        window_right: mask.wr,
        softcap: mask.cap,
        ..extra
    };
    let o = attention(vq.as_tensor(), vk.as_tensor(), vv.as_tensor(), &opts)?;
    let g = (o.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
    let f = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
    let (fq, fk, fv) = (f(&q)?, f(&k)?, f(&v)?);
    let on = naive_masked(
        fq.as_tensor(),
        fk.as_tensor(),
        fv.as_tensor(),
        mask,
        1.0 / (d as f64).sqrt(),
    )?;
    let ng = (on * &w)?.sum_all()?.backward()?;
    let mut worst = 0f64;
    for (ours, theirs, name) in [(&vq, &fq, "dq"), (&vk, &fk, "dk"), (&vv, &fv, "dv")] {
        let a = g
            .get(ours.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no {name} from cqsa"))?;
        let b = ng
            .get(theirs.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no {name} from naive"))?;
        ensure!(
            a.dims() == ours.dims() && a.dtype() == dtype,
            "{name} shape/dtype"
        );
        ensure!(
            host_f64(a)?.iter().all(|x| x.is_finite()),
            "{name}: non-finite"
        );
        worst = worst.max(rel_err_t(a, b)?);
    }
    Ok(worst)
}

/// Gradients of every mask kind (windows 1, 17, >= N alone, two-sided and with
/// causal; soft-capping alone, with causal and with a window), GQA, in f32 and,
/// at the tensor-core head dims, in f16 and bf16.
fn attention_mask_grads_match_naive_autograd(dev: &Device) -> Result<()> {
    let cases: &[Case] = &[
        (1, 4, 2, 100, 130, 64, false),
        (1, 2, 1, 90, 70, 128, false),
    ];
    let mut masks = softcap_masks();
    for w in [1, 17, 500] {
        masks.extend(window_masks(w));
    }
    for &case in cases {
        for mask in &masks {
            if !every_row_sees(mask, case.3, case.4) {
                continue; // naive softmax is NaN there; covered by the zero-row test
            }
            for (dtype, tol) in [(DType::F32, 1e-4), (DType::F16, 1e-2), (DType::BF16, 5e-2)] {
                let err = masked_grad_error(dev, case, dtype, mask, AttentionOpts::default())?;
                ensure!(
                    err <= tol,
                    "{dtype:?} grads {mask:?} {case:?}: {err:e} > {tol:e}"
                );
            }
        }
    }
    // A head dim of the simple CUDA kernels, f32.
    let mask = Mask {
        causal: true,
        wl: Some(5),
        cap: Some(4.0),
        wr: None,
    };
    let err = masked_grad_error(
        dev,
        (1, 2, 1, 40, 33, 48, false),
        DType::F32,
        &mask,
        AttentionOpts::default(),
    )?;
    ensure!(err <= 1e-4, "f32 d=48 grads {mask:?}: {err:e}");
    Ok(())
}
candle_streamer::test_device!(attention_mask_grads_match_naive_autograd);

/// Rows that see no key (a right window with seq_q > seq_k, a window to the
/// right of the sequence): output 0, lse -inf, gradient 0, no NaN anywhere;
/// the other rows match the reference.
fn attention_masked_rows_without_keys(dev: &Device) -> Result<()> {
    // wr = 2 with nq = 150, nk = 90: i' = i - 60 sees j <= i - 58, so rows 0..58
    // see nothing.
    let mask = Mask {
        wr: Some(2),
        wl: Some(17),
        ..Default::default()
    };
    for (d, dtype, tol) in [
        (64, DType::F32, 1e-5),
        (64, DType::BF16, 2e-2),
        (128, DType::F16, 3e-3),
    ] {
        check_masked_forward(dev, (1, 2, 1, 150, 90, d, false), &mask, dtype, tol)?;
        let q = Var::from_tensor(&rand_t((1, 2, 150, d), dtype, dev, 71)?)?;
        let k = Var::from_tensor(&rand_t((1, 1, 90, d), dtype, dev, 72)?)?;
        let v = Var::from_tensor(&rand_t((1, 1, 90, d), dtype, dev, 73)?)?;
        let o = attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &mask.opts())?;
        let g = o.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
        let dq = g
            .get(q.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no dq"))?;
        for (name, t) in [("o", &o), ("dq", dq)] {
            ensure!(
                host_f64(t)?.iter().all(|x| x.is_finite()),
                "{name}: non-finite"
            );
            let lead = t
                .narrow(2, 0, 58)?
                .abs()?
                .to_dtype(DType::F32)?
                .max_all()?
                .to_scalar::<f32>()?;
            ensure!(
                lead == 0.0,
                "{dtype:?} d={d}: {name} of rows without keys is {lead}"
            );
        }
        for t in [&k, &v] {
            let gt = g
                .get(t.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no dk/dv"))?;
            ensure!(
                host_f64(gt)?.iter().all(|x| x.is_finite()),
                "dk/dv: non-finite"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_masked_rows_without_keys);

/// Streamed mode (small forced chunks, so chunk pairs are skipped, unmasked and
/// cut by the band) equals resident mode under windows and soft-capping,
/// forward and gradients.
fn attention_masked_streamed_equals_resident(dev: &Device) -> Result<()> {
    let masks = [
        Mask {
            causal: true,
            wl: Some(17),
            ..Default::default()
        },
        Mask {
            wl: Some(1),
            wr: Some(20),
            cap: Some(5.0),
            ..Default::default()
        },
        Mask {
            cap: Some(3.0),
            ..Default::default()
        },
        Mask {
            wr: Some(2),
            wl: Some(40),
            ..Default::default()
        }, // rows without keys
    ];
    for mask in masks {
        for (dtype, d, tol) in [(DType::F32, 32, 1e-5), (DType::BF16, 64, 2e-2)] {
            let q = rand_t((1, 2, 110, d), dtype, dev, 81)?;
            let k = rand_t((1, 1, 90, d), dtype, dev, 82)?;
            let v = rand_t((1, 1, 90, d), dtype, dev, 83)?;
            let streamed = AttentionOpts {
                mode: Mode::Streamed,
                q_chunk: Some(16),
                kv_chunk: Some(24),
                ..mask.opts()
            };
            let resident = AttentionOpts {
                mode: Mode::Resident,
                ..mask.opts()
            };
            let a = attention(&q, &k, &v, &streamed)?;
            let r = attention(&q, &k, &v, &resident)?;
            let err = rel_err_t(&a, &r)?;
            ensure!(
                err <= tol,
                "{dtype:?} {mask:?}: streamed vs resident {err:e}"
            );
            let (want, _) = reference_masked(&q, &k, &v, &mask, 1.0 / (d as f64).sqrt())?;
            let err = rel_err(&host_f64(&a)?, &want);
            ensure!(
                err <= tol,
                "{dtype:?} {mask:?}: streamed vs reference {err:e}"
            );
            let grads = |opts: &AttentionOpts| -> Result<Vec<Tensor>> {
                let vars = [
                    Var::from_tensor(&q)?,
                    Var::from_tensor(&k)?,
                    Var::from_tensor(&v)?,
                ];
                let o = attention(&vars[0], &vars[1], &vars[2], opts)?;
                let g = o.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
                vars.iter()
                    .map(|x| {
                        g.get(x.as_tensor())
                            .cloned()
                            .ok_or_else(|| anyhow::anyhow!("missing grad"))
                    })
                    .collect()
            };
            let gtol = if dtype == DType::F32 { 1e-4 } else { 5e-2 };
            for (x, y) in grads(&streamed)?.iter().zip(&grads(&resident)?) {
                let what = format!("{dtype:?} {mask:?}: streamed vs resident grads");
                ensure_close(&what, x, y, gtol)?;
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_masked_streamed_equals_resident);

/// Bad mask options: errors name the field and its value; a mask with a head
/// dim above the maximum names the head dim; head dims the tensor-core kernels
/// do not serve fall back to the simple kernels (checked above, d = 24, 40, 48).
fn attention_masks_reject_bad_input(dev: &Device) -> Result<()> {
    let q = Tensor::zeros((1, 2, 8, 16), DType::F32, dev)?;
    let kv = Tensor::zeros((1, 1, 8, 16), DType::F32, dev)?;
    for (cap, needle) in [
        (0.0, "softcap = 0"),
        (-1.0, "softcap = -1"),
        (f32::NAN, "softcap = NaN"),
        (f32::INFINITY, "softcap = inf"),
    ] {
        let opts = AttentionOpts {
            softcap: Some(cap),
            ..Default::default()
        };
        expect_err(attention(&q, &kv, &kv, &opts), &["softcap", needle])?;
    }
    let opts = AttentionOpts {
        causal: true,
        window_right: Some(3),
        ..Default::default()
    };
    expect_err(
        attention(&q, &kv, &kv, &opts),
        &["window_right = Some(3)", "causal"],
    )?;
    // causal with window_right = Some(0) is the same mask: accepted.
    let opts = AttentionOpts {
        causal: true,
        window_right: Some(0),
        window_left: Some(2),
        ..Default::default()
    };
    attention(&q, &kv, &kv, &opts)?;
    let opts = AttentionOpts {
        scale: Some(f64::NAN),
        window_left: Some(2),
        ..Default::default()
    };
    expect_err(attention(&q, &kv, &kv, &opts), &["scale", "NaN"])?;
    let qb = Tensor::zeros((1, 1, 4, 300), DType::F32, dev)?;
    let opts = AttentionOpts {
        window_left: Some(2),
        softcap: Some(5.0),
        ..Default::default()
    };
    expect_err(attention(&qb, &qb, &qb, &opts), &["head_dim", "300"])?;
    // The low-level op checks its scores too.
    let bad = cqsa::Scores {
        softcap: Some(-2.0),
        ..cqsa::Scores::dense(0.25)
    };
    match cqsa::attention_forward_with(&q, &kv, &kv, &bad) {
        Ok(_) => anyhow::bail!("softcap -2 accepted by attention_forward_with"),
        Err(e) => ensure!(e.to_string().contains("softcap = -2"), "{e}"),
    }
    Ok(())
}
candle_streamer::test_device!(attention_masks_reject_bad_input);

/// The planner counts only the chunk pairs a window sees, and predicts the
/// masked call's work (FLOPs per visible pair) rather than the dense call's.
fn estimate_counts_window_pairs(dev: &Device) -> Result<()> {
    let _ = dev;
    let shape = AttentionShape {
        b: 1,
        hq: 2,
        hkv: 2,
        nq: 4096,
        nk: 4096,
        d: 64,
        dtype: DType::BF16,
        causal: true,
    };
    let scores = cqsa::Scores::of(
        &Mask {
            causal: true,
            wl: Some(100),
            ..Default::default()
        }
        .opts(),
        &shape,
    )?;
    // Query i sees keys max(0, i - 100)..=i.
    let want: u64 = (0..4096u64).map(|i| i.min(100) + 1).sum();
    ensure!(
        scores.visible_pairs(4096, 4096) == want,
        "visible pairs {}",
        scores.visible_pairs(4096, 4096)
    );
    let dense = cqsa::Scores::of(&AttentionOpts::default(), &shape)?;
    ensure!(dense.visible_pairs(4096, 4096) == 4096 * 4096);
    // At N = 1M streamed, a causal window of 4096 sees a band of chunk pairs:
    // fewer subproblems and less predicted time than the causal call.
    let big = AttentionShape {
        nq: 1 << 20,
        nk: 1 << 20,
        hq: 16,
        hkv: 16,
        d: 128,
        ..shape
    };
    let budget = Budget {
        device_bytes: 4 << 30,
        host_bytes: 1 << 40,
    };
    let causal = cqsa::estimate_with(
        &big,
        &AttentionOpts {
            causal: true,
            ..Default::default()
        },
        &budget,
    )?;
    let window = AttentionOpts {
        causal: true,
        window_left: Some(4096),
        ..Default::default()
    };
    let windowed = cqsa::estimate_with(&big, &window, &budget)?;
    ensure!(
        causal.mode == Mode::Streamed && windowed.mode == Mode::Streamed,
        "{causal} / {windowed}"
    );
    // The predicted time shrinks less than the subproblem count: every query
    // chunk still moves in and out, window or not (on the H200 machine's plan
    // 63 against 528 subproblems gave 4.8 against 18.4 s).
    ensure!(
        windowed.subproblems * 4 < causal.subproblems
            && windowed.forward_seconds * 2.0 < causal.forward_seconds,
        "{windowed} vs {causal}"
    );
    // The plain estimate agrees with estimate_with for a causal call.
    ensure!(
        estimate(&big, &budget)? == causal,
        "estimate differs from estimate_with"
    );
    let bad = AttentionOpts {
        softcap: Some(-1.0),
        ..Default::default()
    };
    ensure!(
        cqsa::estimate_with(&big, &bad, &budget).is_err(),
        "softcap -1 accepted"
    );
    Ok(())
}
candle_streamer::test_device!(estimate_counts_window_pairs);

// ------------------------------------------------------------------ varlen
// Packed documents (`cu_seqlens_q`, `cu_seqlens_k`): against the f64 reference
// run document by document on slices, and Candle's naive attention over the
// whole packed row with a block-diagonal mask (autograd for gradients).

/// The document of position `x` under offsets `cu` (the last one containing it).
fn doc_of(cu: &[usize], x: usize) -> usize {
    (0..cu.len() - 1)
        .rfind(|&i| cu[i] <= x && x < cu[i + 1])
        .unwrap_or(0)
}

/// Packed attention with documents `cq` / `ck` and `mask` inside each, at head
/// dim `d`.
fn check_varlen(
    dev: &Device,
    (cq, ck): (&[usize], &[usize]),
    mask: &Mask,
    (dtype, d): (DType, usize),
    tol: f64,
) -> Result<()> {
    let (nq, nk) = (cq[cq.len() - 1], ck[ck.len() - 1]);
    let q = rand_t((1, 4, nq, d), dtype, dev, 91)?;
    let k = (rand_t((1, 2, nk, d), dtype, dev, 92)? * 2.0)?;
    let v = rand_t((1, 2, nk, d), dtype, dev, 93)?;
    let w = rand_t((1, 4, nq, d), DType::F32, dev, 94)?;
    let scale = 1.0 / (d as f64).sqrt();
    let opts = AttentionOpts {
        cu_seqlens_q: Some(cq.to_vec()),
        cu_seqlens_k: Some(ck.to_vec()),
        ..mask.opts()
    };
    let (vq, vk, vv) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let o = attention(vq.as_tensor(), vk.as_tensor(), vv.as_tensor(), &opts)?;
    ensure!(o.dims() == q.dims(), "shape {:?}", o.dims());
    // Reference: each document alone.
    let mut want = vec![0f64; 4 * nq * d];
    for i in 0..cq.len() - 1 {
        let (a, b) = (cq[i], cq[i + 1]);
        let (c, e) = (ck[i], ck[i + 1]);
        if b == a || e == c {
            continue; // no rows, or rows that see nothing: 0
        }
        let (part, _) = reference_masked(
            &q.narrow(2, a, b - a)?,
            &k.narrow(2, c, e - c)?,
            &v.narrow(2, c, e - c)?,
            mask,
            scale,
        )?;
        for h in 0..4 {
            for r in 0..b - a {
                for x in 0..d {
                    want[(h * nq + a + r) * d + x] = part[(h * (b - a) + r) * d + x];
                }
            }
        }
    }
    let err = rel_err(&host_f64(&o)?, &want);
    ensure!(
        err <= tol,
        "{dtype:?} varlen {cq:?} {mask:?}: error vs reference {err:e} > {tol:e}"
    );
    // Naive over the packed row: visible iff same document and the mask inside it.
    let visible = |i: usize, j: usize| {
        let (di, dj) = (doc_of(cq, i), doc_of(ck, j));
        di == dj
            && mask.visible(
                i - cq[di],
                j - ck[dj],
                cq[di + 1] - cq[di],
                ck[dj + 1] - ck[dj],
            )
    };
    let sees = |i: usize| (0..nk).any(|j| visible(i, j));
    if (0..nq).all(sees) {
        let f = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
        let (fq, fk, fv) = (f(&q)?, f(&k)?, f(&v)?);
        let on = naive_visible(
            fq.as_tensor(),
            fk.as_tensor(),
            fv.as_tensor(),
            &visible,
            mask.cap,
            scale,
        )?;
        let err = rel_err_t(&o, &on)?;
        ensure!(
            err <= tol,
            "{dtype:?} varlen {cq:?} {mask:?}: error vs naive {err:e}"
        );
        let g = (o.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
        let ng = (on * &w)?.sum_all()?.backward()?;
        let gtol = if dtype == DType::F32 { 1e-4 } else { 5e-2 };
        for (ours, theirs, name) in [(&vq, &fq, "dq"), (&vk, &fk, "dk"), (&vv, &fv, "dv")] {
            let a = g
                .get(ours.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no {name}"))?;
            let b = ng
                .get(theirs.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no naive {name}"))?;
            let err = rel_err_t(a, b)?;
            ensure!(
                err <= gtol,
                "{dtype:?} varlen {cq:?} {mask:?}: {name} error {err:e} > {gtol:e}"
            );
        }
    }
    Ok(())
}

/// Documents of length 1, tile multiples (64, 128) and not (37, 100), an empty
/// document; self-attention (equal offsets) and a cross-attention layout with a
/// document without keys; plain, causal, windowed and soft-capped.
fn attention_varlen_matches_reference_and_naive(dev: &Device) -> Result<()> {
    let same = [0, 1, 65, 65, 193, 230, 330];
    let masks = [
        Mask::default(),
        Mask {
            causal: true,
            ..Default::default()
        },
        Mask {
            causal: true,
            wl: Some(17),
            ..Default::default()
        },
        Mask {
            cap: Some(5.0),
            wl: Some(1),
            wr: Some(3),
            ..Default::default()
        },
    ];
    for (m, mask) in masks.iter().enumerate() {
        check_varlen(dev, (&same, &same), mask, (DType::F32, 64), 1e-5)?;
        if m % 2 == 1 {
            check_varlen(dev, (&same, &same), mask, (DType::BF16, 64), 2e-2)?;
        }
    }
    // Queries 37, 64, 1; keys 50, 0 (rows that see nothing), 20.
    let (cq, ck) = ([0, 37, 101, 102], [0, 50, 50, 70]);
    for mask in &masks[..2] {
        check_varlen(dev, (&cq, &ck), mask, (DType::F32, 64), 1e-5)?;
    }
    Ok(())
}
candle_streamer::test_device!(attention_varlen_matches_reference_and_naive);

/// The layout of a batched decode's packed kv cache (`streamer_models`'
/// `batch_kv`): each slot's used keys are a document with that sequence's new
/// rows (one row decoding, five for a prompt), the unused keys between slots
/// documents without queries. Causal, f32 and bf16 at head dims 64 and 128 (on
/// CUDA in bf16 one launch of the tensor-core kernels, on Hopper with and
/// without the Hopper kernels), against the f64 reference and naive attention.
fn attention_varlen_decode_layout(dev: &Device) -> Result<()> {
    let _switch = hold_hopper_switch();
    let default = cqsa::hopper_kernels_enabled();
    let _restore = HopperRestore(default);
    let (cq, ck) = ([0, 1, 1, 6, 6, 7, 7], [0, 17, 64, 69, 192, 232, 256]);
    let causal = Mask {
        causal: true,
        ..Default::default()
    };
    for hopper in [true, false] {
        cqsa::set_hopper_kernels(hopper);
        for d in [64, 128] {
            check_varlen(dev, (&cq, &ck), &causal, (DType::F32, d), 1e-5)?;
            check_varlen(dev, (&cq, &ck), &causal, (DType::BF16, d), 2e-2)
                .map_err(|e| anyhow::anyhow!("hopper kernels {hopper}: {e}"))?;
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_varlen_decode_layout);

/// Longer documents in bf16 at head dim 128, each several query and key blocks
/// with boundaries off the tiles, which CUDA runs as one launch of the
/// tensor-core kernels forward and backward: on a GPU of compute capability 9.0
/// once with the Hopper kernels and once with the portable ones (the switch
/// held, so that no other test flips it meanwhile). Against the f64 reference
/// and naive attention, plain, causal, windowed and soft-capped, and a
/// cross-attention layout with a document without keys; then
/// `attention_saved`'s backward against autograd on the same call, and a
/// batch of 2 against each of its rows alone.
fn attention_varlen_one_launch_matches_reference(dev: &Device) -> Result<()> {
    let _switch = hold_hopper_switch();
    let default = cqsa::hopper_kernels_enabled();
    let kernels: &[bool] = if dev.is_cuda() {
        &[true, false]
    } else {
        &[true]
    };
    for &hopper in kernels {
        cqsa::set_hopper_kernels(hopper);
        let _restore = HopperRestore(default);
        one_launch_checks(dev).map_err(|e| anyhow::anyhow!("hopper kernels {hopper}: {e}"))?;
    }
    Ok(())
}

/// The checks of [`attention_varlen_one_launch_matches_reference`].
fn one_launch_checks(dev: &Device) -> Result<()> {
    let same = [0, 300, 1000, 1000, 1129, 1700];
    let masks = [
        Mask::default(),
        Mask {
            causal: true,
            ..Default::default()
        },
        Mask {
            causal: true,
            wl: Some(200),
            cap: Some(20.0),
            ..Default::default()
        },
    ];
    // The CPU runs these documents one by one, as the other varlen tests
    // check: one mask there keeps CI's two cores quick.
    let masks = if dev.is_cuda() {
        &masks[..]
    } else {
        &masks[1..2]
    };
    for mask in masks {
        check_varlen(dev, (&same, &same), mask, (DType::BF16, 128), 2e-2)?;
    }
    if dev.is_cuda() {
        let (cq, ck) = ([0, 200, 456, 457], [0, 333, 333, 600]);
        check_varlen(dev, (&cq, &ck), &masks[1], (DType::BF16, 128), 2e-2)?;
    }
    // attention_saved: the same launch, its backward outside autograd.
    let q = rand_t((1, 4, 1700, 128), DType::BF16, dev, 71)?;
    let k = rand_t((1, 2, 1700, 128), DType::BF16, dev, 72)?;
    let v = rand_t((1, 2, 1700, 128), DType::BF16, dev, 73)?;
    let w = rand_t((1, 4, 1700, 128), DType::BF16, dev, 74)?;
    let opts = AttentionOpts {
        causal: true,
        cu_seqlens_q: Some(same.to_vec()),
        cu_seqlens_k: Some(same.to_vec()),
        ..Default::default()
    };
    saved_matches_autograd((&q, &k, &v), &w, &opts, 1e-2)?;
    one_launch_batches_match_rows(dev, &opts)
}

/// A packed call of batch 2 against the same call on each batch row alone
/// (output and the saved backward's gradients): the one launch's batch
/// indexing, which the checks at batch 1 do not reach.
fn one_launch_batches_match_rows(dev: &Device, opts: &AttentionOpts) -> Result<()> {
    let n = opts.cu_seqlens_q.as_ref().map_or(0, |c| c[c.len() - 1]);
    let q = rand_t((2, 4, n, 128), DType::BF16, dev, 81)?;
    let k = rand_t((2, 2, n, 128), DType::BF16, dev, 82)?;
    let v = rand_t((2, 2, n, 128), DType::BF16, dev, 83)?;
    let w = rand_t((2, 4, n, 128), DType::BF16, dev, 84)?;
    let (o, saved) = cqsa::attention_saved(&q, &k, &v, opts)?;
    let grads = saved.backward(&w)?;
    for b in 0..2 {
        let row = |t: &Tensor| t.narrow(0, b, 1);
        let (ob, sb) = cqsa::attention_saved(&row(&q)?, &row(&k)?, &row(&v)?, opts)?;
        let gb = sb.backward(&row(&w)?)?;
        let pairs = [
            ("o", &o, &ob),
            ("dq", &grads.0, &gb.0),
            ("dk", &grads.1, &gb.1),
            ("dv", &grads.2, &gb.2),
        ];
        for (name, all, alone) in pairs {
            let err = rel_err_t(&row(all)?, alone)?;
            ensure!(
                err <= 1e-2,
                "batch {b} {name}: {err:e} against the row alone"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(attention_varlen_one_launch_matches_reference);

/// Bad `cu_seqlens`: errors name the field and the value.
fn attention_varlen_rejects_bad_offsets(dev: &Device) -> Result<()> {
    let q = Tensor::zeros((1, 2, 10, 16), DType::F32, dev)?;
    let kv = Tensor::zeros((1, 1, 10, 16), DType::F32, dev)?;
    let run = |cq: Option<Vec<usize>>, ck: Option<Vec<usize>>| {
        attention(
            &q,
            &kv,
            &kv,
            &AttentionOpts {
                cu_seqlens_q: cq,
                cu_seqlens_k: ck,
                ..Default::default()
            },
        )
    };
    let ok = Some(vec![0, 4, 10]);
    expect_err(
        run(Some(vec![1, 4, 10]), ok.clone()),
        &["cu_seqlens_q", "start at 0", "= 1"],
    )?;
    expect_err(
        run(ok.clone(), Some(vec![0, 6, 4, 10])),
        &["cu_seqlens_k", "not decrease", "6", "4"],
    )?;
    expect_err(
        run(ok.clone(), Some(vec![0, 4, 9])),
        &["cu_seqlens_k", "sequence length 10", "got 9"],
    )?;
    expect_err(
        run(Some(vec![0, 10]), ok.clone()),
        &["1 documents", "2 documents"],
    )?;
    expect_err(run(ok.clone(), None), &["cu_seqlens_k None"])?;
    expect_err(run(Some(vec![0]), Some(vec![0])), &["at least 2 offsets"])?;
    run(ok.clone(), ok)?;
    Ok(())
}
candle_streamer::test_device!(attention_varlen_rejects_bad_offsets);

/// The doctor's kernel checks (every family the device runs, plain, causal,
/// windowed and soft-capped, forward and backward, against its f64 reference)
/// pass, and on CUDA cover the tensor-core, soft-capping and simple kernels,
/// and the Hopper kernels too (every case twice) where the GPU has them.
fn doctor_kernel_checks_pass(dev: &Device) -> Result<()> {
    let checks = cqsa::doctor::check_kernels(dev)?;
    let hopper = cqsa::hopper_kernels_available(dev)?;
    // 6 cases x 4 masks; with Hopper kernels, each of the 20 half-precision
    // checks runs twice.
    let want = if hopper { 24 + 20 } else { 24 };
    ensure!(checks.len() == want, "{} checks, want {want}", checks.len());
    for c in &checks {
        ensure!(c.ok(), "{}: error {:e} > {:e}", c.name, c.error, c.tol);
    }
    if dev.is_cuda() {
        for family in [
            "cuda tensor-core ",
            "cuda tensor-core softcap",
            "cuda simple",
        ] {
            ensure!(
                checks.iter().any(|c| c.name.starts_with(family)),
                "no {family} check"
            );
        }
        ensure!(
            checks
                .iter()
                .any(|c| c.name.starts_with("cuda hopper softcap"))
                == hopper,
            "Hopper checks present: {}, kernels available: {hopper}",
            !hopper
        );
    }
    Ok(())
}
candle_streamer::test_device!(doctor_kernel_checks_pass);
