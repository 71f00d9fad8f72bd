//! A LoRA step in a device budget: the LoRA plan (`LoraPlan`) for a budget
//! that does not hold the whole step's activations splits it or recomputes,
//! and training an NF4 base with its micro-batches and activation policy
//! gives the losses of the plain step over the whole batch. On a GPU the
//! rest of the device is held back (`DeviceCap`) and the driver's count of
//! the process's memory stays within the budget at every step; each run
//! prints the device pool's peaks beside the plan (and an out-of-memory
//! error carries them), to tell a plan that misses tensors from a pool
//! that fragments. A topic of
//! its own: the cap holds the GPU's memory from every other test in the
//! process.
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use streamer_core::{device_total_memory, DeviceCap, WeightSource};
use streamer_models::{
    init_weights_where, is_quantizable, LayerFootprint, Llama, LlamaConfig, LoraAdapters,
    LoraConfig, LoraPlan, LoraStep, QuantizedWeights, StepRates, StepShape, LORA_TARGETS,
};
use streamer_quant::QuantScheme;

const STEPS: usize = 3;

/// The model, step and rates of the test: the `350m` preset over 8 x 512
/// tokens with measured rates on a GPU; on the CPU the tiny one over 4 x 32
/// with fixed ones.
fn setup(dev: &Device) -> Result<(LlamaConfig, StepShape, Option<StepRates>)> {
    Ok(match dev.is_cuda() {
        true => {
            let cfg = LlamaConfig::preset("350m")?;
            let shape = StepShape {
                rows: 8,
                seq: 512,
                dtype: DType::BF16,
            };
            let rates = StepRates::measure(&cfg, shape, 1, dev)?;
            (cfg, shape, Some(rates))
        }
        false => {
            let shape = StepShape {
                rows: 4,
                seq: 32,
                dtype: DType::F32,
            };
            (LlamaConfig::tiny(), shape, None)
        }
    })
}

/// An NF4 base of `cfg` with adapters (r 8 on all seven projections,
/// dropout 0.1), its masters in the compute dtype as `train_lm` makes them.
fn adapted(cfg: &LlamaConfig, lcfg: &LoraConfig, dev: &Device, dtype: DType) -> Result<Llama> {
    let nf4 = QuantScheme::parse("nf4")?;
    let dense = init_weights_where(cfg, 5, |n| !is_quantizable(n))?;
    let quant = QuantizedWeights::quantize_init(cfg, nf4, 5)?;
    let stream = streamer_core::StreamConfig {
        master_dtype: Some(dtype),
        ..crate::common::stream(dev, dtype, 1)
    };
    let model = Llama::streamed_quantized(&WeightSource::Tensors(dense), &quant, cfg, stream)?
        .into_trainable()?
        .outer_masters_to_device()?;
    model.set_lora(Some(LoraAdapters::init(lcfg, cfg, dev, 9)?))?;
    Ok(model)
}

/// `STEPS` AdamW steps of the adapters over the same batch as
/// `micro_batches` micro-batches, after each `check`; the losses.
fn train(
    model: &Llama,
    (x, y): (&Tensor, &Tensor),
    micro_batches: usize,
    mut check: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f32>> {
    let mut opt = crate::lora::adapters_adamw(model, 1e-3)?;
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (loss, grads) = model.lora_loss_and_grads(x, y, micro_batches)?;
        ensure!(loss.is_finite(), "step {step}: loss {loss}");
        opt.step(&grads)?;
        model.zero_grad()?;
        losses.push(loss);
        check(step)?;
    }
    Ok(losses)
}

