//! LoRA against full fine-tuning of the same streamed model: tokens/s, peak
//! device memory and host memory. Both stream the decoder layers through a
//! window of device slots from host masters: f32 for full fine-tuning, which
//! steps AdamW over every weight (`LmTrainer`; on the device by default on a
//! GPU, `LORA_BENCH_OPTIMIZER=host` for `CpuAdamW` overlapped with
//! backward), the compute dtype for LoRA, which freezes the base (no gradient
//! for it, embedding and head included) and steps `DeviceAdamW` over the
//! adapters only (one fused kernel a tensor; the LoRA rows of
//! `quantized-h100.json` and `quantized-h200.json` stepped candle-nn AdamW).
//!
//!     cargo bench --bench lora [--features cuda]
//!
//! `LORA_BENCH=8b,3b` picks the models (GPU default; CPU default `tiny`): `8b`
//! has Llama 3.1 8B's shapes and real-size vocabulary (128256, llama3 rope) with
//! random weights in the real layout, `70b` Llama 3.1 70B's, `14b` Qwen2.5
//! 14B's, `3b` is the preset of that name.
//! `LORA_BENCH_QUANTIZE=nf4|fp4|int8|fp8` (LoRA rows; QLoRA): the base's
//! linear weights are packed quantized masters made from random codes layer
//! by layer (`QuantizedWeights::synthetic`, never a dense copy), streamed as
//! packed bytes and dequantized on the device; the rest is random init in the
//! compute dtype. A 70B NF4 base takes about 39 GB of host memory.
//! `LORA_BENCH_MODES` (default `lora,full`), `LORA_BENCH_R` (16),
//! `LORA_BENCH_TARGETS` (`q_proj,k_proj,v_proj,o_proj`), `LORA_BENCH_BATCH` /
//! `LORA_BENCH_SEQ` (8 x 2048 on a GPU), `LORA_BENCH_STEPS` (3 timed after 1
//! warm-up), `LORA_BENCH_WINDOW` (2 layers on the device),
//! `LORA_BENCH_OPTIMIZER_STATE` (`f32` or `bf16` moments),
//! `LORA_BENCH_ACTIVATIONS` (the layers' `ActivationPolicy`),
//! `LORA_BENCH_PLAN=1` (full fine-tuning: the device plan for the free
//! memory or the cap chooses the optimizer's place, activations, pieces and
//! window, and says the tokens/s it expects),
//! `LORA_BENCH_TIMELINE=DIR` (the pool's Chrome-trace timeline of the run to
//! `DIR/lora-timeline-<model>-<mode>.json`),
//! `LORA_BENCH_DEVICE_CAP_GIB` (hold back the rest of the GPU's memory so the
//! run has that much in all, as on a smaller GPU), `LORA_BENCH_MICRO`
//! (micro-batches of `LORA_BENCH_BATCH` sequences a step, 1; every layer's
//! weights visit the GPU once a step whatever the count), `LORA_BENCH_ACCUM`
//! (LoRA rows: the step's sequences as that many micro-batches one after
//! another, each visiting every layer: gradient accumulation). Full fine-tuning
//! of `8b` with the host optimizer holds about 16 bytes a parameter on the
//! host (masters, AdamW moments, gradients): 128 GB, more than a one-GPU
//! machine of 128 GiB has; with bf16 moments 12 bytes (96 GB); with
//! `DeviceAdamW` the moments (64 GB) are on the GPU. LoRA needs the bf16
//! masters only.
//!
//! Writes `benches/results/lora-<device>.json`.
#[path = "common/mod.rs"]
mod common;

/// The training rows' peak learning rate (reached at the last step).
const LR: f64 = 1e-4;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW};
use std::collections::HashMap;
use std::time::Instant;
use streamer_autograd::ActivationPolicy;
use streamer_core::{device_total_memory, free_device_memory, StreamConfig, WeightSource};
use streamer_models::{
    init_weights, init_weights_where, is_quantizable, ByteCorpus, DevicePlan, Expectation,
    HostPlan, Llama, LlamaConfig, LmTrainer, LoraAdapters, LoraConfig, LoraPlan, LoraStep,
    OptimizerPlace, PlanChoices, PlanLimits, QuantizedWeights, StateDtype, StepRates, StepShape,
    TrainSetup,
};
use streamer_quant::QuantScheme;

