//! streamer-autograd: streamed training against plain resident Candle autograd.
use crate::pool::{assert_close, mlp, mlp_blocks, mlp_weights, tempdir};
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Optimizer, ParamsAdamW, VarBuilder};
use std::collections::HashMap;
use streamer_autograd::{with_seed, CpuAdamW, Dropout, Train, TrainableSequential};
use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};

fn cfg(dev: &Device, dtype: DType, master: DType, prefetch: usize) -> StreamConfig {
    StreamConfig {
        device: dev.clone(),
        prefetch_ahead: prefetch,
        dtype,
        master_dtype: Some(master),
        ..Default::default()
    }
}

/// Gradients of a resident run: every weight a device `Var` in `dtype`, the same
/// blocks, `pre` before and `head` after. Returns grads by name (f32, host),
/// plus "pre", "head" and "x".
struct Reference {
    grads: HashMap<String, Tensor>,
}

#[allow(clippy::too_many_arguments)]
fn resident_grads(
    weights: &HashMap<String, Tensor>,
    blocks: &[BlockSpec],
    x: &Tensor,
    pre: &Tensor,
    head: &Tensor,
    dtype: DType,
    dev: &Device,
    seed: Option<u64>,
) -> Result<Reference> {
    let vars: HashMap<String, Var> = weights
        .iter()
        .map(|(k, v)| {
            Ok((
                k.clone(),
                Var::from_tensor(&v.to_dtype(dtype)?.to_device(dev)?)?,
            ))
        })
        .collect::<Result<_>>()?;
    let vb = crate::common::var_builder(&vars, dtype, dev);
    let xv = Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
    let prev = Var::from_tensor(&pre.to_dtype(dtype)?.to_device(dev)?)?;
    let headv = Var::from_tensor(&head.to_dtype(dtype)?.to_device(dev)?)?;
    let mut h = xv.as_tensor().matmul(prev.as_tensor())?;
    for (i, b) in blocks.iter().enumerate() {
        let block = b.build(vb.pp(b.prefix()))?;
        let run = || block.forward(&h, &[]);
        h = match seed {
            Some(s) => with_seed(s + i as u64, run)?,
            None => run()?,
        }
        .swap_remove(0);
    }
    let loss = h
        .matmul(headv.as_tensor())?
        .to_dtype(DType::F32)?
        .sqr()?
        .mean_all()?;
    let g = loss.backward()?;
    let mut grads = HashMap::new();
    let outer = [
        ("pre".to_string(), prev),
        ("head".to_string(), headv),
        ("x".to_string(), xv),
    ];
    for (k, v) in vars.iter().chain(outer.iter().map(|(k, v)| (k, v))) {
        if let Some(t) = g.get(v.as_tensor()) {
            grads.insert(k.clone(), t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
        }
    }
    Ok(Reference { grads })
}

/// The same through a streamed model; grads by name (host f32).
fn streamed_grads(
    model: &TrainableSequential,
    x: &Tensor,
    pre: &Tensor,
    head: &Tensor,
    dtype: DType,
    dev: &Device,
) -> Result<Reference> {
    let xv = Var::from_tensor(&x.to_dtype(dtype)?.to_device(dev)?)?;
    let prev = Var::from_tensor(&pre.to_dtype(dtype)?.to_device(dev)?)?;
    let headv = Var::from_tensor(&head.to_dtype(dtype)?.to_device(dev)?)?;
    let h = xv.as_tensor().matmul(prev.as_tensor())?;
    let y = model.forward(&h)?;
    let loss = y
        .matmul(headv.as_tensor())?
        .to_dtype(DType::F32)?
        .sqr()?
        .mean_all()?;
    let g = model.backward(&loss)?;
    let mut grads = HashMap::new();
    for (name, v) in model.parameters() {
        if let Some(t) = g.get(v.as_tensor()) {
            assert!(
                t.device().is_cpu(),
                "streamed grad of {name} must be on the host"
            );
            assert_eq!(
                t.dtype(),
                DType::F32,
                "streamed grads reach the optimizer in f32"
            );
            grads.insert(name, t.clone());
        }
    }
    for (k, v) in [("pre", prev), ("head", headv), ("x", xv)] {
        if let Some(t) = g.get(v.as_tensor()) {
            grads.insert(
                k.to_string(),
                t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
            );
        }
    }
    Ok(Reference { grads })
}

/// Compares every gradient; bf16/f16 tolerances are relative to each
/// gradient's largest magnitude (f32: atol 2e-5, rtol 2e-4 as stated).
fn compare(got: &Reference, want: &Reference, dtype: DType, what: &str) -> Result<()> {
    let mut names: Vec<_> = want.grads.keys().collect();
    names.sort();
    assert_eq!(
        got.grads.len(),
        want.grads.len(),
        "{what}: gradient sets differ: {:?} vs {:?}",
        got.grads.keys(),
        names
    );
    for k in names {
        let (g, w) = (&got.grads[k], &want.grads[k]);
        let scale = w
            .abs()?
            .max_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?
            .max(1e-6);
        let (atol, rtol) = match dtype {
            DType::F32 => (2e-5 * scale.max(1.0), 2e-4),
            DType::BF16 => (3e-2 * scale, 3e-2),
            _ => (5e-3 * scale, 5e-3),
        };
        assert_close(g, w, atol, rtol, &format!("{what}: grad of {k}"))?;
    }
    Ok(())
}

fn setup(w: usize, hidden: &[usize]) -> Result<(HashMap<String, Tensor>, Tensor, Tensor, Tensor)> {
    let weights = mlp_weights(w, hidden)?;
    let x = Tensor::randn(0f32, 1.0, (6, w), &Device::Cpu)?;
    let pre = Tensor::randn(0f32, 0.3, (w, w), &Device::Cpu)?;
    let head = Tensor::randn(0f32, 0.3, (w, 3), &Device::Cpu)?;
    Ok((weights, x, pre, head))
}

/// Weights, input, pre-projection, head, blocks and AdamW settings.
type TiedSetup = (
    HashMap<String, Tensor>,
    Tensor,
    Tensor,
    Tensor,
    Vec<BlockSpec>,
    ParamsAdamW,
);

/// The step comparisons' model: three blocks of hidden 16 with a weight tied
/// across blocks 0 and 2 (it completes only at the end of a backward), its
/// weights and inputs ([`setup`]), and the AdamW settings they step with.
fn tied_setup() -> Result<TiedSetup> {
    let hidden = [16, 16, 16];
    let (mut weights, x, pre, head) = setup(8, &hidden)?;
    let shared = weights["layers.0.up.bias"].clone();
    weights.insert("layers.2.up.bias".into(), shared);
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.01,
        ..Default::default()
    };
    Ok((weights, x, pre, head, mlp_blocks(8, &hidden), params))
}

