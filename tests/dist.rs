//! Multi-rank code on threads (`HostCollective`, world sizes 1 to 4) and, with
//! the `cuda` feature, NCCL at world size 1: collectives against their
//! definitions computed on one thread, ring attention against single-rank cqsa
//! on the unsplit sequence (f32: 1e-5 relative to the largest reference value),
//! data-parallel training against single-rank training on the concatenated
//! batch (f32: 1e-5 relative), and the failure cases (timeouts, aborts,
//! mismatched calls, bad batches): an error on every rank naming the rank and
//! the operation, nothing stepped, nothing written.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::linear;
use candle_streamer::streamer_autograd::{CpuSgd, ParamsSgd, Train};
use candle_streamer::streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
#[cfg(feature = "cuda")]
use candle_streamer::streamer_dist::NcclCollective;
use candle_streamer::streamer_dist::{
    ring_attention, Collective, DataParallel, GradReduction, HostCollective, RingOpts, SeqSplit,
};
use cqsa::AttentionOpts;

const TOL: f64 = 1e-5;

/// Runs `f` on every rank, one thread each; results in rank order.
fn on_ranks<C: Sync, T: Send>(
    ranks: &[C],
    f: impl Fn(&C) -> candle_core::Result<T> + Sync,
) -> Vec<candle_core::Result<T>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// [`on_ranks`], which must return within 10 s (a failed or absent rank
/// releases the others).
fn on_ranks_promptly<C: Sync, T: Send>(
    ranks: &[C],
    f: impl Fn(&C) -> candle_core::Result<T> + Sync,
) -> Vec<candle_core::Result<T>> {
    let t = Instant::now();
    let out = on_ranks(ranks, f);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    out
}

/// Asserts that rank `r`'s result in `out` is an error naming the rank, the
/// collective `op` and every one of `more`.
fn assert_rank_failed<T>(out: &[candle_core::Result<T>], r: usize, op: &str, more: &[&str]) {
    let Err(e) = &out[r] else {
        panic!("rank {r}'s {op} must fail")
    };
    let e = e.to_string();
    assert!(e.contains(&format!("rank {r}")) && e.contains(op), "{e}");
    for m in more {
        assert!(e.contains(m), "{e}");
    }
}

fn all_ok<T>(v: Vec<candle_core::Result<T>>) -> Result<Vec<T>> {
    Ok(v.into_iter().collect::<candle_core::Result<Vec<_>>>()?)
}

/// `max |a - b| / max |b|` (the largest reference value as the scale).
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (
        a.to_dtype(DType::F64)?.to_device(&Device::Cpu)?,
        b.to_dtype(DType::F64)?.to_device(&Device::Cpu)?,
    );
    assert_eq!(a.dims(), b.dims());
    let diff = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    let scale = b.abs()?.max_all()?.to_scalar::<f64>()?.max(1e-30);
    Ok(diff / scale)
}

fn assert_rel(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    let e = rel_err(a, b)?;
    assert!(e <= TOL, "{what}: relative error {e:e} over {TOL:e}");
    Ok(())
}

