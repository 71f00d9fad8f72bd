//! Batched generation throughput (`generate_batch`) of a streamed model (and
//! of the placement a device budget plans), on
//! FlexGen's workload: prompts of `GEN_BENCH_PROMPT` tokens (512 on a GPU),
//! `GEN_BENCH_NEW` new tokens each (32), greedy. Each row runs
//! `GEN_BENCH_JOB` (default 2) times as many prompts as sequences in flight,
//! so finished sequences hand their slots to queued ones as in a long job.
//! Rows: `benches/results/generate-<dev>.json` (`system`, `model`, `format`,
//! `batch`, `prompt_len`, `gen_len`, `tokens_per_s` of generated tokens,
//! `device_budget_gib`, `kv_place`, `peak_device_gib`, the plan's
//! estimate), each beside its bounds measured in the same process: the PCIe
//! bound (the copy stream's busy time, every layer's weights once a step
//! when streamed) and the compute bound (the run's FLOPs,
//! `batch_plan::request_flops`, at the rate of a dense GEMM of the layer's
//! MLP shape on this GPU).
//!
//! `GEN_BENCH` (`8b`, `70b`, `14b` or a preset: `common::model_config`;
//! random init; default `8b` on a GPU, `tiny` on the CPU) or `GEN_BENCH_MODEL=DIR` (a Hugging Face
//! folder, as the transformers peer `scripts/generate_torch.py --batches`
//! reads); `GEN_BENCH_BATCHES` (sequences in flight, default `1,64,256,1024`
//! on a GPU); `GEN_BENCH_STEP_ROWS` (`BatchLimits::step_rows`; a budget
//! row's streamed plan may take fewer);
//! `GEN_BENCH_DEVICE_BUDGET_GIB` (three last rows with the GPU capped at that
//! much, counting what the process held before the model, as `generate
//! --device-budget` counts it: `batch_plan::plan_batch`'s plan with every
//! layer streamed, its best plan that streams at least one layer (the first
//! layers resident), and its choice among all, each with the prediction it
//! made from `DecodeRates` measured here; `GEN_BENCH_BUDGET_ROWS=1` or `2`
//! runs the first of them only). `GEN_BENCH_QUANTIZE=nf4|fp4|int8|fp8`
//! (with a preset): the decoder layers' linear weights are packed quantized
//! masters of random codes, streamed as packed bytes and dequantized on the
//! device (with a budget: the streamed plan only, counting the packed
//! layers); each row also gives the packed bytes' PCIe floor (`h2d_gb` at
//! the measured H2D rate) and how close it came to it. An empty
//! `GEN_BENCH_BATCHES` runs only the budget's rows. `GEN_BENCH_WINDOW`
//! (default 2): the streamed rows' layers on the device; `GEN_BENCH_RESIDENT`
//! (default 0): the unbudgeted rows keep that many of the first layers on
//! the device and stream the rest (`Llama::streamed_keeping`, dense bases
//! only). Streamed rows load
//! the next step's first layers behind this step's tail, as `generate` does
//! (`StreamConfig::prefetch_across_calls`); `GEN_BENCH_ACROSS_CALLS=0` turns
//! that off. `GEN_BENCH_TIMELINE=DIR` writes each streamed row's Chrome-trace
//! timeline (copies, compute, one host span a step) to
//! `DIR/generate-timeline-<format>-b<batch>-w<window>.json`.
//! `GEN_BENCH_HOST_KV_GIB` (default 0; a list runs the budget rows once for
//! each): host memory a budget row's plan may give to sequences whose kv
//! cache lives there (`BatchLimits::host_kv`); their copies count in the
//! row's PCIe floor and bound (`host_kv_gb`).
//!
//!     GPU_ONLY=bench-generate bash gpu-bundle/run.sh benches
#[path = "common/mod.rs"]
mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;
use streamer_core::{AcrossCalls, StreamConfig, StreamedSequential, WeightSource};
use streamer_models::{
    generate_batch, init_weights, init_weights_where, is_quantizable, plan_batch, request_flops,
    BatchLimits, BatchMemory, BatchOutput, BatchPlacement, BatchRequest, BatchRun, BatchShape,
    BatchSink, DecodeRates, LayerFootprint, Llama, LlamaConfig, PlacementChoice, PretrainedFiles,
    QuantizedWeights, SplitMix64, DEFAULT_STEP_ROWS,
};