/// Every parameter of `got` within `(atol, rtol)` of the same one of `want`.
fn params_close(
    got: &TrainableSequential,
    want: &TrainableSequential,
    (atol, rtol): (f64, f64),
    what: &str,
) -> Result<()> {
    for ((n, vw), (_, vg)) in want.parameters().iter().zip(got.parameters().iter()) {
        assert_close(
            vg.as_tensor(),
            vw.as_tensor(),
            atol,
            rtol,
            &format!("{what} {n}"),
        )?;
    }
    Ok(())
}

fn gradients_match_resident(dev: &Device) -> Result<()> {
    for depth in 1..=3 {
        let hidden: Vec<usize> = (0..depth).map(|i| 16 + 8 * i).collect();
        let (weights, x, pre, head) = setup(12, &hidden)?;
        let blocks = mlp_blocks(12, &hidden);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let want = resident_grads(&weights, &blocks, &x, &pre, &head, dtype, dev, None)?;
            for prefetch in 0..=3 {
                let model = StreamedSequential::from_tensors(
                    weights.clone(),
                    blocks.clone(),
                    cfg(dev, dtype, dtype, prefetch),
                )?
                .train();
                let got = streamed_grads(&model, &x, &pre, &head, dtype, dev)?;
                compare(
                    &got,
                    &want,
                    dtype,
                    &format!("depth {depth} {dtype:?} prefetch {prefetch}"),
                )?;
                let st = model.stats()?;
                assert!(st.peak_resident_blocks <= prefetch + 1);
                assert_eq!(st.resident_blocks, 0);
                // Forward and backward each load every block once.
                assert_eq!(st.loads, 2 * depth as u64);
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(gradients_match_resident);

/// A block using a weight twice (tied inside), one weight it requests but never
/// uses, and one frozen weight.
fn tied_unused_frozen(vb: VarBuilder) -> candle_core::Result<impl Module> {
    let a = linear(8, 8, vb.pp("a"))?;
    let _unused = vb.get(4, "unused")?;
    Ok(move |x: &Tensor| a.forward(&a.forward(x)?.tanh()?))
}

fn frozen_unused_and_tied_parameters(dev: &Device) -> Result<()> {
    let mut weights = HashMap::new();
    weights.insert(
        "b0.a.weight".to_string(),
        Tensor::randn(0f32, 0.4, (8, 8), &Device::Cpu)?,
    );
    weights.insert(
        "b0.a.bias".to_string(),
        Tensor::randn(0f32, 0.1, 8, &Device::Cpu)?,
    );
    weights.insert(
        "b0.unused".to_string(),
        Tensor::zeros(4, DType::F32, &Device::Cpu)?,
    );
    weights.insert(
        "b1.a.bias".to_string(),
        Tensor::randn(0f32, 0.1, 8, &Device::Cpu)?,
    );
    weights.insert(
        "b1.unused".to_string(),
        Tensor::zeros(4, DType::F32, &Device::Cpu)?,
    );
    // Block 1's weight is block 0's (tied across blocks, stored once).
    let shared = weights["b0.a.weight"].clone();
    weights.insert("b1.a.weight".to_string(), shared);
    let blocks = vec![
        BlockSpec::module("b0", tied_unused_frozen),
        BlockSpec::module("b1", tied_unused_frozen),
    ];
    let (_, x, pre, head) = setup(8, &[])?;
    let mut want = resident_grads(&weights, &blocks, &x, &pre, &head, DType::F32, dev, None)?;
    // Resident Candle sees two names for one tensor as two leaves: their sum is
    // the tied weight's gradient.
    let tied = (&want.grads["b0.a.weight"] + &want.grads["b1.a.weight"])?;
    want.grads.insert("b0.a.weight".into(), tied);
    want.grads.remove("b1.a.weight");
    // Frozen: b1's bias gets no gradient.
    want.grads.remove("b1.a.bias");
    let model =
        StreamedSequential::from_tensors(weights, blocks, cfg(dev, DType::F32, DType::F32, 1))?
            .train();
    model.set_trainable(&["b1.a.bias"], false)?;
    assert_eq!(
        model.parameters().len(),
        5,
        "the tied weight is stored once"
    );
    assert_eq!(model.trainable_vars()?.len(), 4);
    let got = streamed_grads(&model, &x, &pre, &head, DType::F32, dev)?;
    assert!(
        !got.grads.contains_key("b0.unused") && !got.grads.contains_key("b1.unused"),
        "unused weights get no gradient"
    );
    compare(&got, &want, DType::F32, "tied/unused/frozen")?;
    // Frozen weights cost no transfer: 8x8 + 8 floats per block, less b1's bias.
    let st = model.stats()?;
    assert_eq!(st.d2h_bytes, 4 * (64 + 8 + 64));
    Ok(())
}
candle_streamer::test_device!(frozen_unused_and_tied_parameters);

/// A block with an extra input (added) and dropout.
struct WithExtra {
    lin: candle_nn::Linear,
    drop: Dropout,
}

impl streamer_core::Block for WithExtra {
    fn forward(&self, x: &Tensor, extras: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        let y = self.drop.forward(&self.lin.forward(x)?)?;
        Ok(vec![y.broadcast_add(&extras[0])?.gelu()?])
    }
}

fn input_extras_and_dropout_replay(dev: &Device) -> Result<()> {
    let w = 10;
    let mut weights = HashMap::new();
    for i in 0..3 {
        crate::common::insert_linear(&mut weights, &format!("b{i}.lin"), (w, w), 0.4)?;
    }
    let blocks: Vec<BlockSpec> = (0..3)
        .map(|i| {
            BlockSpec::new(format!("b{i}"), move |vb| {
                Ok(WithExtra {
                    lin: linear(w, w, vb.pp("lin"))?,
                    drop: Dropout::new(0.3),
                })
            })
        })
        .collect();
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, w), dev)?)?;
    let extra = Var::from_tensor(&Tensor::randn(0f32, 0.5, (1, w), dev)?)?;
    // Resident reference with the same dropout seeds (block i uses seed + i).
    let seed = 1234u64;
    let vars = crate::common::vars_on(&weights, dev)?;
    let vb = crate::common::var_builder(&vars, DType::F32, dev);
    let mut h = x.as_tensor().clone();
    for (i, b) in blocks.iter().enumerate() {
        let block = b.build(vb.pp(b.prefix()))?;
        h = with_seed(seed + i as u64, || {
            block.forward(&h, std::slice::from_ref(extra.as_tensor()))
        })?
        .swap_remove(0);
    }
    let want_loss = h.sqr()?.sum_all()?;
    let want = want_loss.backward()?;

    let model =
        StreamedSequential::from_tensors(weights, blocks, cfg(dev, DType::F32, DType::F32, 1))?
            .train();
    model.set_seed(seed);
    let y = model
        .forward_with(x.as_tensor(), std::slice::from_ref(extra.as_tensor()))?
        .swap_remove(0);
    let loss = y.sqr()?.sum_all()?;
    assert_close(&loss, &want_loss, 1e-5, 1e-5, "loss with replayed dropout")?;
    let got = model.backward(&loss)?;
    assert_close(
        got.get(x.as_tensor()).unwrap(),
        want.get(x.as_tensor()).unwrap(),
        2e-5,
        2e-4,
        "grad of the input",
    )?;
    assert_close(
        got.get(extra.as_tensor()).unwrap(),
        want.get(extra.as_tensor()).unwrap(),
        2e-5,
        2e-4,
        "grad of the extra",
    )?;
    for (name, v) in model.parameters() {
        assert_close(
            got.get(v.as_tensor()).unwrap(),
            want.get(vars[&name].as_tensor()).unwrap(),
            2e-5,
            2e-4,
            &name,
        )?;
    }
    Ok(())
}
candle_streamer::test_device!(input_extras_and_dropout_replay);