fn host_collectives_match_definitions_impl(world: usize) -> Result<()> {
    let xs: Vec<Tensor> = (0..world)
        .map(|_| Tensor::randn(0f32, 1.0, (2 * world, 3), &Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    let mut sum = xs[0].clone();
    for x in &xs[1..] {
        sum = (sum + x)?;
    }
    let gathered = Tensor::cat(&xs, 0)?;
    let ranks = HostCollective::group(world, Duration::from_secs(30))?;
    let out = all_ok(on_ranks(&ranks, |c| {
        let x = &xs[c.rank()];
        c.barrier()?;
        Ok((
            c.all_reduce_sum(x)?,
            c.reduce_scatter_sum(x)?,
            c.all_gather(x)?,
            c.ring_shift(x)?,
        ))
    }))?;
    for (r, (ar, rs, ag, ring)) in out.iter().enumerate() {
        assert_rel(ar, &sum, &format!("all_reduce_sum rank {r}"))?;
        assert_rel(
            rs,
            &sum.narrow(0, 2 * r, 2)?,
            &format!("reduce_scatter_sum rank {r}"),
        )?;
        assert_rel(ag, &gathered, &format!("all_gather rank {r}"))?;
        assert_rel(
            ring,
            &xs[(r + world - 1) % world],
            &format!("ring_shift rank {r}"),
        )?;
    }
    Ok(())
}

#[test]
fn host_collectives_match_definitions_world_1_to_4() -> Result<()> {
    for world in 1..=4 {
        host_collectives_match_definitions_impl(world)?;
    }
    Ok(())
}

#[test]
fn host_collective_timeout_names_rank_op_and_missing_ranks() -> Result<()> {
    let ranks = HostCollective::group(3, Duration::from_millis(300))?;
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let out = on_ranks_promptly(&ranks, |c| {
        if c.rank() == 2 {
            Ok(None)
        } else {
            c.all_reduce_sum(&x).map(Some)
        }
    });
    // The ranks waiting for rank 2 fail.
    for r in 0..2 {
        assert_rank_failed(&out, r, "all_reduce_sum", &["timed out", "[2]"]);
    }
    // Rank 2 arrives late: the group has failed, it is told so at once.
    let e = ranks[2].all_reduce_sum(&x).unwrap_err().to_string();
    assert!(e.contains("rank 2") && e.contains("failed earlier"), "{e}");
    Ok(())
}

#[test]
fn host_collective_abort_reaches_every_waiting_rank() -> Result<()> {
    let ranks = HostCollective::group(3, Duration::from_secs(60))?;
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let out = on_ranks_promptly(&ranks, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            c.abort("out of memory in block 3");
            return Ok(());
        }
        c.all_gather(&x).map(|_| ())
    });
    for r in [0, 2] {
        let why = "rank 1 failed: out of memory in block 3";
        assert_rank_failed(&out, r, "all_gather", &[why]);
    }
    Ok(())
}

#[test]
fn host_collective_mismatched_calls_fail_every_rank() -> Result<()> {
    let ranks = HostCollective::group(2, Duration::from_secs(60))?;
    let out = on_ranks(&ranks, |c| {
        let x = Tensor::ones(3 + c.rank(), DType::F32, &Device::Cpu)?;
        c.all_reduce_sum(&x).map(|_| ())
    });
    for o in &out {
        let e = o.as_ref().unwrap_err().to_string();
        assert!(e.contains("all_reduce_sum") && e.contains("shape"), "{e}");
    }
    let ranks = HostCollective::group(2, Duration::from_secs(60))?;
    let x = Tensor::ones(4, DType::F32, &Device::Cpu)?;
    let out = on_ranks(&ranks, |c| {
        if c.rank() == 0 {
            c.all_gather(&x)
        } else {
            c.ring_shift(&x)
        }
    });
    assert!(out.iter().all(|o| o
        .as_ref()
        .is_err_and(|e| e.to_string().contains("another rank called"))));
    // Scatter of a dim 0 that does not split: refused before any exchange.
    let e = ranks[0]
        .reduce_scatter_sum(&Tensor::ones(3, DType::F32, &Device::Cpu)?)
        .unwrap_err();
    assert!(
        e.to_string().contains("not divisible by the world size 2"),
        "{e}"
    );
    Ok(())
}

/// Ring attention of every rank against cqsa on the whole sequence: outputs
/// and the gradients of q, k, v under a random output weighting.
fn ring_matches_cqsa(world: usize, opts: &RingOpts, colls: &[Arc<dyn Collective>]) -> Result<()> {
    ring_matches_cqsa_in(world, opts, colls, DType::F32, TOL)
}

