//! A device budget that holds: the planner's settings for a small budget
//! train a model with the rest of the GPU held back (`DeviceCap`), so a step
//! that needed more would fail with out-of-memory; the driver's count of the
//! process's memory stays within the budget; the same for `MlpPlan` and an
//! MLP of `FusedMlp` blocks (`train_mlp --device-budget`). A topic of its
//! own: the cap holds the GPU's memory from every other test running in the
//! process, and its tests take turns ([`CAP`]).
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use streamer_core::{device_total_memory, free_device_memory, DeviceCap};
use streamer_models::{
    init_weights, DevicePlan, Llama, LlamaConfig, LmTrainer, StepRates, StepShape,
};

/// Held by a test while it caps the device: one cap at a time.
static CAP: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn budget_holds(dev: &Device) -> Result<()> {
    let _turn = CAP.lock().unwrap_or_else(|e| e.into_inner());
    if dev.is_cpu() {
        let err = DeviceCap::hold(dev, 1 << 30)
            .err()
            .context("a cap on the CPU")?;
        ensure!(err.to_string().contains("needs a CUDA device"), "{err}");
        ensure!(device_total_memory(dev)?.is_none());
        return Ok(());
    }
    let total = device_total_memory(dev)?.context("a CUDA device has a total")?;
    let err = DeviceCap::hold(dev, total + (1 << 30))
        .err()
        .context("too large")?;
    ensure!(
        matches!(streamer_device::Error::find(&err),
            Some(&streamer_device::Error::OutOfMemory { needed, free, .. })
                if needed == total + (1 << 30) && free == total),
        "{err}"
    );
    let cfg = LlamaConfig::preset("350m")?;
    let shape = StepShape {
        rows: 16,
        seq: 512,
        dtype: DType::BF16,
    };
    let budget = 4usize << 30;
    let plan = DevicePlan::choose(&cfg, shape, (budget, total))?;
    println!("plan: {plan}");
    let rates = StepRates::measure(&cfg, shape, plan.settings.piece_rows, dev)?;
    let expect = plan.expect(&cfg, shape, &rates);
    println!("expects {expect} from {rates:?}");
    for (what, v) in [
        ("forward", rates.layer_forward_s),
        ("backward", rates.layer_backward_s),
        ("h2d", rates.h2d_bytes_per_s),
        ("d2h", rates.d2h_bytes_per_s),
        ("tokens/s", expect.tokens_per_s),
    ] {
        ensure!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    // Copies over PCIe (or NVLink-C2C) run above 1 GB/s on any such GPU.
    ensure!(
        rates.h2d_bytes_per_s > 1e9 && rates.d2h_bytes_per_s > 1e9,
        "{rates:?}"
    );
    let cap = DeviceCap::hold(dev, budget)?;
    let s = plan.settings;
    let stream = crate::common::stream(dev, DType::BF16, s.window - 1);
    let model = Llama::from_tensors(init_weights(&cfg, 0)?, &cfg, stream)?.into_trainable()?;
    let params = ParamsAdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let mut t = LmTrainer::new_on(model, params, s.place)?;
    let layers = t.model().trainable_layers().context("streamed")?;
    layers.set_activation_policy(s.activation_policy())?;
    let tokens = |k: u32| -> Result<Tensor> {
        let v: Vec<u32> = (0..shape.rows * shape.seq)
            .map(|i| (i as u32 * 31 + k) % 256)
            .collect();
        Ok(Tensor::from_vec(v, (shape.rows, shape.seq), dev)?)
    };
    for step in 0..3 {
        let loss = t.step_micro(&tokens(step)?, &tokens(step + 1)?, 16 / s.piece_rows)?;
        ensure!(loss.is_finite(), "step {step}: loss {loss}");
        within(dev, (total, budget), &cap).with_context(|| format!("step {step}: {plan}"))?;
    }
    Ok(())
}
candle_streamer::test_device!(budget_holds);

/// Fails unless the driver counts at most `budget` bytes of the device's
/// `total` in use by this process besides what `cap` holds back.
fn within(dev: &Device, (total, budget): (usize, usize), cap: &DeviceCap) -> Result<()> {
    dev.synchronize()?;
    let free = free_device_memory(dev)?.context("free")?;
    let used = total - free - cap.held();
    ensure!(
        used <= budget,
        "{used} bytes in use with a budget of {budget}"
    );
    Ok(())
}

/// `MlpPlan`'s choices for two budgets (the larger takes the device
/// optimizer and keeps activations, the smaller the host optimizer) train
/// `FusedMlp` blocks under a cap of that budget for three steps with finite,
/// falling losses, the driver's count of the process's memory within the
/// budget after each. On the CPU the same settings train (no cap: it needs a
/// CUDA device, which `budget_holds` checks).
fn mlp_budget_holds(dev: &Device) -> Result<()> {
    use candle_nn::Optimizer;
    use streamer_autograd::{OptimizerPlace, PlacedAdamW, Train};
    use streamer_core::{BlockSpec, StreamedSequential};
    use streamer_models::{fused_mlp, MlpPlan, MlpShape};
    let _turn = CAP.lock().unwrap_or_else(|e| e.into_inner());
    let (blocks, width, hidden, rows) = match dev.is_cuda() {
        true => (6, 1024, 4096, 4096),
        false => (3, 64, 256, 128),
    };
    let dtype = crate::common::compute_dtype(dev);
    let shape = MlpShape {
        blocks,
        width,
        hidden,
        rows,
        dtype,
    };
    let total = device_total_memory(dev)?.unwrap_or(16 << 30);
    let device_opt = MlpPlan::estimate(
        shape,
        streamer_models::MlpSettings {
            place: OptimizerPlace::Device,
            window: 2,
            keep_bytes: 0,
        },
    );
    let roomy = device_opt.total() + 2 * shape.kept_block_bytes();
    // Without room for three quarters of the moments: no device optimizer,
    // whatever the window.
    let tight = device_opt.total() - device_opt.optimizer * 3 / 4;
    for (budget, place) in [
        (roomy, OptimizerPlace::Device),
        (tight, OptimizerPlace::Host),
    ] {
        let plan = MlpPlan::choose(shape, (budget, total))?;
        println!("{:.2} GiB: {plan}", budget as f64 / (1u64 << 30) as f64);
        ensure!(plan.settings.place == place, "{plan}");
        let s = plan.settings;
        let cap = match dev.is_cuda() {
            true => Some(DeviceCap::hold(dev, budget)?),
            false => None,
        };
        let host = crate::fused_mlp::host_mlp(blocks, width, hidden)?;
        let specs = (0..blocks)
            .map(|i| {
                BlockSpec::new(format!("layers.{i}"), move |vb| {
                    fused_mlp(width, hidden, vb)
                })
            })
            .collect();
        let stream = crate::common::stream(dev, dtype, s.window - 1);
        let model = StreamedSequential::from_tensors(host, specs, stream)?.train();
        model.set_activation_policy(s.activation_policy())?;
        let params = ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        };
        let mut opt = PlacedAdamW::new(model.trainable_vars()?, params, s.place, dev)?;
        let x = Tensor::randn(0f32, 1.0, (rows, width), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let mut losses = Vec::new();
        for step in 0..3 {
            let loss = model.forward(&x)?.to_dtype(DType::F32)?.sqr()?.mean_all()?;
            losses.push(loss.to_scalar::<f32>()?);
            match s.place {
                OptimizerPlace::Host => opt.step(&model.backward(&loss)?)?,
                OptimizerPlace::Device => drop(opt.backward_step(&model, &loss)?),
            }
            model.zero_grad()?;
            if let Some(cap) = &cap {
                within(dev, (total, budget), cap)
                    .with_context(|| format!("step {step}: {plan}"))?;
            }
        }
        ensure!(
            losses.iter().all(|l| l.is_finite()) && losses[2] < losses[0],
            "{losses:?}"
        );
    }
    Ok(())
}
candle_streamer::test_device!(mlp_budget_holds);