fn gradients_accumulate_until_zeroed(dev: &Device) -> Result<()> {
    let hidden = [16, 16];
    let (weights, x, pre, head) = setup(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    let model =
        StreamedSequential::from_tensors(weights, blocks, cfg(dev, DType::F32, DType::F32, 1))?
            .train();
    let one = streamed_grads(&model, &x, &pre, &head, DType::F32, dev)?;
    let one: HashMap<String, Vec<f32>> = one
        .grads
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.flatten_all()?.to_vec1::<f32>()?)))
        .collect::<Result<_>>()?;
    let x2 = (&x * 0.5)?;
    model.zero_grad()?;
    let two = streamed_grads(&model, &x2, &pre, &head, DType::F32, dev)?;
    // The GradStore's host tensors are the accumulators themselves (like
    // PyTorch's param.grad): copy them out before the next backward.
    let two: HashMap<String, Tensor> = two
        .grads
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.copy()?)))
        .collect::<Result<_>>()?;
    model.zero_grad()?;
    streamed_grads(&model, &x, &pre, &head, DType::F32, dev)?;
    let both = streamed_grads(&model, &x2, &pre, &head, DType::F32, dev)?;
    for (name, _) in model.parameters() {
        let sum =
            (Tensor::new(one[&name].as_slice(), &Device::Cpu)? + two[&name].flatten_all()?)?;
        assert_close(
            &both.grads[&name].flatten_all()?,
            &sum,
            1e-6,
            1e-5,
            &format!("accumulated {name}"),
        )?;
    }
    Ok(())
}
candle_streamer::test_device!(gradients_accumulate_until_zeroed);