/// The host weights in `dtype` and the model's name and configuration:
/// `GEN_BENCH_MODEL`'s folder (read into host memory) or a random preset.
fn host_weights(
    dtype: DType,
    dev: &Device,
    quantized: bool,
) -> Result<(HashMap<String, Tensor>, String, LlamaConfig)> {
    if let Ok(dir) = std::env::var("GEN_BENCH_MODEL") {
        anyhow::ensure!(
            !quantized,
            "GEN_BENCH_QUANTIZE takes a preset (GEN_BENCH), not GEN_BENCH_MODEL={dir}: \
             `generate --model DIR --quantize` quantizes a folder"
        );
        let files =
            PretrainedFiles::in_dir(&dir).with_context(|| format!("GEN_BENCH_MODEL={dir}"))?;
        let cfg = LlamaConfig::from_json_file(&files.config)?;
        let mut w = HashMap::new();
        for f in &files.weights {
            for (k, t) in candle_core::safetensors::load(f, &Device::Cpu)? {
                w.insert(k, t.to_dtype(dtype)?);
            }
        }
        return Ok((w, dir, cfg));
    }
    let name = std::env::var("GEN_BENCH")
        .unwrap_or_else(|_| if dev.is_cuda() { "8b" } else { "tiny" }.into());
    let cfg = common::model_config(&name)?;
    use rayon::prelude::*;
    // A quantized base's linear weights are made packed (`QuantizedWeights::
    // synthetic`): only the rest is dense.
    let dense = if quantized {
        init_weights_where(&cfg, 0, |n| !is_quantizable(n))?
    } else {
        init_weights(&cfg, 0)?
    };
    let w = dense
        .into_par_iter()
        .map(|(k, t)| Ok((k, t.to_dtype(dtype)?)))
        .collect::<candle_core::Result<_>>()?;
    Ok((w, name, cfg))
}

/// The host weights of the bench's model: dense tensors, and the packed
/// linear weights of a quantized base.
struct Base<'a> {
    w: &'a HashMap<String, Tensor>,
    quant: Option<&'a QuantizedWeights>,
    /// `bf16`, or the quantized base's format.
    format: &'a str,
    layer: LayerFootprint,
    /// Layers on the device when streamed (`GEN_BENCH_WINDOW`).
    window: usize,
    /// Load the next step's first layers behind this step (`GEN_BENCH_ACROSS_CALLS`).
    across_calls: bool,
    /// Where streamed rows write their timelines (`GEN_BENCH_TIMELINE`).
    timeline: Option<PathBuf>,
}