/// [`ring_matches_cqsa`] with the ring in `dtype` against f32 cqsa on the same
/// (rounded) inputs, within `tol` relative.
fn ring_matches_cqsa_in(
    world: usize,
    opts: &RingOpts,
    colls: &[Arc<dyn Collective>],
    dtype: DType,
    tol: f64,
) -> Result<()> {
    let dev = colls[0].device().clone();
    let (b, hq, hkv, n, d) = (2, 4, 2, 24, 8);
    let rounded = |t: Tensor| -> candle_core::Result<Var> {
        Var::from_tensor(&t.to_dtype(dtype)?.to_dtype(DType::F32)?)
    };
    let q = rounded(Tensor::randn(0f32, 1.0, (b, hq, n, d), &dev)?)?;
    let k = rounded(Tensor::randn(0f32, 1.0, (b, hkv, n, d), &dev)?)?;
    let v = rounded(Tensor::randn(0f32, 1.0, (b, hkv, n, d), &dev)?)?;
    let w = Tensor::randn(0f32, 1.0, (b, hq, n, d), &dev)?;
    let copts = AttentionOpts {
        causal: opts.causal,
        scale: opts.scale,
        softcap: opts.softcap,
        ..Default::default()
    };
    let o = cqsa::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &copts)?;
    let g = (&o * &w)?.sum_all()?.backward()?;
    let want = [
        o.clone(),
        g.get(&q).unwrap().clone(),
        g.get(&k).unwrap().clone(),
        g.get(&v).unwrap().clone(),
    ];
    let split = opts.split;
    let parts = all_ok(on_ranks(colls, |c| {
        let r = c.rank();
        let shard = |t: &Tensor| split.shard(&t.to_dtype(dtype)?, 2, r, world);
        let (qs, ks, vs) = (
            Var::from_tensor(&shard(&q)?)?,
            Var::from_tensor(&shard(&k)?)?,
            Var::from_tensor(&shard(&v)?)?,
        );
        let o = ring_attention(
            qs.as_tensor(),
            ks.as_tensor(),
            vs.as_tensor(),
            c.clone(),
            opts,
        )?;
        let g = (&o * shard(&w)?)?.sum_all()?.backward()?;
        let get = |x: &Var| {
            g.get(x)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg("no grad".into()))
        };
        Ok([o, get(&qs)?, get(&ks)?, get(&vs)?])
    }))?;
    for (i, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
        let mine: Vec<Tensor> = parts.iter().map(|p| p[i].clone()).collect();
        let got = split.unshard(&mine, 2)?;
        let e = rel_err(&got, &want[i])?;
        assert!(
            e <= tol,
            "world {world} {opts:?} {dtype:?}: {what} relative error {e:e} over {tol:e}"
        );
    }
    Ok(())
}

#[test]
fn ring_attention_equals_cqsa_world_1_to_4() -> Result<()> {
    for world in 1..=4 {
        let colls: Vec<Arc<dyn Collective>> =
            HostCollective::group(world, Duration::from_secs(60))?
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Collective>)
                .collect();
        for (causal, split) in [
            (true, SeqSplit::ZigZag),
            (false, SeqSplit::ZigZag),
            (true, SeqSplit::Contiguous),
        ] {
            ring_matches_cqsa(
                world,
                &RingOpts {
                    causal,
                    split,
                    ..Default::default()
                },
                &colls,
            )?;
        }
        let capped = RingOpts {
            causal: true,
            softcap: Some(2.0),
            scale: Some(0.5),
            ..Default::default()
        };
        ring_matches_cqsa(world, &capped, &colls)?;
    }
    Ok(())
}

/// bf16 ring attention: every partial output is rounded to bf16 before its
/// merge, so against f32 cqsa on the same inputs: 2e-2 relative (stated).
#[test]
fn ring_attention_bf16_within_stated_tolerance() -> Result<()> {
    for world in [2, 3] {
        let colls: Vec<Arc<dyn Collective>> =
            HostCollective::group(world, Duration::from_secs(60))?
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Collective>)
                .collect();
        let opts = RingOpts {
            causal: true,
            ..Default::default()
        };
        ring_matches_cqsa_in(world, &opts, &colls, DType::BF16, 2e-2)?;
    }
    Ok(())
}