fn misuse_is_a_clear_error(dev: &Device) -> Result<()> {
    let hidden = [8];
    let (weights, x, _, _) = setup(8, &hidden)?;
    let model = StreamedSequential::from_tensors(
        weights,
        mlp_blocks(8, &hidden),
        cfg(dev, DType::F32, DType::F32, 1),
    )?
    .train();
    let x = x.to_device(dev)?;
    let err = |r: candle_core::Result<candle_core::backprop::GradStore>| match r {
        Ok(_) => panic!("must fail"),
        Err(e) => e.to_string(),
    };
    // Backward without a forward.
    let loss = x.sum_all()?;
    assert!(err(model.backward(&loss)).contains("without a training forward"));
    // Twice for one forward.
    let loss = model.forward(&x)?.sum_all()?;
    model.backward(&loss)?;
    assert!(err(model.backward(&loss)).contains("without a training forward"));
    // Masters changed in between.
    let loss = model.forward(&x)?.sum_all()?;
    let (name, v) = model.parameters().swap_remove(0);
    let before = v.as_tensor().copy()?;
    v.set(&(v.as_tensor() * 2.0)?)?;
    let e = err(model.backward(&loss));
    assert!(e.contains(&name) && e.contains("changed"), "{e}");
    v.set(&before)?;
    // Mode switched in between.
    let loss = model.forward(&x)?.sum_all()?;
    model.set_training(false);
    let e = err(model.backward(&loss));
    assert!(e.contains("mode"), "{e}");
    model.set_training(true);
    // After all that, training still works.
    let loss = model.forward(&x)?.sum_all()?;
    model.backward(&loss)?;
    Ok(())
}
candle_streamer::test_device!(misuse_is_a_clear_error);

const HIDDEN: [usize; 3] = [32, 32, 32];
const W: usize = 16;

/// A fixed random teacher, a student's initial weights, inputs and targets.
struct Task {
    student: HashMap<String, Tensor>,
    x: Tensor,
    target: Tensor,
}

fn teacher_task() -> Result<Task> {
    let teacher = mlp_weights(W, &HIDDEN)?;
    let x = Tensor::randn(0f32, 1.0, (64, W), &Device::Cpu)?;
    let tvb = VarBuilder::from_tensors(teacher, DType::F32, &Device::Cpu);
    let mut target = x.clone();
    for (i, &h) in HIDDEN.iter().enumerate() {
        target = mlp(tvb.pp(format!("layers.{i}")), W, h)?.forward(&target)?;
    }
    Ok(Task {
        student: mlp_weights(W, &HIDDEN)?,
        x,
        target,
    })
}

/// The student learns the teacher; returns the losses.
fn train_student(
    task: &Task,
    dev: &Device,
    dtype: DType,
    master: DType,
    steps: usize,
    streamed: bool,
) -> Result<Vec<f32>> {
    let student = task.student.clone();
    let blocks = mlp_blocks(W, &HIDDEN);
    let (x, target) = (
        task.x.to_dtype(dtype)?.to_device(dev)?,
        task.target.to_device(dev)?,
    );
    let mut losses = Vec::new();
    let params = ParamsAdamW {
        lr: 3e-3,
        ..Default::default()
    };
    if streamed {
        let model =
            StreamedSequential::from_tensors(student, blocks, cfg(dev, dtype, master, 1))?.train();
        let mut opt = CpuAdamW::new(model.trainable_vars()?, params)?;
        for _ in 0..steps {
            let loss = model
                .forward(&x)?
                .to_dtype(DType::F32)?
                .sub(&target)?
                .sqr()?
                .mean_all()?;
            losses.push(loss.to_scalar::<f32>()?);
            let grads = model.backward(&loss)?;
            opt.step(&grads)?;
            model.zero_grad()?;
        }
    } else {
        let vars = crate::common::vars_on(&student, dev)?;
        let vb = crate::common::var_builder(&vars, DType::F32, dev);
        let mut opt = candle_nn::AdamW::new(vars.values().cloned().collect(), params)?;
        for _ in 0..steps {
            let mut h = x.clone();
            for b in &blocks {
                h = b.build(vb.pp(b.prefix()))?.forward(&h, &[])?.swap_remove(0);
            }
            let loss = h.sub(&target)?.sqr()?.mean_all()?;
            losses.push(loss.to_scalar::<f32>()?);
            opt.backward_step(&loss)?;
        }
    }
    Ok(losses)
}