/// The model placed as `placement` says.
fn place(
    base: &Base,
    cfg: &LlamaConfig,
    (dev, dtype): (&Device, DType),
    placement: BatchPlacement,
) -> Result<Llama> {
    let t = Instant::now();
    let w = base.w;
    let model = match placement {
        BatchPlacement::Resident => {
            anyhow::ensure!(base.quant.is_none(), "a quantized base only streams");
            Llama::resident(VarBuilder::from_tensors(w.clone(), dtype, dev), cfg)?
        }
        BatchPlacement::Streamed { window, resident } => {
            // SAFETY: the bench never changes a master of the model it built.
            let across = unsafe { AcrossCalls::promise_masters_unchanged() };
            let stream = StreamConfig {
                device: dev.clone(),
                prefetch_ahead: window - 1,
                dtype,
                prefetch_across_calls: base.across_calls.then_some(across),
                timeline: base.timeline.is_some(),
                ..Default::default()
            };
            let src = WeightSource::Tensors(w.clone());
            match base.quant {
                Some(q) => Llama::streamed_quantized(&src, q, cfg, stream)?,
                None => Llama::streamed_keeping(&src, cfg, stream, resident)?,
            }
        }
    };
    let phases = match model.streamed_layers().map(|l| l.setup_times()) {
        Some(t) => format!(
            " (host masters {:.1} s, page-locked {:.1} s)",
            t.masters_s, t.pin_s
        ),
        None => String::new(),
    };
    println!(
        "{}: placed in {:.1} s{phases}",
        placement,
        t.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// Counts tokens and steps; with a timeline, records each step as a host span.
#[derive(Default)]
struct Count<'a> {
    tokens: usize,
    steps: usize,
    failed: Vec<String>,
    /// The streamed layers whose timeline gets the spans, and the last step's end.
    spans: Option<(&'a StreamedSequential, Instant)>,
}

impl BatchSink for Count<'_> {
    fn done(&mut self, out: BatchOutput) -> candle_core::Result<()> {
        match out.result {
            Ok(g) => self.tokens += g.tokens.len(),
            Err(e) => self.failed.push(e),
        }
        Ok(())
    }
    fn step(&mut self, _: usize, _: usize) {
        self.steps += 1;
        if let Some((layers, last)) = &mut self.spans {
            let now = Instant::now();
            // Only a poisoned pool lock fails, and the row then fails itself.
            let _ = layers.record_host_span("decode step", *last, now);
            *last = now;
        }
    }
}

/// Random prompts of `p` tokens, `g` new tokens each.
fn requests(n: usize, (p, g): (usize, usize), vocab: usize) -> Vec<BatchRequest> {
    let mut rng = SplitMix64::new(7);
    (0..n)
        .map(|id| {
            let prompt = (0..p).map(|_| rng.below(vocab) as u32).collect();
            BatchRequest::greedy(id, prompt, g)
        })
        .collect()
}

struct Setup<'a> {
    dev: &'a Device,
    model: &'a Llama,
    name: &'a str,
    dtype: DType,
    /// What the model was made of (its format and layer footprint).
    base: &'a Base<'a>,
    placement: BatchPlacement,
    pg: (usize, usize),
    step_rows: usize,
    rates: DecodeRates,
    budget_gib: Option<usize>,
    /// The plan's prediction, for rows a budget planned.
    expected: Option<f64>,
    /// Prompts a row runs per sequence in flight (`GEN_BENCH_JOB`).
    job: usize,
    /// Sequences whose kv cache lives in host memory (a plan's).
    host_kv: usize,
    /// Device bytes a cap holds back (`DeviceCap::held`; 0 without one).
    cap_held: usize,
}

