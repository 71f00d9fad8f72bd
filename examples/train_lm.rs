//! Train a Llama-family decoder on the shipped corpus (`data/corpus.txt`, Jules
//! Verne, public domain) with a byte-level tokenizer, or fine-tune a Hugging
//! Face model folder on a text or JSONL corpus tokenized by its own
//! `tokenizer.json`; the decoder layers streamed from host memory and AdamW on
//! the host (full fine-tuning).
//!
//!     cargo run --release --example train_lm -- --preset tiny            # CPU, 2-3 minutes on 2 cores
//!     cargo run --release --example train_lm -- --model path/to/hf-folder --corpus data.jsonl --steps 100
//!     cargo run --release --example train_lm -- --preset tiny --resume   # continue from the last save
//!     cargo run --release --features cuda --example train_lm -- --preset 3b --gpu-weight-budget 2layers
//!
//! `--gpu-weight-budget` bounds the device memory for decoder-layer weights
//! (bytes, `2GiB`, or `<n>layers`): the streaming window is as many layers as
//! fit. Writes `<out>/loss.csv`, `<out>/loss.svg` and checkpoints in
//! `<out>/checkpoint/` (`checkpoint.json`, `config.json`, weights and AdamW
//! state, and the tokenizer.json used), which `examples/generate` reads. A JSONL
//! corpus has one object with a `"text"` string per line; documents are joined
//! by the tokenizer's end-of-text token. Checkpoints are atomic: kill the
//! run at any moment and `--resume` continues from the last complete save with
//! the same data and optimizer state an uninterrupted run would have had.
//!
//! On a small or busy CPU, `RAYON_NUM_THREADS=1` can be several times faster:
//! Candle's CPU thread pool spin-waits, which starves other threads when cores
//! are oversubscribed (measured: 0.27 s vs 1.5 s a step for `tiny` on 2 shared cores).
#[path = "common/device_flags.rs"]
mod device_flags;
#[path = "common/loss_curve.rs"]
mod loss_curve;
#[path = "common/save_flags.rs"]
mod save_flags;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::ParamsAdamW;
use candle_streamer::cli;
use candle_streamer::report::{setup_progress, Progress};
use clap::Parser;
use device_flags::DeviceFlags;
use loss_curve::{read_losses, write_curve, CurveLabels};
use save_flags::SaveFlags;
use std::path::{Path, PathBuf};
use std::time::Instant;
use streamer_autograd::ActivationPolicy;
use streamer_core::{DeviceCap, StreamConfig, WeightSource};
use streamer_models::checkpoint::layer_bytes;
use streamer_models::{
    generate, init_weights, init_weights_where, is_quantizable, parse_bytes, prefetch_for_budget,
    train_loop, ByteCorpus, CheckpointFiles, Decay, DevicePlan, HostPlan, LayerFootprint, Llama,
    LlamaConfig, LmTrainer, LoopOptions, LoraConfig, OptimizerPlace, Placement, PlanChoices,
    PlanLimits, PretrainedFiles, QuantizedWeights, StateDtype, StepRates, StepShape, TextTokenizer,
    TokenCorpus, TrainSetup,
};
use streamer_quant::QuantScheme;