struct Measured {
    step_s: Vec<f64>,
    loss: Vec<f32>,
    /// Peak device memory above what was in use before the steps.
    peak_device: usize,
    /// Peak device memory in use as the driver counts it (the process's
    /// context and everything it allocated), less a `DeviceCap`'s hold.
    peak_total: usize,
    host_rss: usize,
}

/// Runs `1 + steps` steps of `step` (the first untimed) on the corpus.
fn measure(
    (dev, held): (&Device, usize),
    data: &ByteCorpus,
    (batch, seq, steps): (usize, usize, usize),
    mut step: impl FnMut(&candle_core::Tensor, &candle_core::Tensor, f64) -> Result<f32>,
) -> Result<Measured> {
    streamer_core::trim_device_memory(dev)?;
    let base = common::used_now(dev);
    let sampler = common::MemSampler::start(dev);
    let (mut step_s, mut loss) = (Vec::new(), Vec::new());
    let schedule = common::bench_schedule(LR, steps + 1);
    for s in 0..steps + 1 {
        let (x, y) = data.batch(0, s as u64, batch, seq, dev)?;
        dev.synchronize()?;
        let t = Instant::now();
        loss.push(step(&x, &y, schedule.at(s))?);
        dev.synchronize()?;
        if s > 0 {
            step_s.push(t.elapsed().as_secs_f64());
        }
        println!("  step {s}: {:.3} s", t.elapsed().as_secs_f64());
    }
    let peak = common::MemSampler::finish(sampler);
    Ok(Measured {
        step_s,
        loss,
        peak_device: peak.saturating_sub(base),
        peak_total: peak.saturating_sub(held),
        host_rss: common::host_rss().0,
    })
}

/// The host memory the full fine-tune's settings imply (`HostPlan`).
fn host_plan(
    cfg: &LlamaConfig,
    dev: &Device,
    ((batch, seq, _), dtype): ((usize, usize, usize), DType),
    (place, state, policy): (OptimizerPlace, StateDtype, Option<ActivationPolicy>),
) -> Result<HostPlan> {
    let offload = policy == Some(ActivationPolicy::OffloadInputs);
    Ok(HostPlan::for_training(
        cfg,
        &TrainSetup {
            master_dtype: DType::F32,
            place,
            state,
            cuda: dev.is_cuda(),
            offload_inputs: offload.then_some((batch, seq, dtype)),
        },
    ))
}

/// The random init, rounded to bf16 when it and the f32 masters made from it
/// would not fit the host together (14b: 59 GB each); the masters are f32
/// either way, from the rounded values.
fn random_init(cfg: &LlamaConfig) -> Result<HashMap<String, Tensor>> {
    use rayon::prelude::*;
    let w = init_weights(cfg, 0)?;
    let both = 8 * cfg.num_params();
    match streamer_core::host_available_memory() {
        Some(avail) if both > avail / 10 * 9 => {
            println!(
                "  init rounded to bf16: it and the f32 masters would take {:.0} GiB of {:.0} available",
                both as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            );
            Ok(w.into_par_iter()
                .map(|(k, t)| Ok((k, t.to_dtype(DType::BF16)?)))
                .collect::<candle_core::Result<_>>()?)
        }
        _ => Ok(w),
    }
}