/// One row: `batch` sequences in flight over `job x batch` prompts (one at batch 1).
fn row(s: &Setup, batch: usize) -> Result<serde_json::Value> {
    let cfg = s.model.config();
    let n = if batch == 1 { 1 } else { s.job * batch };
    let reqs = requests(n, s.pg, cfg.vocab_size);
    let limits = BatchLimits {
        sequences: batch,
        step_rows: s.step_rows,
        host_kv: s.host_kv,
    };
    let shape = BatchShape {
        sequences: batch,
        host_sequences: s.host_kv,
        capacity: s.pg.0 + s.pg.1,
        step_rows: s.step_rows,
    };
    let plan = BatchMemory::of(cfg, s.dtype, (s.placement, s.base.layer), shape);
    println!("batch {batch}, {n} prompts: plan {plan}");
    streamer_core::trim_device_memory(s.dev)?;
    let base = common::used_now(s.dev);
    let before = s.model.stats()?.unwrap_or_default();
    let kv_before = s.model.host_kv_bytes_copied();
    let sampler = common::MemSampler::start(s.dev);
    let traced = s
        .model
        .streamed_layers()
        .filter(|_| s.base.timeline.is_some());
    s.dev.synchronize()?;
    let t = Instant::now();
    let mut count = Count {
        spans: traced.map(|l| (l, t)),
        ..Default::default()
    };
    generate_batch(s.model, reqs, limits, &[], &mut count)?;
    s.dev.synchronize()?;
    let wall = t.elapsed().as_secs_f64();
    let peak = common::MemSampler::finish(sampler);
    // The peak counts the page-locked host kv caches, freed by now.
    let (rss, peak_rss) = common::host_rss();
    anyhow::ensure!(
        count.failed.is_empty(),
        "requests failed: {:?}",
        count.failed
    );
    let after = s.model.stats()?.unwrap_or_default();
    if let (Some(layers), Some(dir)) = (traced, &s.base.timeline) {
        let file = format!(
            "generate-timeline-{}-b{batch}-w{}.json",
            s.base.format,
            s.placement.window(cfg)
        );
        layers.write_timeline(Some(&dir.join(file)))?;
    }
    // The host kv caches' copies are not the pool's: their PCIe time at the
    // measured rate joins the weights' copy time.
    let kv_bytes = (s.model.host_kv_bytes_copied() - kv_before) as f64;
    let h2d_s = after.h2d_seconds - before.h2d_seconds + kv_bytes / s.rates.h2d_bytes_per_s;
    let compute_s = n as f64 * request_flops(cfg, s.pg.0, s.pg.1) / s.rates.flops_per_s;
    let bound_s = h2d_s.max(compute_s);
    let tps = count.tokens as f64 / wall;
    let h2d_bytes = (after.h2d_bytes - before.h2d_bytes) as f64 + kv_bytes;
    // The bytes moved at the measured H2D rate: the PCIe floor of the run.
    let h2d_floor_s = h2d_bytes / s.rates.h2d_bytes_per_s;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let r = serde_json::json!({
        "system": "ours", "model": s.name, "format": s.base.format,
        "placement": s.placement.to_string(),
        "batch": batch, "prompts": n, "prompts_per_slot": s.job, "prompt_len": s.pg.0, "gen_len": s.pg.1,
        "step_rows": s.step_rows, "steps": count.steps,
        "across_calls": s.base.across_calls && s.placement != BatchPlacement::Resident, "generated": count.tokens,
        "wall_s": wall, "tokens_per_s": tps, "expected_tokens_per_s": s.expected,
        "device_budget_gib": s.budget_gib,
        "kv_place": if s.host_kv > 0 { "device and host" } else { "device" },
        "host_kv_sequences": s.host_kv, "host_kv_gb": kv_bytes / 1e9,
        "planned_device_gib": gib(plan.total()), "peak_device_gib": gib(peak.saturating_sub(base)),
        // The device's use at the peak, less what a cap held back.
        "peak_process_device_gib": gib(peak.saturating_sub(s.cap_held)),
        "h2d_gb": h2d_bytes / 1e9, "h2d_s": h2d_s, "h2d_floor_s": h2d_floor_s,
        "of_h2d_floor": h2d_floor_s / wall,
        "compute_bound_s": compute_s, "gemm_tflops": s.rates.flops_per_s / 1e12,
        "h2d_gbps": s.rates.h2d_bytes_per_s / 1e9,
        "bound_tokens_per_s": count.tokens as f64 / bound_s, "of_bound": bound_s / wall,
        "host_rss_gib": gib(rss), "host_peak_rss_gib": gib(peak_rss),
    });
    println!("  {r}");
    Ok(r)
}

/// GEN_BENCH_HOST_KV_GIB: the host memory each round of budget rows lets
/// its plans give to kv caches (a list; default 0, none).
fn host_kv_gibs() -> Result<Vec<usize>> {
    std::env::var("GEN_BENCH_HOST_KV_GIB")
        .unwrap_or_else(|_| "0".into())
        .split(',')
        .map(|g| g.trim().parse().context("GEN_BENCH_HOST_KV_GIB"))
        .collect()
}

/// GEN_BENCH_JOB: prompts a row runs per sequence in flight.
fn job() -> usize {
    common::env_usize("GEN_BENCH_JOB", 2).max(1)
}

/// GEN_BENCH_BATCHES: the rows' sequences in flight (may be empty).
fn batches(dev: &Device) -> Result<Vec<usize>> {
    let default = if dev.is_cuda() {
        "1,64,256,1024"
    } else {
        "1,4"
    };
    std::env::var("GEN_BENCH_BATCHES")
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter(|b| !b.trim().is_empty())
        .map(|b| b.trim().parse().context("GEN_BENCH_BATCHES"))
        .collect()
}