fn training_reduces_loss_and_mixed_precision_converges(dev: &Device) -> Result<()> {
    let steps = 50;
    let task = teacher_task()?;
    let f32_streamed = train_student(&task, dev, DType::F32, DType::F32, steps, true)?;
    let f32_resident = train_student(&task, dev, DType::F32, DType::F32, steps, false)?;
    let mixed = train_student(&task, dev, DType::BF16, DType::F32, steps, true)?;
    let drop = |l: &[f32]| 1.0 - l[l.len() - 1] / l[0];
    assert!(
        drop(&f32_streamed) >= 0.10,
        "streamed f32 loss fell only {:.1}%: {f32_streamed:?}",
        100.0 * drop(&f32_streamed)
    );
    // The same model, data and optimizer: streamed f32 follows resident f32.
    for (a, b) in f32_streamed.iter().zip(&f32_resident) {
        assert!(
            (a - b).abs() <= 1e-3 * b.abs().max(1e-3),
            "streamed {a} vs resident {b}"
        );
    }
    // f32 masters under bf16 compute converge like resident f32 (within 10%).
    let (m, r) = (mixed[steps - 1], f32_resident[steps - 1]);
    assert!(
        drop(&mixed) >= 0.10 && (m - r).abs() <= 0.1 * r.max(1e-3) + 2e-3,
        "bf16 compute {m} vs f32 {r}"
    );
    Ok(())
}
candle_streamer::test_device!(training_reduces_loss_and_mixed_precision_converges);