#[derive(Parser, Debug)]
#[command(about = "Train a streamed Llama-style decoder on a byte-level text corpus")]
struct Args {
    /// Model size: tiny (CPU), 350m, 1b or 3b (GPU). Default: tiny, or with
    /// --resume the checkpoint's (a different one given with --resume is an error).
    #[arg(long)]
    preset: Option<String>,
    /// A Hugging Face Llama config.json to use instead of the preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A Hugging Face model folder to fine-tune (config.json, weights,
    /// tokenizer.json).
    #[arg(long)]
    model: Option<PathBuf>,
    /// A tokenizer.json for the corpus (default: the --model folder's, the
    /// checkpoint's with --resume, else bytes).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Training text, or JSONL with a "text" string per line (`.jsonl`).
    #[arg(long, default_value = "data/corpus.txt")]
    corpus: PathBuf,
    /// Text the samples before and after training continue.
    #[arg(long, default_value = "Mr. Phileas Fogg")]
    prompt: String,
    /// Total optimizer steps (a resumed run continues up to this count).
    /// Default: 200 for tiny, 300 otherwise.
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per micro-batch (per step without --tokens-per-step). Default: 16.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per optimizer step, as micro-batches of --batch x --seq tokens
    /// each (their gradients summed, one optimizer step). Full fine-tuning
    /// copies every layer's weights to the GPU once a step for all of them;
    /// LoRA runs them one after another (gradient accumulation: only one
    /// micro-batch's activations at a time). Default: one micro-batch.
    #[arg(long)]
    tokens_per_step: Option<usize>,
    /// Tokens per sequence. Default: 64 for tiny, 2048 otherwise.
    #[arg(long)]
    seq: Option<usize>,
    /// Peak learning rate. Default: 3e-3 for tiny, 3e-4 otherwise.
    #[arg(long)]
    lr: Option<f64>,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// The learning rate after the warm-up: `cosine` (down to 0 at --steps,
    /// as Hugging Face's Trainer), `cosine:R` (down to R x --lr) or `constant`.
    #[arg(long, default_value = "cosine")]
    schedule: String,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Layers loaded ahead of the one computing (window = prefetch + 1).
    #[arg(long)]
    prefetch: Option<usize>,
    /// Device memory for decoder-layer weights: bytes, "2GiB", "1.5G", or
    /// "<n>layers". Sets the window to as many layers as fit (overrides --prefetch).
    #[arg(long)]
    gpu_weight_budget: Option<String>,
    #[command(flatten)]
    run_on: DeviceFlags,
    /// Output folder.
    #[arg(long, default_value = "runs/train_lm")]
    out: PathBuf,
    #[command(flatten)]
    save: SaveFlags,
    /// Seed of the initial weights and the data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// LoRA fine-tuning of rank R instead of full fine-tuning: the base
    /// (streamed) is frozen, only the adapters train (AdamW on the device);
    /// adapters are saved in PEFT's layout in <out>/adapter.
    #[arg(long)]
    lora_r: Option<usize>,
    /// LoRA scale numerator (the update is scaled by alpha / r). Default: 2 r.
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// LoRA dropout on the adapters' inputs.
    #[arg(long, default_value_t = 0.0)]
    lora_dropout: f64,
    /// Projections LoRA adapts (Hugging Face module names, comma-separated).
    #[arg(long, default_value = "q_proj,v_proj")]
    lora_targets: String,
    /// With --lora-r: also write <out>/merged, a Hugging Face folder of the
    /// base with the adapters folded in (config.json, model.safetensors,
    /// tokenizer.json).
    #[arg(long)]
    merge: bool,
    /// With --lora-r: quantize the base's linear weights as they load
    /// (nf4, fp4: bitsandbytes' block size 64 without double quantization;
    /// int8 rows; fp8 e4m3 with row scales). The pool streams the packed
    /// bytes and the GPU dequantizes them (QLoRA).
    #[arg(long)]
    quantize: Option<String>,
    /// Step the optimizer after backward instead of overlapping it with backward.
    #[arg(long)]
    no_overlap: bool,
    /// Where AdamW runs for full fine-tuning: `host` (CpuAdamW, moments in
    /// host memory) or `device` (DeviceAdamW: moments on the GPU, 8 bytes per
    /// parameter, the layers stepped there during backward). Default: host.
    #[arg(long)]
    optimizer: Option<String>,
    /// What training keeps for the layers' backward: recompute, offload
    /// (block inputs in page-locked host memory), keep:BYTES,
    /// auto[:FRACTION] of free device memory, or spill:DEVICE:HOST (keep
    /// DEVICE bytes on the GPU, then up to HOST bytes of activations in
    /// page-locked host memory instead of recomputing them). Default: auto.
    #[arg(long)]
    activations: Option<String>,
    /// The most device memory the run may use in all ("24GiB"): full
    /// fine-tuning then picks the optimizer's place, the activations, the
    /// sequences a layer runs over at a time and the layer window whose step
    /// fits (printed before loading), and the rest of the GPU is held back so
    /// that nothing can use more. A LoRA run (`--lora-r`, QLoRA with
    /// `--quantize`) has no optimizer state worth placing: the rest of the GPU
    /// is held back and the LoRA plan splits the step's sequences into
    /// micro-batches run one after another and keeps what activations fit
    /// (printed with the tokens/s it expects; `--activations` overrides what
    /// it keeps).
    #[arg(long)]
    device_budget: Option<String>,
    /// AdamW's moments: `f32` (8 bytes per parameter) or `bf16` (4 bytes,
    /// stochastically rounded), in either optimizer. Default: f32, or on a
    /// GPU the device plan's choice (f32 where it fits device and host, else
    /// bf16).
    #[arg(long)]
    optimizer_state: Option<String>,
    /// Tokens to sample before and after training (0: none).
    #[arg(long, default_value_t = 200)]
    sample_tokens: usize,
}

/// The streaming window from `--gpu-weight-budget` or `--prefetch`.
fn prefetch(a: &Args, cfg: &LlamaConfig, dtype: DType) -> Result<usize> {
    match &a.gpu_weight_budget {
        Some(b) => {
            let bytes = match b.strip_suffix("layers") {
                Some(n) => {
                    let n = n.trim().parse::<usize>().with_context(|| {
                        format!("--gpu-weight-budget {b:?}: expected <n>layers or a byte count")
                    })?;
                    cli::count("--gpu-weight-budget <n>layers", n, cfg.num_hidden_layers)?
                        * layer_bytes(cfg, dtype)
                }
                None => parse_bytes(b)?,
            };
            Ok(prefetch_for_budget(cfg, dtype, bytes)?)
        }
        None => Ok(cli::prefetch(
            "--prefetch",
            a.prefetch,
            cfg.num_hidden_layers,
        )?),
    }
}

