//! `FusedMlp`'s hand-written backward (four cuBLASLt GEMMs with GELU' and the
//! bias gradients in their epilogues on CUDA) against Candle autograd in f64,
//! and streamed training through it with activations kept or recomputed
//! against the same blocks trained through Candle autograd.
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use streamer_autograd::{ActivationPolicy, Train};
use streamer_core::{Block, BlockSpec, ManualBackward, StreamConfig, StreamedSequential};
use streamer_models::{fused_mlp, FusedMlp};

pub(crate) use crate::common::{ensure_close, expect_err, rel_err};

pub(crate) fn mlp_weights(
    dim: usize,
    hidden: usize,
    dev: &Device,
    dt: DType,
) -> Result<[Tensor; 4]> {
    let r = |s: &[usize], std: f32| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, s, &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(dev)?)
    };
    Ok([
        r(&[hidden, dim], 0.15)?,
        r(&[hidden], 0.5)?,
        r(&[dim, hidden], 0.1)?,
        r(&[dim], 0.5)?,
    ])
}

fn fused_mlp_manual_backward_matches_f64_autograd(dev: &Device) -> Result<()> {
    // Odd row count and a rank-3 input; sizes multiples of 8 (cuBLASLt's
    // epilogue buffers want aligned leading dimensions).
    let (b, t, dim, hidden) = (3, 37, 64, 136);
    for (dt, tol) in [(DType::F32, 2e-5), (DType::BF16, 3e-2), (DType::F16, 5e-3)] {
        let [w1, b1, w2, b2] = mlp_weights(dim, hidden, dev, dt)?;
        let x = Tensor::randn(0f32, 1.0, (b, t, dim), &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(dev)?;
        let g = Tensor::randn(0f32, 1.0, (b, t, dim), &Device::Cpu)?
            .to_dtype(dt)?
            .to_device(dev)?;
        // Reference: the same (rounded) values in f64 on the CPU, Candle autograd.
        let f64v = |t: &Tensor| -> Result<Var> {
            Ok(Var::from_tensor(
                &t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?,
            )?)
        };
        let (rx, rw1, rb1, rw2, rb2) = (f64v(&x)?, f64v(&w1)?, f64v(&b1)?, f64v(&w2)?, f64v(&b2)?);
        let h = rx
            .broadcast_matmul(&rw1.t()?)?
            .broadcast_add(&rb1)?
            .gelu()?;
        let y_ref = h.broadcast_matmul(&rw2.t()?)?.broadcast_add(&rb2)?;
        let grads = (&y_ref * g.to_dtype(DType::F64)?.to_device(&Device::Cpu)?)?
            .sum_all()?
            .backward()?;

        let mlp = FusedMlp::new(w1.clone(), b1.clone(), w2.clone(), b2.clone())?;
        let (y, saved) = mlp.forward_train(&x, &[])?;
        let where_ = format!("{dt:?} on {:?}", dev.location());
        let err = rel_err(&y, &y_ref)?;
        ensure!(err <= tol, "output {where_}: {err:.2e} > {tol:.0e}");
        // The inference forward (two FusedLinear ops) agrees too.
        let err = rel_err(&Module::forward(&mlp, &x)?, &y_ref)?;
        ensure!(
            err <= tol,
            "inference output {where_}: {err:.2e} > {tol:.0e}"
        );
        let (dx, wgrads) = mlp.backward(saved, &g)?;
        ensure!(dx.dims() == x.dims(), "dx {:?}", dx.dims());
        let err = rel_err(&dx, grads.get(&rx).expect("dx"))?;
        ensure!(err <= tol, "dx {where_}: {err:.2e} > {tol:.0e}");
        let refs = [
            ("up.weight", &w1, &rw1),
            ("up.bias", &b1, &rb1),
            ("down.weight", &w2, &rw2),
            ("down.bias", &b2, &rb2),
        ];
        ensure!(wgrads.len() == 4, "{} weight gradients", wgrads.len());
        for (name, w, rv) in refs {
            let (_, got) = wgrads
                .iter()
                .find(|(p, _)| p.id() == w.id())
                .ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
            ensure!(
                got.dims() == w.dims() && got.dtype() == dt,
                "{name}: {:?} {:?}",
                got.dims(),
                got.dtype()
            );
            let err = rel_err(got, grads.get(rv).expect("reference"))?;
            ensure!(err <= tol, "grad of {name} {where_}: {err:.2e} > {tol:.0e}");
        }
    }
    Ok(())
}
candle_streamer::test_device!(fused_mlp_manual_backward_matches_f64_autograd);

fn fused_mlp_rejects_bad_input(dev: &Device) -> Result<()> {
    let [w1, b1, w2, b2] = mlp_weights(8, 16, dev, DType::F32)?;
    let err = FusedMlp::new(w1.clone(), b1.clone(), w2.t()?, b2.clone())
        .expect_err("transposed down.weight");
    ensure!(
        err.to_string().contains("down.weight must be [8, 16]"),
        "{err}"
    );
    let err = FusedMlp::new(w1.clone(), b1.to_dtype(DType::F64)?, w2.clone(), b2.clone())
        .expect_err("f64 bias");
    ensure!(
        err.to_string().contains("up.bias") && err.to_string().contains("F64"),
        "{err}"
    );
    let mlp = FusedMlp::new(w1, b1, w2, b2)?;
    let err = mlp
        .forward_train(&Tensor::zeros((2, 9), DType::F32, dev)?, &[])
        .expect_err("wrong width");
    ensure!(err.to_string().contains("must end in 8"), "{err}");
    let (_, saved) = mlp.forward_train(&Tensor::zeros((2, 8), DType::F32, dev)?, &[])?;
    let err = mlp
        .backward(saved, &Tensor::zeros((3, 8), DType::F32, dev)?)
        .expect_err("wrong grad");
    ensure!(err.to_string().contains("output gradient [3, 8]"), "{err}");
    Ok(())
}
candle_streamer::test_device!(fused_mlp_rejects_bad_input);

/// Host weights of `n` MLP blocks `layers.{i}.{up,down}.{weight,bias}`.
pub(crate) fn host_mlp(n: usize, dim: usize, hidden: usize) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    for i in 0..n {
        let [w1, b1, w2, b2] = mlp_weights(dim, hidden, &Device::Cpu, DType::F32)?;
        for (k, t) in [
            ("up.weight", w1),
            ("up.bias", b1),
            ("down.weight", w2),
            ("down.bias", b2),
        ] {
            m.insert(format!("layers.{i}.{k}"), t);
        }
    }
    Ok(m)
}