fn optimizer_state_resume_gives_same_next_step(dev: &Device) -> Result<()> {
    let hidden = [16, 16];
    let (weights, x, pre, head) = setup(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    let dir = tempdir("resume")?;
    let params = ParamsAdamW {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    };
    let (xd, pred, headd) = (x.to_device(dev)?, pre.to_device(dev)?, head.to_device(dev)?);
    let step = |model: &TrainableSequential, opt: &mut CpuAdamW| -> Result<()> {
        let y = model.forward(&xd.matmul(&pred)?)?;
        let loss = y.matmul(&headd)?.sqr()?.mean_all()?;
        opt.step(&model.backward(&loss)?)?;
        model.zero_grad()?;
        Ok(())
    };
    let a = StreamedSequential::from_tensors(
        weights.clone(),
        blocks.clone(),
        cfg(dev, DType::F32, DType::F32, 1),
    )?
    .train();
    let mut opt_a = CpuAdamW::new(a.trainable_vars()?, params.clone())?;
    for _ in 0..3 {
        step(&a, &mut opt_a)?;
    }
    let saved: HashMap<String, Tensor> = a
        .parameters()
        .into_iter()
        .map(|(k, v)| (k, v.as_tensor().clone()))
        .collect();
    candle_core::safetensors::save(&saved, dir.join("w.safetensors"))?;
    opt_a.save(dir.join("opt.safetensors"))?;
    step(&a, &mut opt_a)?;

    let b = StreamedSequential::from_safetensors(
        &[dir.join("w.safetensors")],
        blocks,
        cfg(dev, DType::F32, DType::F32, 1),
    )?
    .train();
    let mut opt_b = CpuAdamW::new(b.trainable_vars()?, params)?;
    opt_b.load(dir.join("opt.safetensors"))?;
    step(&b, &mut opt_b)?;
    params_close(&a, &b, (0.0, 0.0), "resumed")?;
    std::fs::remove_dir_all(dir)?;
    Ok(())
}
candle_streamer::test_device!(optimizer_state_resume_gives_same_next_step);

fn overlapped_step_equals_plain_step(dev: &Device) -> Result<()> {
    let (weights, x, pre, head, blocks, params) = tied_setup()?;
    let (xd, pred, headd) = (x.to_device(dev)?, pre.to_device(dev)?, head.to_device(dev)?);
    let loss_of = |m: &TrainableSequential| -> Result<Tensor> {
        Ok(m.forward(&xd.matmul(&pred)?)?
            .matmul(&headd)?
            .sqr()?
            .mean_all()?)
    };
    let a = StreamedSequential::from_tensors(
        weights.clone(),
        blocks.clone(),
        cfg(dev, DType::F32, DType::F32, 1),
    )?
    .train();
    let b = StreamedSequential::from_tensors(weights, blocks, cfg(dev, DType::F32, DType::F32, 1))?
        .train();
    let mut opt_a = CpuAdamW::new(a.trainable_vars()?, params.clone())?;
    let mut opt_b = CpuAdamW::new(b.trainable_vars()?, params)?;
    for _ in 0..3 {
        opt_a.step(&a.backward(&loss_of(&a)?)?)?;
        a.zero_grad()?;
        b.backward_step(&loss_of(&b)?, &mut opt_b)?;
        b.zero_grad()?;
    }
    assert_eq!(opt_b.step_count(), 3);
    params_close(&b, &a, (0.0, 0.0), "overlapped")?;
    Ok(())
}
candle_streamer::test_device!(overlapped_step_equals_plain_step);

/// What a block saw of each call: index, training, seed.
type Calls = std::sync::Arc<std::sync::Mutex<Vec<(usize, bool, Option<u64>)>>>;

/// A block scaling its input by two dropout masks drawn on other threads
/// from its `BlockCtx`, and recording each call's context.
struct CtxDropout {
    w: Tensor,
    calls: Calls,
}

impl streamer_core::Block for CtxDropout {
    fn forward(&self, _: &Tensor, _: &[Tensor]) -> candle_core::Result<Vec<Tensor>> {
        candle_core::bail!("this block runs with its context only")
    }

    fn forward_ctx(
        &self,
        x: &Tensor,
        _: &[Tensor],
        ctx: &streamer_core::BlockCtx,
    ) -> candle_core::Result<Vec<Tensor>> {
        self.calls
            .lock()
            .expect("calls")
            .push((ctx.index, ctx.training, ctx.seed));
        let xw = x.broadcast_mul(&self.w)?;
        // Drawn on two other threads, where the trainer's thread-local seed
        // is absent (as in rayon work inside a block).
        let (a, b) = std::thread::scope(|sc| {
            let a = sc.spawn(|| streamer_autograd::dropout_ctx(&xw, 0.5, ctx, 0));
            let b = sc.spawn(|| streamer_autograd::dropout_ctx(&xw, 0.5, ctx, 1));
            (a.join().expect("thread"), b.join().expect("thread"))
        });
        Ok(vec![(a? + b?)?])
    }
}

fn block_ctx_carries_seeds_across_threads(dev: &Device) -> Result<()> {
    let (n, w) = (2, 64);
    let mut weights = HashMap::new();
    for i in 0..n {
        weights.insert(
            format!("b{i}.w"),
            Tensor::ones(w, DType::F32, &Device::Cpu)?,
        );
    }
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let blocks: Vec<BlockSpec> = (0..n)
        .map(|i| {
            let calls = calls.clone();
            BlockSpec::new(format!("b{i}"), move |vb: VarBuilder| {
                Ok(CtxDropout {
                    w: vb.get(64, "w")?,
                    calls: calls.clone(),
                })
            })
        })
        .collect();
    let model =
        StreamedSequential::from_tensors(weights, blocks, cfg(dev, DType::F32, DType::F32, 1))?
            .train();
    let x = Tensor::ones((8, w), DType::F32, dev)?;
    let y = model.forward(&x)?;
    let grads = model.backward(&y.sum_all()?)?;
    // With all-ones input and weights, y = (m1 + m2) x (m3 + m4) per element
    // (masks of 0 or 2), and d sum(y) / d w_1 sums y over rows: the recompute
    // in backward must draw the forward's masks, whichever thread draws them.
    let (_, w1) = &model.parameters()[1];
    let want = y.sum(0)?;
    let got = grads.get(w1.as_tensor()).expect("gradient of b1.w");
    assert_close(got, &want, 1e-5, 1e-6, "b1.w gradient from replayed masks")?;
    let ys: Vec<f32> = y.flatten_all()?.to_vec1()?;
    anyhow::ensure!(
        ys.contains(&0.0) && ys.iter().any(|&v| v > 4.0),
        "the masks drop and scale: {ys:?}"
    );
    let seen = calls.lock().expect("calls").clone();
    // Forward of b0, b1, then b1's and b0's recompute: same seeds, training.
    anyhow::ensure!(seen.len() == 4, "{seen:?}");
    anyhow::ensure!(seen.iter().all(|c| c.1 && c.2.is_some()), "{seen:?}");
    anyhow::ensure!(seen[0].2 == seen[3].2 && seen[1].2 == seen[2].2, "{seen:?}");
    anyhow::ensure!((seen[0].0, seen[1].0, seen[2].0) == (0, 1, 1), "{seen:?}");
    // Inference: no masks (identity dropout), inference contexts.
    model.set_training(false);
    let y = model.forward(&x)?;
    assert_close(
        &y,
        &(Tensor::ones((8, w), DType::F32, dev)? * 4.0)?,
        0.0,
        0.0,
        "inference",
    )?;
    anyhow::ensure!(calls.lock().expect("calls")[4..]
        .iter()
        .all(|c| !c.1 && c.2.is_none()));
    Ok(())
}
candle_streamer::test_device!(block_ctx_carries_seeds_across_threads);

/// The compute dtypes the device-step tests cover: f32, and on CUDA bf16 under
/// f32 masters (stepped in the staging buffer).
fn step_dtypes(dev: &Device) -> &'static [DType] {
    if dev.is_cpu() {
        &[DType::F32]
    } else {
        &[DType::F32, DType::BF16]
    }
}