/// The model's configuration and how to call it: `--config`, `--preset`, or
/// with `--resume` the checkpoint's (an explicit other one is an error).
fn resolve_config(a: &Args, ckpt: &Path) -> Result<(LlamaConfig, String)> {
    let folder = a.model.as_ref().map(PretrainedFiles::in_dir).transpose()?;
    let requested = match (&a.config, &a.preset, &folder) {
        (Some(p), None, None) => Some((
            LlamaConfig::from_json_file(p)?,
            format!("--config {}", p.display()),
        )),
        (None, Some(n), None) => Some((LlamaConfig::preset(n)?, format!("--preset {n}"))),
        (None, None, Some(f)) => Some((
            LlamaConfig::from_json_file(&f.config)?,
            format!("--model {}", f.config.display()),
        )),
        (None, None, None) => None,
        _ => bail!("give one of --config, --preset and --model"),
    };
    let cfg = if a.save.resume {
        let saved = CheckpointFiles::read(ckpt)
            .with_context(|| format!("--resume: no checkpoint in {}", ckpt.display()))?;
        let cfg = LlamaConfig::from_json_file(&saved.config)?;
        if let Some((req, what)) = &requested {
            cli::same_config(what, req, &saved.config, &cfg)?;
        }
        cfg
    } else {
        requested.map_or_else(LlamaConfig::tiny, |(c, _)| c)
    };
    let label = match (&a.model, cfg.preset_name()) {
        (Some(m), _) => m.display().to_string(),
        (None, Some(p)) => p.to_string(),
        (None, None) => "custom config".to_string(),
    };
    Ok((cfg, label))
}

/// The corpus's tokens: `--tokenizer`, the `--model` folder's tokenizer.json
/// (required), the checkpoint's with `--resume`, or bytes.
fn resolve_tokenizer(a: &Args, cfg: &LlamaConfig, ckpt: &Path) -> Result<Option<TextTokenizer>> {
    let file = match (&a.tokenizer, &a.model) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(m)) => match PretrainedFiles::in_dir(m)?.tokenizer {
            Some(t) => Some(t),
            None => bail!(
                "{} has no tokenizer.json: give --tokenizer FILE",
                m.display()
            ),
        },
        (None, None) if a.save.resume && ckpt.join("tokenizer.json").is_file() => {
            Some(ckpt.join("tokenizer.json"))
        }
        (None, None) => None,
    };
    let Some(file) = file else {
        if cfg.vocab_size < 256 {
            bail!(
                "byte-level tokens need vocab_size >= 256, the config has {} (give --tokenizer FILE)",
                cfg.vocab_size
            );
        }
        return Ok(None);
    };
    let t = TextTokenizer::from_file(&file)?;
    let config = match (&a.model, &a.config) {
        (Some(m), _) => m.join("config.json"),
        (None, Some(c)) => c.clone(),
        (None, None) => ckpt.join("config.json"),
    };
    t.check_vocab(cfg, &config)?;
    Ok(Some(t))
}

/// The corpus, tokenized by `tok` (documents joined by its end-of-text id) or as bytes.
fn read_corpus(a: &Args, tok: Option<&TextTokenizer>) -> Result<TokenCorpus> {
    Ok(match tok {
        Some(t) => t.corpus_from_file(&a.corpus, t.eos_id())?,
        None => ByteCorpus::from_file(&a.corpus)?,
    })
}

/// Every flag checked against the model and the corpus before any work.
fn loop_options(
    a: &Args,
    cfg: &LlamaConfig,
    corpus: &TokenCorpus,
    ckpt: &Path,
) -> Result<LoopOptions> {
    let tiny = *cfg == LlamaConfig::tiny();
    let lr = cli::learning_rate("--lr", a.lr.unwrap_or(if tiny { 3e-3 } else { 3e-4 }))?;
    cli::weight_decay("--weight-decay", a.weight_decay, lr)?;
    let batch = cli::count("--batch", a.batch, 1 << 20)?;
    let seq = cli::seq_len(
        a.seq,
        if tiny { 64 } else { 2048 },
        cfg.max_position_embeddings,
    )?;
    let opts = LoopOptions {
        steps: cli::count(
            "--steps",
            a.steps.unwrap_or(if tiny { 200 } else { 300 }),
            1 << 40,
        )?,
        batch,
        micro_batches: micro_batches(a.tokens_per_step, batch, seq)?,
        seq,
        seed: a.seed,
        lr,
        warmup: a.warmup,
        decay: Decay::parse(&a.schedule).context("--schedule")?,
        save_every: Some(cli::count("--save-every", a.save.save_every, 1 << 40)?),
        checkpoint_dir: Some(ckpt.to_path_buf()),
    };
    if a.sample_tokens > 1 << 20 {
        bail!("--sample-tokens {}: at most {}", a.sample_tokens, 1 << 20);
    }
    opts.check(cfg, corpus)?;
    Ok(opts)
}

/// `--tokens-per-step` as micro-batches of `--batch` x `--seq` tokens
/// (1 without it); anything but a whole number of them is refused.
fn micro_batches(tokens: Option<usize>, batch: usize, seq: usize) -> Result<usize> {
    let Some(t) = tokens else { return Ok(1) };
    let per = batch * seq;
    if t == 0 || t % per != 0 {
        bail!(
            "--tokens-per-step {t} is not a whole number of micro-batches of \
             --batch {batch} x --seq {seq} = {per} tokens"
        );
    }
    Ok(t / per)
}

