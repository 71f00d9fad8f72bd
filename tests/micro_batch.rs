//! Many micro-batches per weight visit (`set_micro_batch_rows`): the same
//! loss and gradients as the whole batch at once, and the same bytes copied
//! to the device, where micro-batches run one after another copy them again.
use crate::fused_mlp::{host_mlp, rel_err};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use streamer_autograd::{ActivationPolicy, Train, TrainableSequential};
use streamer_core::{BlockSpec, StreamedSequential};
use streamer_models::fused_mlp;

const N: usize = 3;
const DIM: usize = 24;
const HIDDEN: usize = 40;

fn blocks(manual: bool) -> Vec<BlockSpec> {
    (0..N)
        .map(|i| {
            let name = format!("layers.{i}");
            if manual {
                BlockSpec::new(name, move |vb| fused_mlp(DIM, HIDDEN, vb))
            } else {
                BlockSpec::module(name, move |vb| fused_mlp(DIM, HIDDEN, vb))
            }
        })
        .collect()
}

fn model(
    host: &HashMap<String, Tensor>,
    manual: bool,
    dev: &Device,
) -> Result<TrainableSequential> {
    let cfg = crate::common::stream(dev, DType::F32, 1);
    Ok(StreamedSequential::from_tensors(host.clone(), blocks(manual), cfg)?.train())
}

/// A step's loss (sum over rows, so pieces add up), input gradient, weight
/// gradients and host-to-device bytes.
struct Step {
    loss: f32,
    g_x: Tensor,
    grads: HashMap<String, Tensor>,
    h2d: u64,
}

/// One forward and backward of `x` (or of each of `parts` row ranges in turn,
/// gradients accumulating) through `model`.
fn run(model: &TrainableSequential, x: &Tensor, parts: usize) -> Result<Step> {
    let before = model.stats()?.h2d_bytes;
    let rows = x.dim(0)? / parts;
    let (mut loss, mut g_x) = (0f32, Vec::new());
    for p in 0..parts {
        let xv = candle_core::Var::from_tensor(&x.narrow(0, p * rows, rows)?)?;
        let y = model.forward(xv.as_tensor())?;
        let l = y.sqr()?.sum_all()?;
        loss += l.to_scalar::<f32>()?;
        let g = model.backward(&l)?;
        g_x.push(g.get(xv.as_tensor()).expect("input gradient").clone());
        if p + 1 == parts {
            let grads = model
                .parameters()
                .into_iter()
                .map(|(n, v)| Ok((n, g.get(v.as_tensor()).expect("weight gradient").copy()?)))
                .collect::<Result<_>>()?;
            let h2d = model.stats()?.h2d_bytes - before;
            model.zero_grad()?;
            return Ok(Step {
                loss,
                g_x: Tensor::cat(&g_x, 0)?,
                grads,
                h2d,
            });
        }
    }
    unreachable!("parts >= 1")
}

fn same(got: &Step, want: &Step, what: &str) -> Result<()> {
    ensure!(
        ((got.loss - want.loss) / want.loss).abs() <= 1e-5,
        "{what}: loss {} vs {}",
        got.loss,
        want.loss
    );
    let e = rel_err(&got.g_x, &want.g_x)?;
    ensure!(e <= 1e-5, "{what}: input gradient off by {e:.2e}");
    for (name, w) in &want.grads {
        let e = rel_err(&got.grads[name], w)?;
        ensure!(e <= 1e-5, "{what}: {name} off by {e:.2e}");
    }
    Ok(())
}

/// Pieces of 1, 2, 3 (the last one shorter) and 4 rows of a 7-row batch, and
/// more rows than the batch, give the whole batch's loss and gradients (f32,
/// 1e-5 relative) for blocks with a hand-written backward (activations kept,
/// partly kept, recomputed, inputs offloaded) and for autograd blocks; every
/// block is loaded once in forward and once in backward whatever the pieces,
/// while the same pieces run one after another copy the weights each time.
fn pieces_equal_whole_batch(dev: &Device) -> Result<()> {
    let host = host_mlp(N, DIM, HIDDEN)?;
    let x = Tensor::randn(0f32, 1.0, (7, DIM), &Device::Cpu)?.to_device(dev)?;
    let policies = [
        ActivationPolicy::Keep {
            device_bytes: 1 << 30,
        },
        ActivationPolicy::Keep {
            device_bytes: 4 * DIM * HIDDEN * 4 * 3,
        },
        ActivationPolicy::Recompute,
        ActivationPolicy::OffloadInputs,
    ];
    for manual in [true, false] {
        let whole = run(&model(&host, manual, dev)?, &x, 1)?;
        for policy in policies {
            for rows in [1, 2, 3, 4, 9] {
                let m = model(&host, manual, dev)?;
                m.set_activation_policy(policy)?;
                m.set_micro_batch_rows(Some(rows))?;
                let got = run(&m, &x, 1)?;
                let what = format!("manual {manual}, {policy:?}, pieces of {rows}");
                same(&got, &whole, &what)?;
                ensure!(
                    got.h2d == whole.h2d,
                    "{what}: {} bytes copied up, {} for the whole batch",
                    got.h2d,
                    whole.h2d
                );
                ensure!(m.stats()?.loads == 2 * N as u64, "{what}: loads");
            }
        }
        // Seven single rows one after another: seven visits of every block.
        let m = model(&host, manual, dev)?;
        let one_by_one = run(&m, &x, 7)?;
        same(&one_by_one, &whole, "one row after another")?;
        ensure!(one_by_one.h2d == 7 * whole.h2d, "sequential copies");
    }
    Ok(())
}
candle_streamer::test_device!(pieces_equal_whole_batch);

/// Pieces of 0 rows are refused; the setting is kept and reported.
fn micro_batch_rows_setting(dev: &Device) -> Result<()> {
    let m = model(&host_mlp(N, DIM, HIDDEN)?, true, dev)?;
    ensure!(m.micro_batch_rows()?.is_none());
    let err = m.set_micro_batch_rows(Some(0)).unwrap_err().to_string();
    ensure!(err.contains("0 rows"), "{err}");
    m.set_micro_batch_rows(Some(3))?;
    ensure!(m.micro_batch_rows()? == Some(3));
    Ok(())
}
candle_streamer::test_device!(micro_batch_rows_setting);