/// One training step's loss and every weight's host gradient, by name.
fn step_grads(
    host: &HashMap<String, Tensor>,
    blocks: Vec<BlockSpec>,
    cfg: StreamConfig,
    policy: ActivationPolicy,
    x: &Tensor,
) -> Result<(f32, HashMap<String, Tensor>, usize)> {
    let model = StreamedSequential::from_tensors(host.clone(), blocks, cfg)?.train();
    model.set_activation_policy(policy)?;
    let y = model.forward(x)?;
    let loss = y.to_dtype(DType::F32)?.sqr()?.mean_all()?;
    let grads = model.backward(&loss)?;
    let mut out = HashMap::new();
    for (name, v) in model.parameters() {
        out.insert(
            name,
            grads
                .get(v.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no gradient"))?
                .clone(),
        );
    }
    Ok((loss.to_scalar::<f32>()?, out, model.kept_blocks()?))
}

fn streamed_fused_mlp_keep_and_recompute_match_autograd(dev: &Device) -> Result<()> {
    let (n, dim, hidden, rows) = (4, 32, 72, 40);
    let host = host_mlp(n, dim, hidden)?;
    let dt = crate::common::compute_dtype(dev);
    let cfg = crate::common::stream(dev, dt, 1);
    let x = Tensor::randn(0f32, 1.0, (rows, dim), &Device::Cpu)?
        .to_dtype(dt)?
        .to_device(dev)?;
    let manual = || {
        (0..n)
            .map(|i| BlockSpec::new(format!("layers.{i}"), move |vb| fused_mlp(dim, hidden, vb)))
            .collect::<Vec<_>>()
    };
    // The same block through Candle autograd: a Module (no manual backward).
    let autograd = || {
        (0..n)
            .map(|i| BlockSpec::module(format!("layers.{i}"), move |vb| fused_mlp(dim, hidden, vb)))
            .collect::<Vec<_>>()
    };
    let per_block = FusedMlp::new(
        Tensor::zeros((hidden, dim), dt, dev)?,
        Tensor::zeros(hidden, dt, dev)?,
        Tensor::zeros((dim, hidden), dt, dev)?,
        Tensor::zeros(dim, dt, dev)?,
    )?
    .saved_bytes(x.shape(), dt);
    // One step of these blocks under this policy, on the same weights and input.
    let run = |blocks, policy| step_grads(&host, blocks, cfg.clone(), policy, &x);
    let keep = |device_bytes| ActivationPolicy::Keep { device_bytes };
    let (l_ref, g_ref, k_ref) = run(autograd(), keep(1 << 30))?;
    ensure!(k_ref == 0, "autograd blocks kept {k_ref} activations");
    let (l_rec, g_rec, k_rec) = run(manual(), ActivationPolicy::Recompute)?;
    ensure!(k_rec == 0, "recompute kept {k_rec}");
    // A budget for exactly two blocks: the first two keep, the last two recompute.
    let (l_keep, g_keep, k_keep) = run(manual(), keep(2 * per_block + 1))?;
    ensure!(k_keep == 2, "kept {k_keep} blocks, expected 2");
    // Inputs through host memory and back: the same recompute on the same
    // bytes, for the hand-written and the autograd blocks alike.
    for (blocks, want) in [(manual(), &g_rec), (autograd(), &g_ref)] {
        let (_, g_off, k_off) = run(blocks, ActivationPolicy::OffloadInputs)?;
        ensure!(k_off == 0, "offload kept {k_off}");
        for (name, w) in want {
            let err = rel_err(&g_off[name], w)?;
            ensure!(
                err == 0.0,
                "{name}: offloaded inputs changed the gradient by {err:.2e}"
            );
        }
    }
    // On the CPU keep and recompute run the same ops on the same values: f32
    // gradients agree to 1e-6. On CUDA the kept forward's GEMM (with the aux
    // epilogue) may be another cuBLASLt kernel than the inference forward's, so
    // bf16 rounding may differ: within the bf16 tolerance.
    let (same_tol, tol) = if dt == DType::F32 {
        (1e-6, 2e-5)
    } else {
        (2e-2, 3e-2)
    };
    ensure!(
        ((l_keep - l_rec) / l_rec).abs() <= same_tol as f32,
        "loss {l_keep} vs {l_rec}"
    );
    ensure!(
        ((l_rec - l_ref) / l_ref).abs() <= tol as f32,
        "loss {l_rec} vs autograd {l_ref}"
    );
    for (name, want) in &g_ref {
        let (rec, keep) = (&g_rec[name], &g_keep[name]);
        ensure_close(&format!("{name}: keep vs recompute"), keep, rec, same_tol)?;
        ensure_close(&format!("{name}: manual vs autograd"), rec, want, tol)?;
    }
    Ok(())
}
candle_streamer::test_device!(streamed_fused_mlp_keep_and_recompute_match_autograd);

fn activation_policy_rejects_impossible_values(dev: &Device) -> Result<()> {
    let host = host_mlp(1, 8, 16)?;
    let blocks = vec![BlockSpec::new("layers.0", |vb: VarBuilder| {
        fused_mlp(8, 16, vb)
    })];
    let cfg = StreamConfig {
        device: dev.clone(),
        ..Default::default()
    };
    let model = StreamedSequential::from_tensors(host, blocks, cfg)?.train();
    let err = model
        .set_activation_policy(ActivationPolicy::Keep { device_bytes: 0 })
        .expect_err("zero budget");
    ensure!(err.to_string().contains("budget of 0 bytes"), "{err}");
    let err = model
        .set_activation_policy(ActivationPolicy::Auto { fraction: 1.5 })
        .expect_err("fraction");
    ensure!(err.to_string().contains("got 1.5"), "{err}");
    if dev.is_cuda() {
        let err = model
            .set_activation_policy(ActivationPolicy::Keep {
                device_bytes: usize::MAX / 2,
            })
            .expect_err("too big");
        ensure!(err.to_string().contains("exceeds"), "{err}");
    }
    ensure!(
        model.activation_policy()? == ActivationPolicy::default(),
        "a refused policy changed the model"
    );
    let err = "keepall"
        .parse::<ActivationPolicy>()
        .expect_err("unknown name");
    ensure!(err.to_string().contains("\"keepall\""), "{err}");
    ensure!(
        "keep:2GiB".parse::<ActivationPolicy>()?
            == ActivationPolicy::Keep {
                device_bytes: 2 << 30
            },
        "keep:2GiB"
    );
    ensure!(
        "recompute".parse::<ActivationPolicy>()? == ActivationPolicy::Recompute,
        "recompute"
    );
    ensure!(
        "offload".parse::<ActivationPolicy>()? == ActivationPolicy::OffloadInputs,
        "offload parses"
    );
    ensure!(
        "spill:1GiB:3GiB".parse::<ActivationPolicy>()?
            == ActivationPolicy::Spill {
                device_bytes: 1 << 30,
                host_bytes: 3 << 30
            },
        "spill:1GiB:3GiB"
    );
    let err = "spill:1GiB"
        .parse::<ActivationPolicy>()
        .expect_err("one size");
    ensure!(err.to_string().contains("spill:DEVICE:HOST"), "{err}");
    let err = "spill:1GiB:lots"
        .parse::<ActivationPolicy>()
        .expect_err("bad size");
    ensure!(err.to_string().contains("\"lots\" is not a size"), "{err}");
    let err = model
        .set_activation_policy(ActivationPolicy::Spill {
            device_bytes: 1 << 20,
            host_bytes: 0,
        })
        .expect_err("no host bytes");
    ensure!(err.to_string().contains("0 host bytes"), "{err}");
    if streamer_core::host_available_memory().is_some() {
        let err = model
            .set_activation_policy(ActivationPolicy::Spill {
                device_bytes: 0,
                host_bytes: usize::MAX / 2,
            })
            .expect_err("more than the host has");
        ensure!(
            err.to_string().contains("of host memory available"),
            "{err}"
        );
    }
    Ok(())
}
candle_streamer::test_device!(activation_policy_rejects_impossible_values);

/// A block whose "activations" are its own weight: the trainer must refuse it.
struct Leaky(Tensor);
impl Block for Leaky {
    fn forward(&self, x: &Tensor, _: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![x.broadcast_mul(&self.0)?])
    }
    fn manual(&self) -> Option<&dyn ManualBackward> {
        Some(self)
    }
}
impl ManualBackward for Leaky {
    fn forward_train(
        &self,
        x: &Tensor,
        _: &[Tensor],
    ) -> candle_core::Result<(Tensor, streamer_core::SavedActivations)> {
        Ok((
            x.broadcast_mul(&self.0)?,
            streamer_core::SavedActivations(vec![self.0.clone()]),
        ))
    }
    fn saved_bytes(&self, _: &candle_core::Shape, _: DType) -> usize {
        1
    }
    fn backward(
        &self,
        _: streamer_core::SavedActivations,
        g: &Tensor,
    ) -> candle_core::Result<(Tensor, Vec<(Tensor, Tensor)>)> {
        Ok((g.clone(), vec![]))
    }
}

