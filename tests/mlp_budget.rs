//! A device budget that holds for an MLP: `MlpPlan`'s settings for a budget
//! train `FusedMlp` blocks with the rest of the GPU held back
//! (`train_mlp --device-budget`). A topic of its own, as `device_budget`:
//! the cap holds the GPU's memory from every other test in the process.
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use streamer_core::{device_total_memory, DeviceCap};

/// `MlpPlan`'s choices for two budgets (the larger takes the device
/// optimizer and keeps activations, the smaller the host optimizer) train
/// `FusedMlp` blocks under a cap of that budget for three steps with finite,
/// falling losses, the driver's count of the process's memory within the
/// budget after each. On the CPU the same settings train (no cap: it needs a
/// CUDA device, which `device_budget::budget_holds` checks).
fn mlp_budget_holds(dev: &Device) -> Result<()> {
    use candle_nn::Optimizer;
    use streamer_autograd::{OptimizerPlace, PlacedAdamW, Train};
    use streamer_core::{BlockSpec, StreamedSequential};
    use streamer_models::{fused_mlp, MlpPlan, MlpShape};
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
                crate::common::within(dev, (total, budget), cap)
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