#[test]
fn zigzag_split_balances_and_round_trips() -> Result<()> {
    assert_eq!(SeqSplit::ZigZag.chunks(16, 1, 4)?, vec![(2, 2), (12, 2)]);
    let x = Tensor::arange(0u32, 24, &Device::Cpu)?.reshape((1, 1, 24, 1))?;
    let parts: Vec<Tensor> = (0..3)
        .map(|r| SeqSplit::ZigZag.shard(&x, 2, r, 3))
        .collect::<candle_core::Result<_>>()?;
    assert_eq!(
        parts[0].flatten_all()?.to_vec1::<u32>()?,
        vec![0, 1, 2, 3, 20, 21, 22, 23]
    );
    assert_eq!(
        SeqSplit::ZigZag
            .unshard(&parts, 2)?
            .flatten_all()?
            .to_vec1::<u32>()?,
        (0..24).collect::<Vec<_>>()
    );
    let e = SeqSplit::ZigZag.chunks(10, 0, 2).unwrap_err().to_string();
    assert!(e.contains("10 rows") && e.contains("4 equal"), "{e}");
    Ok(())
}

#[test]
fn ring_attention_refuses_a_local_length_that_does_not_split() -> Result<()> {
    let c: Arc<dyn Collective> =
        Arc::new(HostCollective::group(1, Duration::from_secs(5))?.remove(0));
    let q = Tensor::zeros((1, 1, 3, 4), DType::F32, &Device::Cpu)?;
    let e = ring_attention(&q, &q, &q, c, &RingOpts::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 rows") && e.contains("ZigZag"), "{e}");
    Ok(())
}

/// A second backward through one ring call is refused (every rank would have
/// to repeat it), with the rank named; the first one gives gradients.
#[test]
fn ring_attention_refuses_a_second_backward() -> Result<()> {
    let c: Arc<dyn Collective> =
        Arc::new(HostCollective::group(1, Duration::from_secs(5))?.remove(0));
    let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 8, 4), &Device::Cpu)?)?;
    let o = ring_attention(
        q.as_tensor(),
        q.as_tensor(),
        q.as_tensor(),
        c,
        &RingOpts::default(),
    )?;
    let loss = o.sum_all()?;
    let g = loss.backward()?;
    let dq = g.get(q.as_tensor()).expect("a gradient of q");
    ensure!(
        dq.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0,
        "zero gradient"
    );
    let e = loss.backward().unwrap_err().to_string();
    ensure!(
        e.contains("backward ran twice") && e.contains("rank 0"),
        "{e}"
    );
    Ok(())
}

const WIDTH: usize = 8;

fn mlp_weights(blocks: usize) -> Result<HashMap<String, Tensor>> {
    let mut w = HashMap::new();
    for i in 0..blocks {
        w.insert(
            format!("b{i}.weight"),
            (Tensor::randn(0f32, 1.0, (WIDTH, WIDTH), &Device::Cpu)? * 0.4)?,
        );
        w.insert(
            format!("b{i}.bias"),
            (Tensor::randn(0f32, 1.0, WIDTH, &Device::Cpu)? * 0.1)?,
        );
    }
    Ok(w)
}

fn mlp(
    weights: &HashMap<String, Tensor>,
    blocks: usize,
    dev: &Device,
) -> Result<StreamedSequential> {
    let specs = (0..blocks)
        .map(|i| BlockSpec::module(format!("b{i}"), |vb| linear(WIDTH, WIDTH, vb)))
        .collect();
    let cfg = StreamConfig {
        device: dev.clone(),
        ..Default::default()
    };
    Ok(StreamedSequential::from_tensors(
        weights.clone(),
        specs,
        cfg,
    )?)
}

/// A mean loss with a nonlinearity, so the gradient depends on the batch rows.
fn loss(y: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
    (y.tanh()? - t)?.sqr()?.mean_all()
}

fn sgd() -> ParamsSgd {
    ParamsSgd {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    }
}