/// The streamed model of `cfg` from random weights: dense, or with `scheme`
/// its linear weights packed quantized masters of random codes (made one
/// tensor at a time, so a 70B base needs about its packed size of host
/// memory) and the rest random init in the compute dtype. Returns the packed
/// bytes too (0 when dense).
fn build_model(
    cfg: &LlamaConfig,
    stream: StreamConfig,
    scheme: Option<QuantScheme>,
) -> Result<(Llama, usize)> {
    let t0 = std::time::Instant::now();
    let Some(scheme) = scheme else {
        let weights = random_init(cfg)?;
        println!("  random init: {:.1} s", t0.elapsed().as_secs_f64());
        return Ok((Llama::from_tensors(weights, cfg, stream)?, 0));
    };
    let dense = init_weights_where(cfg, 0, |n| !is_quantizable(n))?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(stream.dtype)?)))
        .collect::<candle_core::Result<HashMap<_, _>>>()?;
    let quant = QuantizedWeights::synthetic(cfg, scheme, 0, 0.05)?;
    let packed = quant.packed_bytes();
    println!(
        "  random init, linear weights {scheme:?} ({:.2} GiB packed): {:.1} s",
        packed as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    let model = Llama::streamed_quantized(&WeightSource::Tensors(dense), &quant, cfg, stream)?;
    Ok((model, packed))
}

/// Where a step went, averaged over `steps` (the pool's statistics: copies
/// each way, compute, waits for weights; the overlapped host optimizer's busy
/// time in the last step; the blocks whose activations the last forward
/// kept), printed and as a JSON object. With `LORA_BENCH_TIMELINE=DIR`,
/// the pool's timeline of every step (copies, and each block's compute
/// between GPU events) goes to `DIR/lora-timeline-<tag>.json`.
fn where_time_goes(model: &Llama, steps: usize, tag: &str) -> Result<serde_json::Value> {
    let layers = model
        .trainable_layers()
        .expect("a trainable streamed model");
    if let Ok(dir) = std::env::var("LORA_BENCH_TIMELINE") {
        let path = std::path::Path::new(&dir).join(format!("lora-timeline-{tag}.json"));
        layers.inner().write_timeline(Some(&path))?;
        println!("  timeline: {}", path.display());
    }
    let st = layers.stats()?;
    let n = steps as f64;
    let v = serde_json::json!({
        "h2d_gb": st.h2d_bytes as f64 / n / 1e9, "h2d_s": st.h2d_seconds / n,
        "d2h_gb": st.d2h_bytes as f64 / n / 1e9, "d2h_s": st.d2h_seconds / n,
        "compute_s": st.compute_seconds / n, "stall_s": st.stall_seconds / n,
        "host_wait_s": st.host_wait_seconds / n,
        "host_optimizer_s_last": layers.last_optimizer_seconds()?,
        "kept_blocks": layers.kept_blocks()?, "spilled_blocks": layers.spilled_blocks()?,
    });
    println!("  a step on average: {v}");
    Ok(v)
}

/// LORA_BENCH_OPTIMIZER=host|device (default device on a GPU: the full 8B
/// fine-tune's f32 host optimizer state would not fit the host).
fn optimizer_place(dev: &Device) -> Result<OptimizerPlace> {
    Ok(match std::env::var("LORA_BENCH_OPTIMIZER").as_deref() {
        Ok("host") => OptimizerPlace::Host,
        Ok("device") => OptimizerPlace::Device,
        Err(_) if dev.is_cuda() => OptimizerPlace::Device,
        Err(_) => OptimizerPlace::Host,
        Ok(other) => bail!("LORA_BENCH_OPTIMIZER: unknown {other:?} (host or device)"),
    })
}

/// LORA_BENCH_ACTIVATIONS: the layers' activation policy (recompute,
/// offload, keep:<bytes>, auto[:fraction]; unset: the default, auto).
fn activations() -> Result<Option<ActivationPolicy>> {
    Ok(std::env::var("LORA_BENCH_ACTIVATIONS")
        .ok()
        .map(|p| p.parse::<ActivationPolicy>())
        .transpose()?)
}

/// LORA_BENCH_ACCUM (LoRA rows): the step's sequences as that many
/// micro-batches run one after another (default 1), each its own forward and
/// backward and so its own visit of every layer's weights.
fn lora_accumulation(rows: usize) -> Result<usize> {
    let accum = common::env_usize("LORA_BENCH_ACCUM", 1);
    if accum == 0 || !rows.is_multiple_of(accum) {
        bail!("LORA_BENCH_ACCUM={accum}: the step's {rows} sequences do not split into that many");
    }
    if accum > 1 {
        println!(
            "  {accum} micro-batches of {} sequences one after another",
            rows / accum
        );
    }
    Ok(accum)
}