/// The mean square of `(x pre) model head`, with the three on the device in
/// the compute dtype.
struct MseOf {
    x: Tensor,
    pre: Tensor,
    head: Tensor,
}

impl MseOf {
    fn new((x, pre, head): (&Tensor, &Tensor, &Tensor), dev: &Device, dt: DType) -> Result<Self> {
        let on = |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(dev)?.to_dtype(dt)?) };
        Ok(Self {
            x: on(x)?,
            pre: on(pre)?,
            head: on(head)?,
        })
    }

    fn of(&self, m: &TrainableSequential) -> Result<Tensor> {
        let y = m.forward(&self.x.matmul(&self.pre)?)?.matmul(&self.head)?;
        Ok(y.to_dtype(DType::F32)?.sqr()?.mean_all()?)
    }
}

/// `backward_step_device` (DeviceAdamW stepping the staged masters on the
/// device, or the host masters on the CPU) against a plain backward followed by
/// `CpuAdamW`, over three steps, with a weight tied across blocks 0 and 2.
/// Both runs compute identical gradients, and the device kernel rounds as the
/// host one does, so the masters agree to f32 rounding (1e-6 relative, 1e-7
/// absolute). Checked with masters in the compute dtype (stepped in the slot)
/// and with f32 masters under bf16 compute (stepped in the staging buffer).
fn device_step_equals_host_step(dev: &Device) -> Result<()> {
    let (weights, x, pre, head, blocks, params) = tied_setup()?;
    for &compute in step_dtypes(dev) {
        let mse = MseOf::new((&x, &pre, &head), dev, compute)?;
        let loss_of = |m: &TrainableSequential| mse.of(m);
        let make = || -> Result<TrainableSequential> {
            Ok(StreamedSequential::from_tensors(
                weights.clone(),
                blocks.clone(),
                cfg(dev, compute, DType::F32, 1),
            )?
            .train())
        };
        let (a, b) = (make()?, make()?);
        let mut opt_a = CpuAdamW::new(a.trainable_vars()?, params.clone())?;
        let mut opt_b =
            streamer_autograd::DeviceAdamW::new(b.trainable_vars()?, params.clone(), dev)?;
        for _ in 0..3 {
            opt_a.step(&a.backward(&loss_of(&a)?)?)?;
            a.zero_grad()?;
            b.backward_step_device(&loss_of(&b)?, &mut opt_b)?;
            b.zero_grad()?;
        }
        assert_eq!(opt_b.step_count(), 3);
        // On CUDA the forwards after a step computed block 0 (stepped last)
        // from its stepped device copy, checked against the host masters, and
        // found it equal.
        let st = b.stats()?;
        let lent = if dev.is_cuda() { 2 } else { 0 };
        assert_eq!((st.reused_loads, st.stale_reuses), (lent, 0), "{compute:?}");
        params_close(&b, &a, (1e-7, 1e-6), &format!("device step {compute:?}"))?;
        // The moments agree too (the state a checkpoint would save).
        for i in 0..opt_a.vars().len() {
            let (ma, va) = opt_a.moments(i).expect("stepped");
            let (mb, vb) = opt_b.moments(i)?.expect("stepped");
            for (x, y) in ma.iter().zip(&mb).chain(va.iter().zip(&vb)) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs() + 1e-12,
                    "moment {i}: {x} vs {y}"
                );
            }
        }
    }
    Ok(())
}
candle_streamer::test_device!(device_step_equals_host_step);

/// A master changed on the host after a device step (`Var::set`, as a
/// checkpoint load into the parameters would) is what the next forward
/// computes with: on CUDA the stepped copy lent to it is found stale and the
/// forward runs again from fresh copies. Checked against a model built from
/// the same parameters afterwards, with f32 and with f32 masters under bf16.
fn stepped_copy_changed_on_host_is_not_used(dev: &Device) -> Result<()> {
    let hidden = [16, 24, 16];
    let (weights, x, pre, head) = setup(8, &hidden)?;
    let blocks = mlp_blocks(8, &hidden);
    for &compute in step_dtypes(dev) {
        let mse = MseOf::new((&x, &pre, &head), dev, compute)?;
        let loss_of = |m: &TrainableSequential| mse.of(m);
        let cfg = cfg(dev, compute, DType::F32, 1);
        let model =
            StreamedSequential::from_tensors(weights.clone(), blocks.clone(), cfg.clone())?.train();
        let params = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut opt = streamer_autograd::DeviceAdamW::new(model.trainable_vars()?, params, dev)?;
        model.backward_step_device(&loss_of(&model)?, &mut opt)?;
        model.zero_grad()?;
        // Block 0 was stepped last; change one of its masters on the host.
        for (name, var) in model.parameters() {
            if name == "layers.0.up.weight" {
                var.set(&(var.as_tensor() * 0.5)?)?;
            }
        }
        let got = loss_of(&model)?.to_scalar::<f32>()?;
        let now: HashMap<String, Tensor> = model
            .parameters()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().copy().expect("copy")))
            .collect();
        let fresh = StreamedSequential::from_tensors(now, blocks.clone(), cfg)?.train();
        let want = loss_of(&fresh)?.to_scalar::<f32>()?;
        assert!(
            (got - want).abs() <= 1e-6 * want.abs(),
            "{compute:?}: loss {got} with the changed master, {want} from a fresh model"
        );
        let st = model.stats()?;
        let (lent, stale) = if dev.is_cuda() { (1, 1) } else { (0, 0) };
        assert_eq!(
            (st.reused_loads, st.stale_reuses),
            (lent, stale),
            "{compute:?}"
        );
    }
    Ok(())
}
candle_streamer::test_device!(stepped_copy_changed_on_host_is_not_used);