/// The reference: one model, the whole batch, three SGD steps.
fn single_rank_training(
    weights: &HashMap<String, Tensor>,
    x: &Tensor,
    t: &Tensor,
    dev: &Device,
) -> Result<Vec<Tensor>> {
    let model = mlp(weights, 3, dev)?.train();
    let mut opt = CpuSgd::new(model.trainable_vars()?, sgd())?;
    for _ in 0..3 {
        let l = loss(&model.forward(&x.to_device(dev)?)?, &t.to_device(dev)?)?;
        opt.step(&model.backward(&l)?)?;
        model.zero_grad()?;
    }
    Ok(model
        .parameters()
        .into_iter()
        .map(|(_, v)| v.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?)
}

fn data_parallel_matches(colls: Vec<Arc<dyn Collective>>, dev: &Device) -> Result<()> {
    data_parallel_matches_with(colls, dev, None)
}

/// Data-parallel training (gradient buckets of `bucket` elements, or the
/// default) against [`single_rank_training`] on the whole batch.
fn data_parallel_matches_with(
    colls: Vec<Arc<dyn Collective>>,
    dev: &Device,
    bucket: Option<usize>,
) -> Result<()> {
    let world = colls.len();
    let weights = mlp_weights(3)?;
    let x = Tensor::randn(0f32, 1.0, (12, WIDTH), &Device::Cpu)?;
    let t = Tensor::randn(0f32, 0.5, (12, WIDTH), &Device::Cpu)?;
    let want = single_rank_training(&weights, &x, &t, dev)?;
    let mut dp = DataParallel::new(mlp(&weights, 3, dev)?, colls, GradReduction::Mean)?;
    if let Some(b) = bucket {
        dp.set_bucket_elems(b)?;
    }
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    for _ in 0..3 {
        let rep = dp.step(&x, &t, |_, y, t| loss(y, t), &mut opt)?;
        assert_eq!(rep.losses.len(), world);
    }
    let got = dp.replica(0).parameters();
    assert_eq!(got.len(), want.len());
    for ((name, g), w) in got.iter().zip(&want) {
        let e = rel_err(g.as_tensor(), w)?;
        assert!(
            e <= TOL,
            "world {world}: {name} relative error {e:e} over {TOL:e}"
        );
    }
    // One copy of the weights: every replica's masters are rank 0's.
    for r in 1..world {
        for ((_, a), (_, b)) in got.iter().zip(dp.replica(r).parameters()) {
            assert_eq!(a.as_tensor().id(), b.as_tensor().id());
        }
    }
    Ok(())
}

#[test]
fn data_parallel_equals_single_rank_on_the_whole_batch_world_1_to_4() -> Result<()> {
    for world in [1, 2, 3, 4] {
        let colls = HostCollective::group(world, Duration::from_secs(60))?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Collective>)
            .collect();
        data_parallel_matches(colls, &Device::Cpu)?;
    }
    // Buckets of 80 elements: a block's weight (64) and bias (8) share one.
    let colls = HostCollective::group(3, Duration::from_secs(60))?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    data_parallel_matches_with(colls, &Device::Cpu, Some(80))?;
    Ok(())
}

fn dp_of(world: usize, timeout: Duration) -> Result<(DataParallel, HashMap<String, Tensor>)> {
    let weights = mlp_weights(2)?;
    let colls = HostCollective::group(world, timeout)?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    Ok((
        DataParallel::new(mlp(&weights, 2, &Device::Cpu)?, colls, GradReduction::Mean)?,
        weights,
    ))
}

fn masters(dp: &DataParallel) -> Result<Vec<Vec<f32>>> {
    Ok(dp
        .replica(0)
        .parameters()
        .iter()
        .map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1::<f32>())
        .collect::<candle_core::Result<_>>()?)
}

#[test]
fn data_parallel_refuses_a_batch_that_does_not_split() -> Result<()> {
    let (dp, _) = dp_of(4, Duration::from_secs(60))?;
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    let before = masters(&dp)?;
    let x = Tensor::zeros((6, WIDTH), DType::F32, &Device::Cpu)?;
    let e = dp
        .step(&x, &x, |_, y, t| loss(y, t), &mut opt)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("batch of 6 rows") && e.contains("world size 4"),
        "{e}"
    );
    assert_eq!(masters(&dp)?, before);
    assert_eq!(opt.step_count(), 0);
    Ok(())
}