fn lora_budget_holds(dev: &Device) -> Result<()> {
    let (cfg, shape, rates) = setup(dev)?;
    let rates = rates.unwrap_or(StepRates {
        piece_rows: 1,
        layer_forward_s: 1e-3,
        layer_backward_s: 2e-3,
        head_s: 1e-3,
        h2d_bytes_per_s: 2e10,
        d2h_bytes_per_s: 2e10,
    });
    let ids = |k: u32| -> Result<Tensor> {
        let v: Vec<u32> = (0..shape.rows * shape.seq)
            .map(|i| (i as u32 * 37 + k) % 256)
            .collect();
        Ok(Tensor::from_vec(v, (shape.rows, shape.seq), dev)?)
    };
    let (x, y) = (ids(11)?, ids(12)?);
    // Dropout draws each micro-batch's masks apart, so only the run without
    // it is compared with the whole batch; the one with it keeps its masks.
    for dropout in [0.0, 0.1] {
        let lcfg = LoraConfig::new(8, 16.0, dropout, &LORA_TARGETS)?;
        let (budget, plan) = plan_for_half(&cfg, &lcfg, shape, &rates)?;
        println!("dropout {dropout}: plan for {budget} bytes: {plan}");
        let want = match dropout {
            0.0 => Some(train(
                &adapted(&cfg, &lcfg, dev, shape.dtype)?,
                (&x, &y),
                1,
                |_| Ok(()),
            )?),
            _ => None,
        };
        let total = device_total_memory(dev)?;
        let cap = match total {
            Some(_) => Some(DeviceCap::hold(dev, budget)?),
            None => None,
        };
        let model = adapted(&cfg, &lcfg, dev, shape.dtype)?;
        (model.trainable_layers().context("streamed")?)
            .set_activation_policy(plan.activation_policy())?;
        streamer_core::reset_device_pool_peaks(dev)?;
        let got = train(&model, (&x, &y), plan.micro_batches, |step| {
            match (total, &cap) {
                (Some(total), Some(cap)) => crate::common::within(dev, (total, budget), cap)
                    .with_context(|| format!("dropout {dropout}, step {step}: {plan}")),
                _ => Ok(()),
            }
        })
        // What the allocator held, against the plan: live tensors above it
        // mean the plan misses something; reserved far above live, that
        // the pool fragments.
        .with_context(|| pool_figures(dev, &cap, plan.total(), budget));
        println!(
            "dropout {dropout}: {}",
            pool_figures(dev, &cap, plan.total(), budget)
        );
        let got = got?;
        drop((model, cap));
        // The same sums in another order (bf16 on a GPU).
        let tol = if dev.is_cuda() { 1e-2 } else { 1e-5 };
        for (s, (g, w)) in got.iter().zip(want.iter().flatten()).enumerate() {
            ensure!(
                (g - w).abs() <= tol * w.abs(),
                "step {s}: loss {g} under the plan against {w} for the whole batch"
            );
        }
    }
    Ok(())
}
candle_streamer::test_device!(lora_budget_holds);

/// The device pool's peaks since the run began (live tensors, reserved;
/// without what `cap` holds back, itself a pool allocation) beside the
/// plan's total and the budget, in MiB.
fn pool_figures(dev: &Device, cap: &Option<DeviceCap>, plan: usize, budget: usize) -> String {
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    let held = cap.as_ref().map_or(0, DeviceCap::held);
    match streamer_core::device_pool_stats(dev) {
        Ok(Some(p)) => format!(
            "pool peaks: {:.0} MiB live, {:.0} MiB reserved; plan {:.0} MiB, budget {:.0} MiB",
            mib(p.used_peak.saturating_sub(held)),
            mib(p.reserved_peak.saturating_sub(held)),
            mib(plan),
            mib(budget)
        ),
        Ok(None) => "no device pool (CPU)".into(),
        Err(e) => format!("pool figures unavailable: {e}"),
    }
}

/// A budget that holds the whole step with half its layers' activations,
/// and the plan for it, which must split the step or recompute.
fn plan_for_half(
    cfg: &LlamaConfig,
    lcfg: &LoraConfig,
    shape: StepShape,
    rates: &StepRates,
) -> Result<(usize, LoraPlan)> {
    let nf4 = QuantScheme::parse("nf4")?;
    let step = LoraStep {
        cfg,
        lora: lcfg,
        shape,
        layer_bytes: LayerFootprint::of_base(cfg, shape.dtype, None, Some(nf4))?.slot,
    };
    let layers = cfg.num_hidden_layers;
    let whole = LoraPlan::estimate(&step, 1, false, usize::MAX / 2).context("unbounded")?;
    ensure!(whole.kept_layers == layers, "{whole}");
    let budget = whole.total() - step.kept_per_layer(shape.rows) * layers / 2;
    let plan = LoraPlan::choose(&step, budget, rates)?;
    ensure!(
        plan.total() <= budget && (plan.micro_batches > 1 || plan.kept_layers < layers),
        "{plan} does not split or recompute in {budget} bytes"
    );
    Ok((budget, plan))
}