/// With the timeline on, a training step leaves host spans on the timeline's
/// host lane (the forward call, each block's issue, `loss.backward`, the
/// backward's setup and end, and the caller's own span), in the order the
/// host ran them.
fn host_spans_on_the_timeline(dev: &Device) -> Result<()> {
    let hidden = [16, 24];
    let (weights, x, _, _) = setup(8, &hidden)?;
    let x = x.to_device(dev)?;
    let mut c = cfg(dev, DType::F32, DType::F32, 1);
    c.timeline = true;
    let model = StreamedSequential::from_tensors(weights, mlp_blocks(8, &hidden), c)?.train();
    assert!(model.inner().timeline_on());
    let params = ParamsAdamW::default();
    let mut opt = streamer_autograd::DeviceAdamW::new(model.trainable_vars()?, params, dev)?;
    let y = model.forward(&x)?;
    let t = std::time::Instant::now();
    let loss = y.sqr()?.mean_all()?;
    model
        .inner()
        .record_host_span("loss", t, std::time::Instant::now())?;
    model.backward_step_device(&loss, &mut opt)?;
    let path = tempdir("host-spans")?.join("trace.json");
    model.inner().write_timeline(Some(&path))?;
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let host: Vec<(String, f64, f64)> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "host")
        .map(|e| {
            let f = |k: &str| e[k].as_f64().unwrap();
            (e["name"].as_str().unwrap().to_string(), f("ts"), f("dur"))
        })
        .collect();
    let names: Vec<&str> = host.iter().map(|h| h.0.as_str()).collect();
    let at = |n: &str| {
        names
            .iter()
            .position(|&m| m == n)
            .unwrap_or_else(|| panic!("no host span {n:?} in {names:?}"))
    };
    // Spans are pushed when they end: each block's issue ends inside the
    // forward call, the caller's span between the forward and the backward.
    let order = [
        "layers.0 forward issued",
        "layers.1 forward issued",
        "forward call",
        "loss",
        "loss.backward",
        "backward checks",
        "backward setup",
        "layers.1 backward issued",
        "layers.0 backward issued",
        "backward end (waits for the copies)",
        "optimizer finish (reads the flags)",
    ];
    let pos: Vec<usize> = order.iter().map(|n| at(n)).collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{names:?}");
    assert!(host.iter().all(|h| h.2 >= 0.0), "{host:?}");
    // The forward call spans its blocks' issue.
    let (fwd, b0) = (
        &host[at("forward call")],
        &host[at("layers.0 forward issued")],
    );
    assert!(
        fwd.1 <= b0.1 && b0.1 + b0.2 <= fwd.1 + fwd.2 + 1.0,
        "{host:?}"
    );
    std::fs::remove_dir_all(path.parent().unwrap())?;
    Ok(())
}
candle_streamer::test_device!(host_spans_on_the_timeline);

/// A trainable streamed weight missing from the DeviceAdamW is an error naming
/// it, before the backward starts: no master changes.
fn device_step_needs_every_trainable_weight(dev: &Device) -> Result<()> {
    let (weights, x, pre, _) = setup(8, &[16])?;
    let model = StreamedSequential::from_tensors(
        weights,
        mlp_blocks(8, &[16]),
        cfg(dev, DType::F32, DType::F32, 1),
    )?
    .train();
    let before: Vec<Vec<f32>> = model
        .parameters()
        .iter()
        .map(|(_, v)| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
        .collect::<Result<_>>()?;
    let mut vars = model.trainable_vars()?;
    vars.remove(0);
    let mut opt = streamer_autograd::DeviceAdamW::new(vars, ParamsAdamW::default(), dev)?;
    let loss = model
        .forward(&x.to_device(dev)?.matmul(&pre.to_device(dev)?)?)?
        .sqr()?
        .mean_all()?;
    let err = model
        .backward_step_device(&loss, &mut opt)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not in the DeviceAdamW"), "{err}");
    for ((n, v), b) in model.parameters().iter().zip(&before) {
        let now = v.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(&now, b, "{n} changed");
    }
    Ok(())
}
candle_streamer::test_device!(device_step_needs_every_trainable_weight);