fn main() -> Result<()> {
    let dev = common::device();
    let dtype = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let (p, g) = if dev.is_cuda() { (512, 32) } else { (24, 6) };
    let pg = (
        common::env_usize("GEN_BENCH_PROMPT", p),
        common::env_usize("GEN_BENCH_NEW", g),
    );
    let step_rows = common::env_usize("GEN_BENCH_STEP_ROWS", DEFAULT_STEP_ROWS);
    let budget_gib = std::env::var("GEN_BENCH_DEVICE_BUDGET_GIB")
        .ok()
        .map(|v| v.parse::<usize>().context("GEN_BENCH_DEVICE_BUDGET_GIB"))
        .transpose()?;
    // What the process holds before any model (the CUDA context): a budget
    // counts it, as `generate --device-budget` does.
    streamer_core::trim_device_memory(&dev)?;
    let held = common::used_now(&dev);
    let t = Instant::now();
    let scheme = common::quant_scheme("GEN_BENCH_QUANTIZE")?;
    let (w, name, cfg) = host_weights(dtype, &dev, scheme.is_some())?;
    let quant = scheme
        .map(|s| QuantizedWeights::synthetic(&cfg, s, 0, 0.05))
        .transpose()?;
    let format = match &quant {
        Some(q) => {
            let f = std::env::var("GEN_BENCH_QUANTIZE")?;
            let gib = q.packed_bytes() as f64 / (1u64 << 30) as f64;
            println!("{name}: linear weights {f}, {gib:.2} GiB packed");
            f
        }
        None => format!("{dtype:?}").to_lowercase(),
    };
    let layer = match scheme {
        Some(s) => LayerFootprint::quantized(&cfg, dtype, s, |_| false)?,
        None => LayerFootprint::dense(&cfg, dtype),
    };
    let window = common::env_usize("GEN_BENCH_WINDOW", 2);
    anyhow::ensure!(window >= 1, "GEN_BENCH_WINDOW must be at least 1 layer");
    let timeline = std::env::var_os("GEN_BENCH_TIMELINE").map(PathBuf::from);
    if let Some(dir) = &timeline {
        std::fs::create_dir_all(dir).with_context(|| format!("GEN_BENCH_TIMELINE={dir:?}"))?;
    }
    let base = Base {
        w: &w,
        quant: quant.as_ref(),
        format: &format,
        layer,
        window,
        across_calls: common::env_usize("GEN_BENCH_ACROSS_CALLS", 1) != 0,
        timeline,
    };
    println!("{name}: host weights in {:.1} s", t.elapsed().as_secs_f64());
    let rates = DecodeRates::measure(&cfg, dtype, &dev)?;
    println!(
        "rates: H2D {:.1} GB/s, weight reads {:.0} GB/s, dense {dtype:?} GEMM {:.0} TFLOP/s",
        rates.h2d_bytes_per_s / 1e9,
        rates.device_bytes_per_s / 1e9,
        rates.flops_per_s / 1e12
    );
    let resident = common::env_usize("GEN_BENCH_RESIDENT", 0);
    anyhow::ensure!(
        resident < cfg.num_hidden_layers && (resident == 0 || quant.is_none()),
        "GEN_BENCH_RESIDENT={resident}: a dense base keeps fewer than its {} layers, a quantized one none",
        cfg.num_hidden_layers
    );
    let streamed = BatchPlacement::Streamed { window, resident };
    let mut rows = Vec::new();
    let unbudgeted = batches(&dev)?;
    if !unbudgeted.is_empty() {
        let model = place(&base, &cfg, (&dev, dtype), streamed)?;
        warm_up(&model, pg.0)?;
        let setup = Setup {
            dev: &dev,
            model: &model,
            name: &name,
            dtype,
            base: &base,
            placement: streamed,
            pg,
            step_rows,
            rates,
            budget_gib: None,
            expected: None,
            job: job(),
            host_kv: 0,
            cap_held: 0,
        };
        for b in unbudgeted {
            rows.push(row(&setup, b)?);
        }
    }
    if let Some(b) = budget_gib {
        // A quantized base only streams, every layer: one plan.
        let all = [
            PlacementChoice::AllStreamed,
            PlacementChoice::Streaming,
            PlacementChoice::Any,
        ];
        let rows_wanted = match std::env::var("GEN_BENCH_BUDGET_ROWS") {
            Ok(v) => v.parse::<usize>().context("GEN_BENCH_BUDGET_ROWS")?,
            Err(_) => all.len(),
        };
        let choices = match quant {
            Some(_) => &all[..1],
            None => &all[..rows_wanted.clamp(1, all.len())],
        };
        for host_kv_gib in host_kv_gibs()? {
            for &choice in choices {
                let setup = (&dev, name.as_str(), dtype, pg, step_rows);
                let budgets = (b, host_kv_gib << 30, held, choice);
                rows.push(budget_row(&base, &cfg, setup, budgets, rates)?);
            }
        }
    }
    let out = serde_json::json!({
        "bench": "generate", "device": common::device_tag(&dev),
        "command": "GPU_ONLY=bench-generate bash gpu-bundle/run.sh benches",
        "held_before_model_gib": held as f64 / (1u64 << 30) as f64,
        "rows": rows,
    });
    // Quantized rows get their own file: `generate-nf4-<dev>.json`.
    let file = match &quant {
        Some(_) => format!("generate-{format}-{}", common::device_tag(&dev)),
        None => format!("generate-{}", common::device_tag(&dev)),
    };
    common::write_results(&file, &out, None)?;
    Ok(())
}