#[test]
fn data_parallel_rank_failure_errors_everywhere_and_writes_nothing() -> Result<()> {
    let (dp, _) = dp_of(3, Duration::from_secs(60))?;
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    let x = Tensor::randn(0f32, 1.0, (6, WIDTH), &Device::Cpu)?;
    dp.step(&x, &x, |_, y, t| loss(y, t), &mut opt)?;
    let before = masters(&dp)?;
    let t0 = Instant::now();
    let e = dp
        .step(
            &x,
            &x,
            |r, y, t| {
                if r == 2 {
                    candle_core::bail!("injected failure")
                } else {
                    loss(y, t)
                }
            },
            &mut opt,
        )
        .unwrap_err()
        .to_string();
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "failure took {:?}",
        t0.elapsed()
    );
    assert!(
        e.contains("rank 2 failed: injected failure") && e.contains("nothing was stepped"),
        "{e}"
    );
    assert_eq!(masters(&dp)?, before, "a failed step changed the weights");
    assert_eq!(opt.step_count(), 1);
    let dir = std::env::temp_dir().join(format!("dist-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let e = dp.save(&dir, &opt).unwrap_err().to_string();
    assert!(
        e.contains("not saving") && e.contains("injected failure"),
        "{e}"
    );
    assert!(!dir.exists(), "a failed group wrote {dir:?}");
    let e = dp
        .step(&x, &x, |_, y, t| loss(y, t), &mut opt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("failed in an earlier step"), "{e}");
    Ok(())
}

#[test]
fn data_parallel_panicking_rank_fails_the_step_at_once() -> Result<()> {
    let (dp, _) = dp_of(3, Duration::from_secs(120))?;
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    let before = masters(&dp)?;
    let x = Tensor::randn(0f32, 1.0, (6, WIDTH), &Device::Cpu)?;
    let t0 = Instant::now();
    let boom = |r: usize, y: &Tensor, t: &Tensor| {
        if r == 1 {
            panic!("injected panic");
        }
        loss(y, t)
    };
    let e = dp.step(&x, &x, boom, &mut opt).unwrap_err().to_string();
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t0.elapsed()
    );
    assert!(e.contains("rank 1 panicked"), "{e}");
    assert_eq!(masters(&dp)?, before);
    Ok(())
}

#[test]
fn data_parallel_stalled_rank_times_out_instead_of_hanging() -> Result<()> {
    let (dp, _) = dp_of(2, Duration::from_millis(300))?;
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    let before = masters(&dp)?;
    let x = Tensor::randn(0f32, 1.0, (4, WIDTH), &Device::Cpu)?;
    let stall = |r: usize, y: &Tensor, t: &Tensor| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        loss(y, t)
    };
    let e = dp.step(&x, &x, stall, &mut opt).unwrap_err().to_string();
    assert!(
        e.contains("timed out") && e.contains("all_reduce_sum"),
        "{e}"
    );
    assert_eq!(masters(&dp)?, before);
    Ok(())
}