fn kept_activations_may_not_alias_weights(dev: &Device) -> Result<()> {
    let mut host = HashMap::new();
    host.insert(
        "b.w".to_string(),
        Tensor::ones(4, DType::F32, &Device::Cpu)?,
    );
    let blocks = vec![BlockSpec::new("b", |vb: VarBuilder| {
        Ok(Leaky(vb.get(4, "w")?))
    })];
    let cfg = StreamConfig {
        device: dev.clone(),
        ..Default::default()
    };
    let model = StreamedSequential::from_tensors(host, blocks, cfg)?.train();
    model.set_activation_policy(ActivationPolicy::Keep {
        device_bytes: 1 << 20,
    })?;
    let weight_kept = model.forward(&Tensor::ones((2, 4), DType::F32, dev)?);
    expect_err(weight_kept, &["shares memory with its"])?;
    Ok(())
}
candle_streamer::test_device!(kept_activations_may_not_alias_weights);

/// `n` fused MLP blocks of `dim` -> `hidden` -> `dim` over `host`, streamed
/// one layer ahead, trainable under `policy`.
fn mlp_model(
    host: &HashMap<String, Tensor>,
    (n, dim, hidden): (usize, usize, usize),
    cfg: StreamConfig,
    policy: ActivationPolicy,
) -> Result<streamer_autograd::TrainableSequential> {
    let blocks = (0..n)
        .map(|i| BlockSpec::new(format!("layers.{i}"), move |vb| fused_mlp(dim, hidden, vb)))
        .collect();
    let model = StreamedSequential::from_tensors(host.clone(), blocks, cfg)?.train();
    model.set_activation_policy(policy)?;
    Ok(model)
}