/// LORA_BENCH_PLAN=1 on a LoRA row: the LoRA plan for the cap
/// (`LORA_BENCH_DEVICE_CAP_GIB`, else the whole device) decides the
/// micro-batches run one after another and the activations kept, as
/// `train_lm --lora-r R --device-budget B` does; printed with the tokens/s it
/// expects from one layer timed here.
fn lora_bench_plan(step: &LoraStep, dev: &Device) -> Result<Option<(LoraPlan, Expectation)>> {
    if std::env::var("LORA_BENCH_PLAN").as_deref() != Ok("1") {
        return Ok(None);
    }
    for key in ["LORA_BENCH_ACTIVATIONS", "LORA_BENCH_ACCUM"] {
        if std::env::var(key).is_ok() {
            bail!("LORA_BENCH_PLAN chooses what {key} sets: give one or the other");
        }
    }
    let budget = match std::env::var("LORA_BENCH_DEVICE_CAP_GIB") {
        Ok(g) => g.parse::<usize>().context("LORA_BENCH_DEVICE_CAP_GIB")? << 30,
        Err(_) => device_total_memory(dev)?.context("LORA_BENCH_PLAN plans a CUDA device")?,
    };
    let rates = StepRates::measure(step.cfg, step.shape, 1, dev)?;
    let plan = LoraPlan::choose(step, budget, &rates)?;
    let expect = plan.expect(step, &rates);
    println!("  LoRA plan: {plan}\n  expects {expect} ({rates:?})");
    Ok(Some((plan, expect)))
}

/// LORA_BENCH_PLAN=1 (full fine-tuning on a GPU): the device plan for the
/// memory free now (or `LORA_BENCH_DEVICE_CAP_GIB`) decides the optimizer's
/// place (among `LORA_BENCH_OPTIMIZER` if given), the activations, the pieces
/// of the step's sequences and the window, as `train_lm` does with no flags;
/// printed with the tokens/s it expects from one layer timed here.
fn bench_plan(
    cfg: &LlamaConfig,
    dev: &Device,
    (rows, seq): (usize, usize),
    dtype: DType,
) -> Result<Option<(DevicePlan, Expectation)>> {
    if std::env::var("LORA_BENCH_PLAN").as_deref() != Ok("1") {
        return Ok(None);
    }
    for key in ["LORA_BENCH_ACTIVATIONS", "LORA_BENCH_WINDOW"] {
        if std::env::var(key).is_ok() {
            bail!("LORA_BENCH_PLAN chooses what {key} sets: give one or the other");
        }
    }
    let total = device_total_memory(dev)?.context("LORA_BENCH_PLAN plans a CUDA device")?;
    let budget = match std::env::var("LORA_BENCH_DEVICE_CAP_GIB") {
        Ok(g) => g.parse::<usize>().context("LORA_BENCH_DEVICE_CAP_GIB")? << 30,
        Err(_) => free_device_memory(dev)?.unwrap_or(total),
    };
    let places = match std::env::var("LORA_BENCH_OPTIMIZER") {
        Ok(_) => vec![optimizer_place(dev)?],
        Err(_) => vec![OptimizerPlace::Device, OptimizerPlace::Host],
    };
    let shape = StepShape { rows, seq, dtype };
    let given = given_optimizer_state()?.map(|s| [s]);
    let choices = PlanChoices {
        places: &places,
        states: given.as_ref().map_or(PlanChoices::default().states, |s| s),
    };
    let limits = PlanLimits {
        device_budget: budget,
        device_total: total,
        host_available: streamer_core::host_available_memory(),
    };
    let plan = DevicePlan::choose_among(cfg, shape, limits, choices)?;
    println!("  device plan: {plan}");
    let rates = StepRates::measure(cfg, shape, plan.settings.piece_rows, dev)?;
    let expect = plan.expect(cfg, shape, &rates);
    println!("  expects {expect} ({rates:?})");
    Ok(Some((plan, expect)))
}