#[test]
fn data_parallel_checkpoint_resumes_on_another_world_size() -> Result<()> {
    let (dp, weights) = dp_of(2, Duration::from_secs(60))?;
    let mut opt = CpuSgd::new(dp.trainable_vars()?, sgd())?;
    let x = Tensor::randn(0f32, 1.0, (4, WIDTH), &Device::Cpu)?;
    dp.step(&x, &x, |_, y, t| loss(y, t), &mut opt)?;
    let dir = std::env::temp_dir().join(format!("dist-resume-{}", std::process::id()));
    dp.save(&dir, &opt)?;
    dp.step(&x, &x, |_, y, t| loss(y, t), &mut opt)?;
    // Resume on one plain (single-device) model: the same next step.
    let specs = (0..2)
        .map(|i| BlockSpec::module(format!("b{i}"), |vb| linear(WIDTH, WIDTH, vb)))
        .collect();
    let one = StreamedSequential::from_safetensors(
        &[dir.join("model.safetensors")],
        specs,
        StreamConfig::default(),
    )?
    .train();
    let mut opt1 = CpuSgd::new(one.trainable_vars()?, sgd())?;
    opt1.load(dir.join("optimizer.safetensors"))?;
    let l = loss(&one.forward(&x)?, &x)?;
    opt1.step(&one.backward(&l)?)?;
    for ((n, a), (_, b)) in one.parameters().iter().zip(dp.replica(0).parameters()) {
        let e = rel_err(a.as_tensor(), b.as_tensor())?;
        assert!(
            e <= TOL,
            "{n}: resumed on 1 rank vs 2 ranks, relative error {e:e}"
        );
    }
    drop(weights);
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn data_parallel_checks_its_collectives() -> Result<()> {
    let weights = mlp_weights(1)?;
    let mut colls: Vec<Arc<dyn Collective>> = HostCollective::group(2, Duration::from_secs(5))?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect();
    colls.swap(0, 1);
    let e = DataParallel::new(mlp(&weights, 1, &Device::Cpu)?, colls, GradReduction::Sum)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("collectives[0] is rank 1 of 2"), "{e}");
    Ok(())
}

#[cfg(feature = "cuda")]
fn one() -> Result<Vec<Arc<dyn Collective>>> {
    Ok(NcclCollective::with_world_size(1, Duration::from_secs(60))?
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Collective>)
        .collect())
}

/// World size 1 through NCCL on one GPU: every collective against its
/// definition (the identity, a copy), ring attention against cqsa on the
/// same GPU, data-parallel training against the single-device model.
#[cfg(feature = "cuda")]
#[test]
fn nccl_world_size_one() -> Result<()> {
    let colls = one()?;
    let c = &colls[0];
    let dev = c.device().clone();
    for dtype in [DType::F32, DType::BF16] {
        let x = Tensor::randn(0f32, 1.0, (4, 3), &dev)?.to_dtype(dtype)?;
        for (name, y) in [
            ("all_reduce_sum", c.all_reduce_sum(&x)?),
            ("reduce_scatter_sum", c.reduce_scatter_sum(&x)?),
            ("all_gather", c.all_gather(&x)?),
            ("ring_shift", c.ring_shift(&x)?),
        ] {
            assert_eq!(y.dims(), x.dims(), "{name}");
            assert_eq!(rel_err(&y, &x)?, 0.0, "{name} {dtype:?}");
        }
    }
    // A strided input is made contiguous first.
    let x = Tensor::randn(0f32, 1.0, (3, 4), &dev)?.t()?;
    assert_eq!(rel_err(&c.all_reduce_sum(&x)?, &x)?, 0.0);
    c.barrier()?;
    let e = c
        .all_reduce_sum(&Tensor::ones(2, DType::F32, &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0") && e.contains("all_reduce_sum"), "{e}");
    ring_matches_cqsa(
        1,
        &RingOpts {
            causal: true,
            ..Default::default()
        },
        &colls,
    )?;
    // DataParallel over a fresh group: the model goes on its rank 0's device.
    let group = one()?;
    let dev0 = group[0].device().clone();
    data_parallel_matches(group, &dev0)?;
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn nccl_world_size_larger_than_visible_gpus_is_an_error() -> Result<()> {
    let visible = NcclCollective::visible_gpus()?;
    let e = NcclCollective::with_world_size(visible + 1, Duration::from_secs(5))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!("world size {}", visible + 1))
            && e.contains(&format!("{visible} visible")),
        "{e}"
    );
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn nccl_abort_fails_later_calls() -> Result<()> {
    let colls = one()?;
    colls[0].abort("test abort");
    let x = Tensor::ones(4, DType::F32, colls[0].device())?;
    let e = colls[0].all_reduce_sum(&x).unwrap_err().to_string();
    assert!(e.contains("rank 0 failed: test abort"), "{e}");
    Ok(())
}