/// The loss plot's labels of a run titled `title`.
fn lm_labels(title: &str) -> CurveLabels<'_> {
    CurveLabels {
        title,
        ylabel: "cross-entropy (nats/token)",
        series: "train",
    }
}

fn sample(model: &Llama, tok: Option<&TextTokenizer>, a: &Args) -> Result<String> {
    let prompt = match tok {
        Some(t) => t.encode(&a.prompt)?,
        None => ByteCorpus::encode(&a.prompt),
    };
    if prompt.is_empty() {
        bail!("--prompt {:?} encodes to no tokens", a.prompt);
    }
    let out = generate(model, &prompt, a.sample_tokens, 0.8, 0.95, a.seed, |_| {})?;
    let text = match tok {
        Some(t) => t.decode(&out)?,
        None => ByteCorpus::decode(&out),
    };
    Ok(format!("{}{text}", a.prompt))
}

fn main() -> Result<()> {
    let a = Args::parse();
    let (dev, dtype) = a.run_on.resolve()?;
    let ckpt = a.out.join("checkpoint");
    let (cfg, label) = resolve_config(&a, &ckpt)?;
    let lora = lora_config(&a)?;
    let tok = resolve_tokenizer(&a, &cfg, &ckpt)?;
    let corpus = read_corpus(&a, tok.as_ref())?;
    let opts = loop_options(&a, &cfg, &corpus, &ckpt)?;
    let prefetch = prefetch(&a, &cfg, dtype)?;
    let (budget, opts) = device_budget(&a, &cfg, opts, (&dev, dtype))?;
    // Held until the run ends.
    let (_lora_cap, lora_budget) = lora_device_cap(&a, &dev)?;
    let place: OptimizerPlace = match &budget {
        Some((plan, _)) => plan.settings.place,
        None => a
            .optimizer
            .as_deref()
            .unwrap_or("host")
            .parse()
            .context("--optimizer")?,
    };
    let state = match &budget {
        Some((plan, _)) => plan.settings.state,
        None => optimizer_state(&a)?.unwrap_or_default(),
    };
    let policy = match &budget {
        Some((plan, _)) => plan.settings.activation_policy(),
        None => cli::activation_policy(a.activations.as_deref().unwrap_or("auto"), &dev)?,
    };
    let prefetch = match &budget {
        Some((plan, _)) => plan.settings.window - 1,
        None => prefetch,
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let adam = ParamsAdamW {
        lr: opts.lr,
        weight_decay: a.weight_decay,
        ..Default::default()
    };
    let stream = StreamConfig {
        device: dev.clone(),
        prefetch_ahead: prefetch,
        dtype,
        // A LoRA base is frozen: its masters need only the compute dtype (the
        // same rounding, once on the host instead of at every copy), which
        // halves their host memory and copies at bf16.
        master_dtype: Some(if lora.is_some() { dtype } else { DType::F32 }),
        slot_budget_bytes: Some(slot_bytes(&cfg, dtype)),
        on_setup: Some(setup_progress("train_lm")),
        ..Default::default()
    };
    if let Some(lcfg) = lora {
        if state != StateDtype::F32 {
            bail!("--optimizer-state is for full fine-tuning: LoRA adapters keep f32 moments");
        }
        if place == OptimizerPlace::Device {
            bail!(
                "--optimizer device is for full fine-tuning: with --lora-r the adapters and \
                 their AdamW already live on the device"
            );
        }
        let scheme = a.quantize.as_deref().map(QuantScheme::parse).transpose()?;
        let layer = LayerFootprint::of_base(&cfg, dtype, a.model.as_deref(), scheme)?;
        let budget = lora_budget.map(|b| (b, layer.slot));
        let (opts, policy) = lora::split(&a, &cfg, &lcfg, opts, policy, budget, (&dev, dtype))?;
        // Said, and refused when the host lacks it, before the base loads.
        let offload =
            (policy == ActivationPolicy::OffloadInputs).then_some((opts.batch, opts.seq, dtype));
        let plan = HostPlan::for_lora(&cfg, layer.slot, dtype, offload);
        println!("train_lm: this run holds about {plan}");
        if let Some(avail) = streamer_core::host_available_memory() {
            plan.check_fits(avail)?;
        }
        let model = lora_base(&a, &cfg, stream, scheme)?;
        let run = Run {
            label,
            prefetch,
            tok,
            policy,
        };
        return lora::train(&a, model, &lcfg, &corpus, &opts, &run);
    }
    // Said, and refused when the host lacks it, before anything is loaded.
    let plan = HostPlan::for_training(
        &cfg,
        &TrainSetup {
            master_dtype: DType::F32,
            place,
            state,
            cuda: dev.is_cuda(),
            offload_inputs: (policy == ActivationPolicy::OffloadInputs).then_some((
                opts.batch * opts.micro_batches,
                opts.seq,
                dtype,
            )),
        },
    );
    println!("train_lm: this run holds about {plan}");
    if let Some(avail) = streamer_core::host_available_memory() {
        plan.check_fits(avail)?;
    }
    let mut trainer = match (&a.model, a.save.resume) {
        (_, true) => LmTrainer::resume_with(&ckpt, stream, adam, place, state)?,
        (Some(dir), false) => {
            let p = Llama::from_pretrained(dir, Placement::Streamed(stream))?;
            LmTrainer::new_with(p.model, adam, place, state)?
        }
        (None, false) => {
            let model = Llama::from_tensors(init_weights(&cfg, a.seed)?, &cfg, stream)?;
            LmTrainer::new_with(model, adam, place, state)?
        }
    };
    if let Some(t) = &tok {
        // generate --checkpoint finds the tokenizer beside the weights.
        std::fs::create_dir_all(&ckpt).with_context(|| format!("creating {}", ckpt.display()))?;
        let dst = ckpt.join("tokenizer.json");
        if t.path() != dst {
            let text = std::fs::read_to_string(t.path())
                .with_context(|| format!("reading {}", t.path().display()))?;
            streamer_device::write_atomic(&dst, &text)?;
        }
    }
    trainer.set_overlap(!a.no_overlap);
    if let Some(layers) = trainer.model().trainable_layers() {
        layers.set_activation_policy(policy)?;
    }
    let start = trainer.steps_done();
    let losses = if a.save.resume {
        read_losses(&a.out.join("loss.csv"), start)?
    } else {
        Vec::new()
    };
    if start >= opts.steps {
        println!(
            "already at step {start} of {}: nothing to do (raise --steps)",
            opts.steps
        );
        return Ok(());
    }
    let run = Run {
        label,
        prefetch,
        tok,
        policy,
    };
    train(&a, &mut trainer, &corpus, &opts, &run, losses)
}

/// The device plan of a full fine-tune on a GPU: with `--device-budget`, the
/// fastest plan whose step fits it, the rest of the GPU held back; without
/// it and without the flags a plan decides, the fastest plan that fits the
/// memory free now (nothing held back). Either way the plan and the tokens/s
/// it expects (from one layer timed on the device) are printed, and the loop
/// options are split into its pieces (the same tokens a step). `None` on
/// the CPU, for LoRA, and when a flag sets what a plan decides.
fn device_budget(
    a: &Args,
    cfg: &LlamaConfig,
    mut opts: LoopOptions,
    (dev, dtype): (&Device, DType),
) -> Result<(Option<(DevicePlan, DeviceCap)>, LoopOptions)> {
    if a.lora_r.is_some() {
        // A LoRA run's budget is a cap alone (`lora_device_cap`).
        return Ok((None, opts));
    }
    let chosen = [
        ("--optimizer", a.optimizer.is_some()),
        ("--activations", a.activations.is_some()),
        ("--prefetch", a.prefetch.is_some()),
        ("--gpu-weight-budget", a.gpu_weight_budget.is_some()),
    ];
    let given = chosen
        .iter()
        .find(|(_, given)| *given)
        .map(|(flag, _)| flag);
    let total = streamer_core::device_total_memory(dev)?;
    let (budget, what) = match (&a.device_budget, given, total) {
        (Some(_), Some(flag), _) => bail!(
            "--device-budget chooses what {flag} sets (full fine-tuning): give one or the other"
        ),
        (Some(text), None, None) => {
            bail!("--device-budget {text}: it budgets a CUDA device, and this run is on the CPU")
        }
        (Some(text), None, Some(_)) => (
            parse_bytes(text).with_context(|| format!("--device-budget {text:?}"))?,
            format!("--device-budget {text}"),
        ),
        (None, None, Some(_)) => match streamer_core::free_device_memory(dev)? {
            Some(free) => (free, "the device's free memory".to_string()),
            None => return Ok((None, opts)),
        },
        (None, _, _) => return Ok((None, opts)),
    };
    let rows = opts.batch * opts.micro_batches;
    let shape = StepShape {
        rows,
        seq: opts.seq,
        dtype,
    };
    let given = optimizer_state(a)?.map(|s| [s]);
    let choices = PlanChoices {
        states: given.as_ref().map_or(PlanChoices::default().states, |s| s),
        ..PlanChoices::default()
    };
    let limits = PlanLimits {
        device_budget: budget,
        device_total: total.unwrap_or(0),
        host_available: streamer_core::host_available_memory(),
    };
    let plan =
        DevicePlan::choose_among(cfg, shape, limits, choices).with_context(|| what.clone())?;
    println!("train_lm: device plan for {what}: {plan}");
    println!(
        "train_lm: timing one layer and the head over a piece (the first run compiles the kernels)"
    );
    let rates = StepRates::measure(cfg, shape, plan.settings.piece_rows, dev)?;
    println!(
        "train_lm: expects {} (a layer's forward {:.1} ms, backward {:.1} ms, the head and \
         loss {:.1} ms a piece; copies at {:.1} GB/s up, {:.1} GB/s down)",
        plan.expect(cfg, shape, &rates),
        rates.layer_forward_s * 1e3,
        rates.layer_backward_s * 1e3,
        rates.head_s * 1e3,
        rates.h2d_bytes_per_s / 1e9,
        rates.d2h_bytes_per_s / 1e9
    );
    let cap = match &a.device_budget {
        Some(_) => DeviceCap::hold(dev, budget).with_context(|| what.clone())?,
        None => DeviceCap::none(),
    };
    opts.batch = plan.settings.piece_rows;
    opts.micro_batches = rows / plan.settings.piece_rows;
    Ok((Some((plan, cap)), opts))
}

/// `--device-budget` of a LoRA run: all of the GPU beyond the budget held
/// back for the whole run (the driver refuses anything more), within which
/// the LoRA plan (`lora::split`) runs the step. No cap
/// without `--lora-r` or `--device-budget`. Returns the cap and the
/// budget's bytes.
fn lora_device_cap(a: &Args, dev: &Device) -> Result<(DeviceCap, Option<usize>)> {
    let (Some(text), Some(_)) = (&a.device_budget, a.lora_r) else {
        return Ok((DeviceCap::none(), None));
    };
    let what = format!("--device-budget {text}");
    if dev.is_cpu() {
        bail!("{what}: it budgets a CUDA device, and this run is on the CPU");
    }
    let chosen = [
        ("--prefetch", a.prefetch.is_some()),
        ("--gpu-weight-budget", a.gpu_weight_budget.is_some()),
    ];
    if let Some((flag, _)) = chosen.iter().find(|(_, given)| *given) {
        bail!("{what} keeps two layers of the base on the device: it cannot go with {flag}");
    }
    let budget = parse_bytes(text).with_context(|| format!("--device-budget {text:?}"))?;
    let cap = DeviceCap::hold(dev, budget).with_context(|| what.clone())?;
    println!(
        "train_lm: LoRA in {what}: {:.1} GiB of the GPU held back; activations {}",
        cap.held() as f64 / (1u64 << 30) as f64,
        a.activations
            .as_deref()
            .unwrap_or("as the LoRA plan keeps them")
    );
    Ok((cap, Some(budget)))
}

/// `--optimizer-state` if given.
fn optimizer_state(a: &Args) -> Result<Option<StateDtype>> {
    a.optimizer_state
        .as_deref()
        .map(|s| s.parse().context("--optimizer-state"))
        .transpose()
}

/// The frozen base of a LoRA run: `--model` or a seeded init, quantized on
/// load as `scheme` (`--quantize`) says.
fn lora_base(
    a: &Args,
    cfg: &LlamaConfig,
    stream: StreamConfig,
    scheme: Option<QuantScheme>,
) -> Result<Llama> {
    Ok(match (&a.model, scheme) {
        (Some(dir), Some(scheme)) => {
            Llama::from_pretrained(dir, Placement::Quantized { stream, scheme })?.model
        }
        (Some(dir), None) => Llama::from_pretrained(dir, Placement::Streamed(stream))?.model,
        (None, Some(scheme)) => {
            // A layer of the seeded init at a time: never the whole dense model.
            let dense = init_weights_where(cfg, a.seed, |n| !is_quantizable(n))?;
            let quant = QuantizedWeights::quantize_init(cfg, scheme, a.seed)?;
            Llama::streamed_quantized(&WeightSource::Tensors(dense), &quant, cfg, stream)?
        }
        (None, None) => Llama::from_tensors(init_weights(cfg, a.seed)?, cfg, stream)?,
    })
}

/// `--lora-*` and `--quantize` checked before any work (`None` without
/// `--lora-r`).
fn lora_config(a: &Args) -> Result<Option<LoraConfig>> {
    if let Some(q) = &a.quantize {
        QuantScheme::parse(q)?;
        if a.lora_r.is_none() {
            bail!(
                "--quantize makes a frozen base: it trains LoRA adapters (--lora-r), \
                 full fine-tuning of quantized weights is not possible"
            );
        }
        if a.merge {
            bail!("--merge folds adapters into dense base weights: it cannot go with --quantize");
        }
    }
    let Some(r) = a.lora_r else {
        if a.merge {
            bail!("--merge folds LoRA adapters into the base: it needs --lora-r");
        }
        return Ok(None);
    };
    if a.save.resume {
        bail!("--resume continues full fine-tuning; LoRA runs (--lora-r) start from the base");
    }
    let targets: Vec<&str> = a.lora_targets.split(',').map(str::trim).collect();
    let alpha = a.lora_alpha.unwrap_or(2.0 * r as f64);
    Ok(Some(LoraConfig::new(r, alpha, a.lora_dropout, &targets)?))
}

/// An upper bound of one layer's device slot: the pool starts each tensor at
/// a multiple of 256 bytes, so odd sizes (a width of 32) need more than
/// `layer_bytes`.
fn slot_bytes(cfg: &LlamaConfig, dtype: DType) -> usize {
    let align = (256 / dtype.size_in_bytes()).max(1);
    let elems: usize = cfg
        .layer_weights(0)
        .iter()
        .map(|(_, s, _)| s.iter().product::<usize>().div_ceil(align) * align)
        .sum();
    elems * dtype.size_in_bytes()
}

/// What [`train`] reports and samples with.
struct Run {
    label: String,
    prefetch: usize,
    tok: Option<TextTokenizer>,
    /// `--activations`, for the streamed layers.
    policy: ActivationPolicy,
}

/// Trains from the trainer's step to `opts.steps`, with progress, curve and samples.
fn train(
    a: &Args,
    trainer: &mut LmTrainer,
    corpus: &TokenCorpus,
    opts: &LoopOptions,
    run: &Run,
    mut losses: Vec<(usize, f32)>,
) -> Result<()> {
    let (label, prefetch, tok) = (&run.label, run.prefetch, run.tok.as_ref());
    let cfg = trainer.model().config().clone();
    let dtype = trainer.model().dtype();
    let dev = trainer.model().device().clone();
    let (start, steps, seq, lr) = (trainer.steps_done(), opts.steps, opts.seq, opts.lr);
    let ckpt = a.out.join("checkpoint");
    let params = cfg.num_params();
    println!(
        "train_lm: {label} ({:.1} M params, {} layers of {:.1} MiB in {dtype:?}), window {} layers on {:?}, \
         {} micro-batch(es) of {} x {seq} tokens a step, lr {lr} ({} warm-up steps, then {:?}), \
         steps {start}..{steps}",
        params as f64 / 1e6,
        cfg.num_hidden_layers,
        layer_bytes(&cfg, dtype) as f64 / 1048576.0,
        prefetch + 1,
        dev.location(),
        opts.micro_batches,
        a.batch,
        opts.warmup,
        opts.decay,
    );
    if a.sample_tokens > 0 {
        println!("sample before: {:?}", sample(trainer.model(), tok, a)?);
    }
    // A bar on a terminal; plain lines every --log-every steps in a log.
    let progress = Progress::new(start, steps, a.save.log_every);
    let t0 = Instant::now();
    let title = format!("train_lm {label}: loss");
    let labels = lm_labels(&title);
    let mut curve = losses.clone();
    let mut train_s = 0.0;
    let new = train_loop(trainer, corpus, opts, |r| {
        curve.push((r.step, r.loss));
        train_s = r.train_s;
        progress.update(r.step, r.loss, r.tokens_per_s);
        if r.saved {
            // The curve follows the checkpoints (a resumed run continues it).
            if let Err(e) = write_curve(&a.out, &curve, &labels) {
                progress.println(&format!("warning: cannot write the loss curve: {e}"));
            }
        }
    })?;
    progress.finish();
    let secs = t0.elapsed().as_secs_f64();
    losses.extend(new.iter().copied());
    write_curve(&a.out, &losses, &labels)?;
    let first = new.first().map(|l| l.1).unwrap_or(f32::NAN);
    let last = new.last().map(|l| l.1).unwrap_or(f32::NAN);
    let tokens = new.len() * opts.micro_batches * a.batch * seq;
    println!(
        "loss {first:.4} -> {last:.4} over {} steps ({train_s:.1} s of training, {:.0} tokens/s; \
         {:.1} s writing checkpoints)",
        new.len(),
        tokens as f64 / train_s.max(1e-9),
        (secs - train_s).max(0.0)
    );
    if let Some(s) = trainer.model().stats()? {
        println!("layers: {s}");
    }
    if a.sample_tokens > 0 {
        println!("sample after: {:?}", sample(trainer.model(), tok, a)?);
    }
    println!(
        "wrote {0}/loss.csv, {0}/loss.svg, {1}/checkpoint.json (+ config, weights, optimizer state)",
        a.out.display(),
        ckpt.display()
    );
    Ok(())
}

/// LoRA fine-tuning: the adapters train on a frozen streamed base.
mod lora {
    use super::{sample, write_curve, Args, Run};
    use anyhow::{Context, Result};
    use candle_core::{DType, Device};
    use candle_nn::{Optimizer, ParamsAdamW};
    use candle_streamer::report::Progress;
    use std::time::Instant;
    use streamer_autograd::ActivationPolicy;
    use streamer_models::train::lr_at;
    use streamer_models::{
        Llama, LlamaConfig, LoopOptions, LoraAdapters, LoraConfig, LoraPlan, LoraStep, StepRates,
        StepShape, TokenCorpus,
    };

    /// Trains `model`'s adapters for `opts.steps` steps, saving them (PEFT's
    /// layout) in `<out>/adapter` every `--save-every` steps and at the end,
    /// and with `--merge` the merged model in `<out>/merged`.
    pub(super) fn train(
        a: &Args,
        model: Llama,
        lcfg: &LoraConfig,
        corpus: &TokenCorpus,
        opts: &LoopOptions,
        run: &Run,
    ) -> Result<()> {
        // The frozen embedding, norm and head stay on the device rather than
        // being copied up at every step (a no-op on the CPU).
        let model = model.into_trainable()?.outer_masters_to_device()?;
        let dev = model.device().clone();
        model.set_lora(Some(LoraAdapters::init(
            lcfg,
            model.config(),
            &dev,
            a.seed,
        )?))?;
        let (rows, micro) = (opts.batch * opts.micro_batches, opts.micro_batches);
        if let Some(layers) = model.trainable_layers() {
            layers.set_activation_policy(run.policy)?;
        }
        let adapters = model.lora()?.context("adapters")?;
        let vars = adapters.vars();
        let n: usize = vars.iter().map(|(_, v)| v.elem_count()).sum();
        println!(
            "train_lm: LoRA r {} alpha {} on {:?} of {} ({:.2} M adapter params, base frozen), \
             window {} layers, {} micro-batch(es) of {} x {} tokens a step, lr {}, {} steps",
            lcfg.r,
            lcfg.lora_alpha,
            lcfg.target_modules,
            run.label,
            n as f64 / 1e6,
            run.prefetch + 1,
            micro,
            rows / micro,
            opts.seq,
            opts.lr,
            opts.steps
        );
        let params = ParamsAdamW {
            lr: opts.lr,
            weight_decay: a.weight_decay,
            ..Default::default()
        };
        // One fused kernel a tensor (candle-nn's AdamW is a dozen element-wise
        // ops each: thousands of launches a step over seven adapted projections).
        let mut opt = streamer_autograd::DeviceAdamW::new(
            vars.iter().map(|(_, v)| v.clone()).collect(),
            params,
            &dev,
        )?;
        let dir = a.out.join("adapter");
        let base = a.model.as_ref().map(|m| m.display().to_string());
        let progress = Progress::new(0, opts.steps, a.save.log_every);
        let (t0, mut losses) = (Instant::now(), Vec::new());
        for s in 0..opts.steps {
            let (x, y) = corpus.batch(opts.seed, s as u64, rows, opts.seq, &dev)?;
            opt.set_learning_rate(lr_at(opts, s));
            let (l, grads) = model.lora_loss_and_grads(&x, &y, micro)?;
            anyhow::ensure!(
                l.is_finite(),
                "loss is {l} at step {s}: stopped (the last save is unchanged)"
            );
            opt.step(&grads)?;
            model.zero_grad()?;
            losses.push((s + 1, l));
            let tps = ((s + 1) * rows * opts.seq) as f64 / t0.elapsed().as_secs_f64();
            progress.update(s + 1, l, tps);
            if (s + 1) % opts.save_every.unwrap_or(usize::MAX) == 0 || s + 1 == opts.steps {
                adapters.save_peft(&dir, base.as_deref())?;
            }
        }
        progress.finish();
        let title = format!("train_lm LoRA {}: loss", run.label);
        write_curve(&a.out, &losses, &super::lm_labels(&title))?;
        let (first, last) = (losses[0].1, losses[losses.len() - 1].1);
        println!(
            "loss {first:.4} -> {last:.4} over {} steps ({:.1} s); adapters in {}",
            losses.len(),
            t0.elapsed().as_secs_f64(),
            dir.display()
        );
        if a.sample_tokens > 0 {
            model.set_training(false);
            println!("sample after: {:?}", sample(&model, run.tok.as_ref(), a)?);
        }
        if a.merge {
            merge(a, &model, run)?;
        }
        Ok(())
    }

    /// The micro-batches a step's sequences run as, one after another (in
    /// the returned options), and the layers' activation policy. On a GPU
    /// with `--device-budget` (`budget`: its bytes and a layer's streamed
    /// bytes) they are the LoRA plan's (`--activations`, if given, over the
    /// plan's policy), chosen before the base loads so that a budget no plan
    /// fits is refused first; else `--tokens-per-step`'s micro-batches and
    /// `policy` (`--activations`).
    pub(super) fn split(
        a: &Args,
        cfg: &LlamaConfig,
        lcfg: &LoraConfig,
        mut opts: LoopOptions,
        policy: ActivationPolicy,
        budget: Option<(usize, usize)>,
        (dev, dtype): (&Device, DType),
    ) -> Result<(LoopOptions, ActivationPolicy)> {
        let (Some(text), Some((budget, layer_bytes))) = (&a.device_budget, budget) else {
            return Ok((opts, policy));
        };
        let rows = opts.batch * opts.micro_batches;
        let step = LoraStep {
            cfg,
            lora: lcfg,
            shape: StepShape {
                rows,
                seq: opts.seq,
                dtype,
            },
            layer_bytes,
        };
        let rates = StepRates::measure(cfg, step.shape, 1, dev)?;
        let plan = LoraPlan::choose(&step, budget, &rates)
            .with_context(|| format!("--device-budget {text}"))?;
        println!(
            "train_lm: LoRA plan for --device-budget {text}: {plan}; expects {}",
            plan.expect(&step, &rates)
        );
        let policy = match a.activations {
            Some(_) => policy,
            None => plan.activation_policy(),
        };
        opts.batch = rows / plan.micro_batches;
        opts.micro_batches = plan.micro_batches;
        Ok((opts, policy))
    }

    /// `<out>/merged`: config.json, model.safetensors (the adapters folded
    /// in) and the tokenizer, a folder `--model` reads.
    fn merge(a: &Args, model: &Llama, run: &Run) -> Result<()> {
        let out = a.out.join("merged");
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        let weights = model.merged_weights()?;
        streamer_core::save_atomic(&weights, &out.join("model.safetensors"))?;
        streamer_device::write_atomic(&out.join("config.json"), &model.config().to_json()?)?;
        if let Some(t) = &run.tok {
            let text = std::fs::read_to_string(t.path())?;
            streamer_device::write_atomic(&out.join("tokenizer.json"), &text)?;
        }
        println!("merged model in {}", out.display());
        Ok(())
    }
}
