//! A device budget that holds: the planner's settings for a small budget
//! train a model with the rest of the GPU held back (`DeviceCap`), so a step
//! that needed more would fail with out-of-memory; the driver's count of the
//! process's memory stays within the budget. A topic of its own: the cap
//! holds the GPU's memory from every other test running in the process.
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::ParamsAdamW;
use streamer_core::{device_total_memory, DeviceCap};
use streamer_models::{
    init_weights, DevicePlan, Llama, LlamaConfig, LmTrainer, StepRates, StepShape,
};

fn budget_holds(dev: &Device) -> Result<()> {
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
        crate::common::within(dev, (total, budget), &cap)
            .with_context(|| format!("step {step}: {plan}"))?;
    }
    Ok(())
}
candle_streamer::test_device!(budget_holds);