/// LORA_BENCH_OPTIMIZER_STATE=f32|bf16: AdamW's moments (unset: f32, or
/// with LORA_BENCH_PLAN=1 the plan's choice).
fn given_optimizer_state() -> Result<Option<StateDtype>> {
    std::env::var("LORA_BENCH_OPTIMIZER_STATE")
        .ok()
        .map(|s| Ok(s.parse::<StateDtype>()?))
        .transpose()
}

/// One row: `shape` is (sequences a step, tokens a sequence, timed steps),
/// run as `micro` micro-batches.
fn run(
    name: &str,
    mode: &str,
    dev: &Device,
    (shape, micro): ((usize, usize, usize), usize),
) -> Result<serde_json::Value> {
    let cfg = common::model_config(name)?;
    let scheme = common::quant_scheme("LORA_BENCH_QUANTIZE")?;
    if scheme.is_some() && mode != "lora" {
        bail!("LORA_BENCH_QUANTIZE: a quantized base trains LoRA adapters only (LORA_BENCH_MODES=lora)");
    }
    let dtype = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let planned = match mode {
        "full" => bench_plan(&cfg, dev, (shape.0, shape.1), dtype)?,
        _ => None,
    };
    let (micro, window) = match &planned {
        Some((p, _)) => (shape.0 / p.settings.piece_rows, p.settings.window),
        None => (micro, common::env_usize("LORA_BENCH_WINDOW", 2).max(1)),
    };
    let (place, state, policy) = match &planned {
        Some((p, _)) => (
            p.settings.place,
            p.settings.state,
            Some(p.settings.activation_policy()),
        ),
        None => (
            optimizer_place(dev)?,
            given_optimizer_state()?.unwrap_or_default(),
            activations()?,
        ),
    };
    let stream = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: window - 1,
        dtype,
        // LoRA's frozen base needs no f32 masters (train_lm uses the compute
        // dtype for them too); full fine-tuning steps f32 masters.
        master_dtype: Some(if mode == "lora" { dtype } else { DType::F32 }),
        timeline: std::env::var("LORA_BENCH_TIMELINE").is_ok(),
        ..Default::default()
    };
    // LORA_BENCH_DEVICE_CAP_GIB: the GPU behaves as one of that size.
    let cap = common::cap_device_memory(
        dev,
        std::env::var("LORA_BENCH_DEVICE_CAP_GIB")
            .ok()
            .map(|g| g.parse::<usize>().map(|g| g << 30))
            .transpose()?,
    )?;
    if cap.held() > 0 {
        println!(
            "  device capped: {:.1} GiB held back",
            cap.held() as f64 / (1u64 << 30) as f64
        );
    }
    let data = ByteCorpus::from_file("data/corpus.txt")
        .unwrap_or_else(|_| ByteCorpus::new((0..1 << 20).map(|i| (i * 31 % 251) as u8).collect()));
    let plan = (mode == "full")
        .then(|| host_plan(&cfg, dev, (shape, dtype), (place, state, policy)))
        .transpose()?;
    if let Some(p) = &plan {
        println!("  host plan: {p}");
    }
    // Each setup phase says how long it took: at 8B shapes they are most of a
    // run, and a run cut by a time limit then still says where it was.
    let t0 = std::time::Instant::now();
    let (model, packed) = build_model(&cfg, stream, scheme)?;
    if let Some(t) = model.streamed_layers().map(|l| l.setup_times()) {
        println!(
            "  host masters {:.1} s, page-locked {:.1} s",
            t.masters_s, t.pin_s
        );
    }
    let t1 = std::time::Instant::now();
    let model = model.into_trainable()?;
    println!("  made trainable: {:.1} s", t1.elapsed().as_secs_f64());
    if micro > 1 && mode == "lora" {
        let layers = model
            .trainable_layers()
            .expect("a trainable streamed model");
        layers.set_micro_batch_rows(Some(shape.0 / micro))?;
    }
    println!(
        "  model built (masters page-locked): {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let mut full_setup = None;
    let mut lora_planned = None;
    let mut accum = match mode {
        "lora" => lora_accumulation(shape.0)?,
        _ => 1,
    };
    let per_step;
    let (m, trainable) = match mode {
        "full" => {
            println!("  full fine-tune optimizer: {place:?}, {state:?} moments");
            let t0 = std::time::Instant::now();
            let mut t = LmTrainer::new_with(
                model,
                ParamsAdamW {
                    lr: LR,
                    ..Default::default()
                },
                place,
                state,
            )?;
            println!(
                "  optimizer state allocated: {:.1} s",
                t0.elapsed().as_secs_f64()
            );
            t.set_overlap(true);
            if let Some(policy) = policy {
                t.model()
                    .trainable_layers()
                    .expect("a trainable streamed model")
                    .set_activation_policy(policy)?;
                println!("  activations: {policy:?}");
            }
            full_setup = Some((place, state));
            let m = measure((dev, cap.held()), &data, shape, |x, y, lr| {
                t.set_learning_rate(lr);
                Ok(t.step_micro(x, y, micro)?)
            })?;
            per_step = Some(where_time_goes(
                t.model(),
                shape.2 + 1,
                &format!("{name}-{mode}"),
            )?);
            (m, cfg.num_params())
        }
        "lora" => {
            let targets = std::env::var("LORA_BENCH_TARGETS")
                .unwrap_or_else(|_| "q_proj,k_proj,v_proj,o_proj".into());
            let targets: Vec<&str> = targets.split(',').collect();
            let r = common::env_usize("LORA_BENCH_R", 16);
            let lcfg = LoraConfig::new(r, 2.0 * r as f64, 0.0, &targets)?;
            // The frozen embedding, norm and head stay on the device, as
            // train_lm keeps them, rather than copied up at every step.
            let model = model.outer_masters_to_device()?;
            model.set_lora(Some(LoraAdapters::init(&lcfg, &cfg, dev, 0)?))?;
            let layer_bytes = match packed {
                0 => cfg.layer_params() * dtype.size_in_bytes(),
                p => p / cfg.num_hidden_layers,
            };
            let step = LoraStep {
                cfg: &cfg,
                lora: &lcfg,
                shape: StepShape {
                    rows: shape.0,
                    seq: shape.1,
                    dtype,
                },
                layer_bytes,
            };
            let mut policy = policy;
            if let Some((p, e)) = lora_bench_plan(&step, dev)? {
                accum = p.micro_batches;
                policy = Some(p.activation_policy());
                lora_planned = Some((p, e));
            }
            if let Some(policy) = policy {
                (model.trainable_layers())
                    .expect("a trainable streamed model")
                    .set_activation_policy(policy)?;
                println!("  activations: {policy:?}");
            }
            let vars: Vec<_> = model.lora()?.map(|a| a.vars()).unwrap_or_default();
            let n = vars.iter().map(|(_, v)| v.elem_count()).sum();
            let mut opt = streamer_autograd::DeviceAdamW::new(
                vars.into_iter().map(|(_, v)| v).collect(),
                ParamsAdamW {
                    lr: LR,
                    ..Default::default()
                },
                dev,
            )?;
            let m = measure((dev, cap.held()), &data, shape, |x, y, lr| {
                opt.set_learning_rate(lr);
                let (loss, grads) = model.lora_loss_and_grads(x, y, accum)?;
                opt.step(&grads)?;
                model.zero_grad()?;
                Ok(loss)
            })?;
            per_step = Some(where_time_goes(
                &model,
                shape.2 + 1,
                &format!("{name}-{mode}"),
            )?);
            (m, n)
        }
        other => bail!("unknown LORA_BENCH_MODES entry {other:?} (lora or full)"),
    };
    let mut s = m.step_s.clone();
    s.sort_by(f64::total_cmp);
    let median = s[s.len() / 2];
    let tokens = (shape.0 * shape.1) as f64 / median;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    println!(
        "{name} {mode}: {median:.3} s a step, {tokens:.0} tokens/s, peak device {:.2} GiB above the start, \
         {:.2} GiB in all (driver), host RSS {:.2} GiB, {trainable} trainable, loss {:?}",
        gib(m.peak_device),
        gib(m.peak_total),
        gib(m.host_rss),
        m.loss
    );
    Ok(serde_json::json!({
        "model": name, "mode": mode, "params": cfg.num_params(), "trainable_params": trainable,
        "batch": shape.0 / micro, "micro_batches": micro, "seq": shape.1,
        "accumulation": accum,
        "tokens_per_step": shape.0 * shape.1, "step_s_median": median, "step_s": m.step_s,
        "tokens_per_s": tokens, "peak_device_gib": gib(m.peak_device), "host_rss_gib": gib(m.host_rss),
        "peak_device_total_gib": gib(m.peak_total),
        "host_plan_gib": plan.map(|p| gib(p.total())),
        "device_cap_gib": std::env::var("LORA_BENCH_DEVICE_CAP_GIB").ok(),
        "dtype": format!("{dtype:?}"), "losses": m.loss,
        "format": std::env::var("LORA_BENCH_QUANTIZE").unwrap_or_else(|_| "dense".into()),
        "packed_gib": (packed > 0).then(|| gib(packed)),
        "mfu": 6.0 * cfg.num_params() as f64 * tokens / 989e12,
        "optimizer_place": full_setup.map(|(p, _)| format!("{p:?}")),
        "state_dtypes": full_setup.map(|(_, s)| format!("masters F32, moments {s:?}")),
        "activations": planned.as_ref().map(|(p, _)| format!("{:?}", p.settings.activation_policy()))
            .or_else(|| lora_planned.as_ref().map(|(p, _)| format!("{:?}", p.activation_policy())))
            .or_else(|| std::env::var("LORA_BENCH_ACTIVATIONS").ok()),
        "device_plan": planned.as_ref().map(|(p, _)| p.to_string()),
        "lora_plan": lora_planned.as_ref().map(|(p, _)| p.to_string()),
        "expected_tokens_per_s": planned.as_ref().map(|(_, e)| e.tokens_per_s)
            .or(lora_planned.as_ref().map(|(_, e)| e.tokens_per_s)),
        "per_step": per_step,
    }))
}