/// Kernels loaded, the outer weights' path exercised: two short requests
/// batched, then one prompt of the rows' length, whose prefill GEMMs (and
/// the kernels CUDA loads lazily at their first launch) the rows use; without
/// it a batch-1 row's first step took 204 ms against 74.5 for the next ones
/// (NF4, H100: `generate-timeline-nf4-b1-w2.json`).
fn warm_up(model: &Llama, prompt: usize) -> Result<()> {
    let vocab = model.config().vocab_size;
    generate_batch(
        model,
        requests(2, (8, 2), vocab),
        2,
        &[],
        &mut Count::default(),
    )?;
    generate_batch(
        model,
        requests(1, (prompt, 2), vocab),
        1,
        &[],
        &mut Count::default(),
    )?;
    Ok(())
}

/// A row planned by `plan_batch` for `gib` GiB (what the process held before
/// the model included) and `host_kv` bytes of host memory for kv caches,
/// with the GPU capped at the budget: the fastest plan of those `choice`
/// allows.
fn budget_row(
    base: &Base,
    cfg: &LlamaConfig,
    (dev, name, dtype, pg, step_rows): (&Device, &str, DType, (usize, usize), usize),
    (gib, host_kv, held, choice): (usize, usize, usize, PlacementChoice),
    rates: DecodeRates,
) -> Result<serde_json::Value> {
    let run = BatchRun {
        capacity: pg.0 + pg.1,
        step_rows,
        most: 1 << 14,
        prompt_len: pg.0 as f64,
        new_tokens: pg.1 as f64,
        host_kv_bytes: host_kv,
    };
    let left = (gib << 30).saturating_sub(held);
    let plan = plan_batch(
        cfg,
        (dtype, base.layer),
        (left, base.window, choice),
        run,
        &rates,
    )?;
    println!("--device-budget {gib}GiB ({held} bytes held before the model): {plan}");
    streamer_core::trim_device_memory(dev)?;
    let cap = common::cap_device_memory(dev, Some(gib << 30))?;
    let model = place(base, cfg, (dev, dtype), plan.placement)?;
    warm_up(&model, pg.0)?;
    let setup = Setup {
        dev,
        model: &model,
        name,
        dtype,
        base,
        placement: plan.placement,
        pg,
        step_rows: plan.step_rows,
        rates,
        budget_gib: Some(gib),
        expected: Some(plan.tokens_per_s),
        job: job(),
        host_kv: plan.host_sequences,
        cap_held: cap.held(),
    };
    row(&setup, plan.sequences)
}