/// One step of `m` on `x` (gradients zeroed first): the loss (mean square
/// of the output) and every weight's gradient in `parameters()` order.
fn loss_and_grads(
    m: &streamer_autograd::TrainableSequential,
    x: &Tensor,
) -> Result<(f32, Vec<Tensor>)> {
    m.zero_grad()?;
    let loss = m.forward(x)?.to_dtype(DType::F32)?.sqr()?.mean_all()?;
    let grads = m.backward(&loss)?;
    let g = (m.parameters().iter())
        .map(|(_, v)| grads.get(v.as_tensor()).expect("gradient").copy())
        .collect::<candle_core::Result<_>>()?;
    Ok((loss.to_scalar::<f32>()?, g))
}

/// Input rows for step `step`: random, scaled by `step + 1`, so a buffer
/// left from an earlier step gives far-off gradients.
fn step_input(step: usize, (rows, dim): (usize, usize), dt: DType, dev: &Device) -> Result<Tensor> {
    let x = (Tensor::randn(0f32, 1.0, (rows, dim), &Device::Cpu)? * (step + 1) as f64)?;
    Ok(x.to_dtype(dt)?.to_device(dev)?)
}

/// `OffloadInputs` over several steps of one model (its host buffers reused,
/// the inputs different each step) gives each step the gradients a
/// `Recompute` model computes on the same input.
fn offloaded_inputs_survive_buffer_reuse(dev: &Device) -> Result<()> {
    let (n, dim, hidden, rows) = (3, 16, 40, 24);
    let host = host_mlp(n, dim, hidden)?;
    let dt = crate::common::compute_dtype(dev);
    let cfg = crate::common::stream(dev, dt, 1);
    let shape = (n, dim, hidden);
    let off = mlp_model(&host, shape, cfg.clone(), ActivationPolicy::OffloadInputs)?;
    let rec = mlp_model(&host, shape, cfg, ActivationPolicy::Recompute)?;
    for step in 0..3 {
        let x = step_input(step, (rows, dim), dt, dev)?;
        let got = [loss_and_grads(&off, &x)?.1, loss_and_grads(&rec, &x)?.1];
        for (a, b) in got[0].iter().zip(&got[1]) {
            let err = rel_err(a, b)?;
            ensure!(
                err == 0.0,
                "step {step}: offloaded vs recompute differ by {err:.2e}"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(offloaded_inputs_survive_buffer_reuse);

/// `Spill` over several steps of one model (host buffers reused, inputs
/// different each step): the last block keeps its activations on the device
/// (the device's room goes to the last blocks), the first spills them to the
/// host and brings them back, the second recomputes (no two blocks in a row
/// spill), the third spills. A `Keep` with room for two blocks keeps the
/// last two. Every
/// step's loss and gradients equal those of a model keeping every block's
/// activations on the device: on the CPU to 1e-6 (recompute and keep run the
/// same ops), on CUDA within bf16 rounding (another GEMM kernel may serve the
/// recompute); a stale or misplaced host buffer would be off by far more (the
/// inputs change scale every step).
fn spilled_activations_match_kept(dev: &Device) -> Result<()> {
    // Saved tensors of (rows, hidden) are 2 MiB or more: large enough to move.
    let (n, dim, hidden, rows) = (4, 64, 256, 4096);
    let host = host_mlp(n, dim, hidden)?;
    let dt = crate::common::compute_dtype(dev);
    let cfg = crate::common::stream(dev, dt, 1);
    let zeros = |s: &[usize]| Tensor::zeros(s, dt, dev);
    let mlp = FusedMlp::new(
        zeros(&[hidden, dim])?,
        zeros(&[hidden])?,
        zeros(&[dim, hidden])?,
        zeros(&[dim])?,
    )?;
    let per_block = mlp.saved_bytes(&(rows, dim).into(), dt);
    let shape = (n, dim, hidden);
    let spill = ActivationPolicy::Spill {
        device_bytes: per_block + 1,
        host_bytes: 3 * per_block,
    };
    let spill = mlp_model(&host, shape, cfg.clone(), spill)?;
    let keep = ActivationPolicy::Keep {
        device_bytes: 1 << 30,
    };
    let keep = mlp_model(&host, shape, cfg.clone(), keep)?;
    let two = ActivationPolicy::Keep {
        device_bytes: 2 * per_block + 1,
    };
    let two = mlp_model(&host, shape, cfg, two)?;
    let tol = if dt == DType::F32 { 1e-6 } else { 2e-2 };
    use streamer_autograd::ActivationPlace::{Device as D, Host as H, Recomputed as R};
    for step in 0..3 {
        let x = step_input(step, (rows, dim), dt, dev)?;
        let got = [loss_and_grads(&spill, &x)?, loss_and_grads(&keep, &x)?];
        let counts = (
            spill.kept_blocks()?,
            spill.spilled_blocks()?,
            keep.kept_blocks()?,
        );
        ensure!(
            counts == (3, 2, 4),
            "step {step}: kept, spilled, kept: {counts:?}"
        );
        let places = spill.activation_places()?;
        ensure!(
            places == [H, R, H, D],
            "step {step}: spill placed {places:?}"
        );
        loss_and_grads(&two, &x)?;
        let places = two.activation_places()?;
        ensure!(
            places == [R, R, D, D],
            "step {step}: keep two placed {places:?}"
        );
        let (l_spill, l_keep) = (got[0].0, got[1].0);
        ensure!(
            ((l_spill - l_keep) / l_keep).abs() <= tol as f32,
            "step {step}: loss {l_spill} vs {l_keep}"
        );
        for (k, (a, b)) in got[0].1.iter().zip(&got[1].1).enumerate() {
            ensure_close(
                &format!("step {step}, weight {k}: spill vs keep"),
                a,
                b,
                tol,
            )?;
        }
    }
    Ok(())
}
candle_streamer::test_device!(spilled_activations_match_kept);