fn main() -> Result<()> {
    let dev = common::device();
    let gpu = dev.is_cuda();
    let models =
        std::env::var("LORA_BENCH").unwrap_or_else(|_| if gpu { "8b,3b" } else { "tiny" }.into());
    let modes = std::env::var("LORA_BENCH_MODES").unwrap_or_else(|_| "lora,full".into());
    let micro = common::env_usize("LORA_BENCH_MICRO", 1).max(1);
    let shape = (
        common::env_usize("LORA_BENCH_BATCH", if gpu { 8 } else { 4 }) * micro,
        common::env_usize("LORA_BENCH_SEQ", if gpu { 2048 } else { 64 }),
        common::env_usize("LORA_BENCH_STEPS", 3).max(1),
    );
    let mut rows = Vec::new();
    for name in models.split(',') {
        for mode in modes.split(',') {
            println!(
                "{name} {mode}: {micro} x {} sequences of {} tokens a step",
                shape.0 / micro,
                shape.1
            );
            // One row per run, so that a failure (out of memory) leaves the others.
            match run(name, mode, &dev, (shape, micro)) {
                Ok(r) => rows.push(r),
                Err(e) => {
                    println!("{name} {mode}: failed: {e}");
                    rows.push(
                        serde_json::json!({"model": name, "mode": mode, "error": e.to_string()}),
                    );
                }
            }
            let path = common::results_path(&format!("lora-{}.json", common::device_tag(&dev)));
            std::fs::write(&path, serde_json::to_string_pretty(&rows)?)?;
        }
    }
    Ok(())
}
