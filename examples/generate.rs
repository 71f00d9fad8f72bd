//! Sample text from a Llama-family checkpoint with temperature and top-p: a
//! Hugging Face model folder with its own tokenizer, or train_lm's byte-level
//! checkpoints.
//!
//!     cargo run --release --example generate -- --model path/to/hf-model-folder --prompt "Hello"
//!     cargo run --release --example generate -- --checkpoint runs/train_lm/checkpoint
//!     cargo run --release --example generate -- --weights model.safetensors --config config.json --streamed
//!     cargo run --release --features cuda --example generate -- --checkpoint runs/3b/checkpoint --gpu-weight-budget 4GiB
//!
//!     cargo run --release --example generate -- --preset 350m     # the untrained model (train_lm's seeded init)
//!
//! Many prompts, `--batch` sequences per step (each decoder layer's weights
//! visit the device once a step for all of them; `generate_batch`):
//!
//!     cargo run --release --example generate -- --model DIR --prompts prompts.jsonl --out out.jsonl --batch 16
//!
//! One JSON object a line: `prompt`, optional `max_tokens`, `temperature`,
//! `top_p`, `seed` (default: `--seed` plus the line number) and `stop`; one
//! result line per input line in `--out`, appended as each finishes. Run the
//! same command again to resume: lines already in `--out` are not redone. A
//! malformed line stops the run before the model loads, naming it, unless
//! `--skip-bad-lines` (then its result is the error); a prompt longer than the
//! context is an error for its line only. Generation ends at the tokenizer's
//! end-of-sequence token (see `streamer_models::prompt_file`).
//!
//! The model runs resident unless `--streamed` is given (the layers stream
//! from host memory through a window) or its decoder layers' weights exceed
//! `--gpu-weight-budget` (then all but two of the layers the budget holds stay
//! on the device and the rest stream through a window of two, so a token
//! copies only the layers that do not fit). With `--prompts`,
//! `--device-budget 24GiB` plans the whole run before any weight loads:
//! resident, split or streamed layers and the batch, whichever the device's
//! measured copy and GEMM rates predict to be faster, printed with its memory
//! by kind.
//!
//! Tokens: `--tokenizer FILE` with any source, else `--model`'s
//! `tokenizer.json` (a weights-only folder needs `--tokenizer`), a
//! `tokenizer.json` inside `--checkpoint`'s folder (train_lm copies the one it
//! fine-tuned with), or else bytes.
#[path = "common/device_flags.rs"]
mod device_flags;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_streamer::cli;
use clap::Parser;
use device_flags::DeviceFlags;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use streamer_core::{StreamConfig, WeightSource};
use streamer_models::checkpoint::layer_bytes;
use streamer_models::{
    generate, init_weights, parse_bytes, prefetch_for_budget, split_for_budget, BatchPlacement,
    ByteCorpus, CheckpointFiles, LayerFootprint, Llama, LlamaConfig, LoraAdapters, Placement,
    TextTokenizer, DEFAULT_STEP_ROWS,
};
use streamer_quant::QuantScheme;

#[derive(Parser, Debug)]
#[command(about = "Sample text from a Llama-family checkpoint or Hugging Face model folder")]
struct Args {
    /// A Hugging Face model folder: config.json, model.safetensors (or the
    /// sharded index) and tokenizer.json.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A tokenizer.json to use (checked against the config's vocab_size).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// LoRA adapters in PEFT's layout (adapter_config.json,
    /// adapter_model.safetensors) to apply, checked against the model's config
    /// before any weight is loaded.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// A folder written by train_lm (its checkpoint.json names the files).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Safetensors weights (or a model.safetensors.index.json); needs --config.
    #[arg(long, num_args = 1..)]
    weights: Vec<PathBuf>,
    /// No checkpoint: the freshly initialised model of a train_lm preset (tiny,
    /// 350m, 1b, 3b) with `--init-seed`, what train_lm starts from.
    #[arg(long)]
    preset: Option<String>,
    /// Seed of the initial weights with `--preset` (train_lm's `--seed`).
    #[arg(long, default_value_t = 0)]
    init_seed: u64,
    /// A Hugging Face Llama config.json (default: the checkpoint's).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Text to continue.
    #[arg(long, default_value = "Mr. Phileas Fogg")]
    prompt: String,
    /// Tokens to generate.
    #[arg(long, default_value_t = 300)]
    max_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stream the decoder layers from host memory even if they would fit.
    #[arg(long)]
    streamed: bool,
    /// Quantize the decoder layers' linear weights as they load (nf4, fp4,
    /// int8, fp8) and stream them: the pool copies the packed bytes, the
    /// device dequantizes them (implies --streamed).
    #[arg(long)]
    quantize: Option<String>,
    /// Device memory for decoder-layer weights (bytes, "2GiB", "1.5G"); a model
    /// whose layers exceed it keeps all but two of the layers that fit on the
    /// device and streams the rest through a window of two.
    #[arg(long)]
    gpu_weight_budget: Option<String>,
    /// Layers loaded ahead when streamed without a budget (default 1).
    #[arg(long)]
    prefetch: Option<usize>,
    #[command(flatten)]
    run_on: DeviceFlags,
    /// A JSONL file of prompts to run in batches (needs --out).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// The JSONL file of results for --prompts (appended to; resumed from).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Sequences decoded together with --prompts (default 8, or as many as
    /// --device-budget holds).
    #[arg(long)]
    batch: Option<usize>,
    /// With --prompts: device memory for the whole batched decode, as the
    /// driver counts this process's use (CUDA context, weights, kv cache, a
    /// step's activations; bytes, "24GiB"). Before loading, the plan picks
    /// every layer resident, the first layers resident and the rest streamed
    /// through a window of 2 (or --prefetch + 1), or every layer streamed
    /// (--streamed: at least one layer streamed), and the most sequences the
    /// budget holds (at most --batch), whichever the measured rates say is
    /// faster.
    #[arg(long)]
    device_budget: Option<String>,
    /// With --device-budget: host memory the plan may give to sequences whose
    /// kv cache it keeps there (page-locked, copied to the device beside the
    /// weights every step) where the measured rates say that is faster:
    /// bytes ("48GiB"), 0 for none, or auto (the default): half of the host
    /// memory available beside the model's weights.
    #[arg(long)]
    host_kv_budget: Option<String>,
    /// With --prompts: rows one step computes at most; prompts join a step
    /// while its rows stay within this. A --device-budget plan that streams
    /// may take fewer: as many as a step's layer copies hide.
    #[arg(long, default_value_t = DEFAULT_STEP_ROWS)]
    step_rows: usize,
    /// With --prompts: record a malformed line's error as its result and go
    /// on, instead of stopping.
    #[arg(long)]
    skip_bad_lines: bool,
}

/// The flags that do not depend on the model, checked before anything loads.
fn check_args(a: &Args) -> Result<()> {
    cli::count("--max-tokens", a.max_tokens, 1 << 24)?;
    cli::non_negative("--temperature", a.temperature)?;
    cli::fraction("--top-p", a.top_p)?;
    if a.prompt.is_empty() {
        bail!("--prompt is empty: give some text to continue");
    }
    if let Some(b) = &a.gpu_weight_budget {
        parse_bytes(b)?;
    }
    if let Some(b) = a.batch {
        cli::count("--batch", b, 1 << 16)?;
    }
    cli::count("--step-rows", a.step_rows, 1 << 24)?;
    if a.prompts.is_some() != a.out.is_some() {
        bail!("--prompts and --out go together: give both or neither");
    }
    if let Some(b) = &a.device_budget {
        parse_bytes(b)?;
        if a.prompts.is_none() {
            bail!("--device-budget plans a batched run: it goes with --prompts and --out");
        }
        if a.gpu_weight_budget.is_some() {
            bail!("--device-budget covers the weights too: leave out --gpu-weight-budget");
        }
    }
    if let Some(v) = a.host_kv_budget.as_deref().filter(|&v| v != "0") {
        if v != "auto" {
            parse_bytes(v).context("--host-kv-budget")?;
        }
        if a.device_budget.is_none() {
            bail!("--host-kv-budget is part of a --device-budget plan: give both or neither");
        }
    }
    Ok(())
}

/// How text becomes ids and back.
enum Tokens {
    /// Byte-level (train_lm's presets).
    Bytes,
    /// A `tokenizer.json`.
    Hf(Box<TextTokenizer>),
}

impl Tokens {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            Tokens::Bytes => ByteCorpus::encode(text),
            Tokens::Hf(t) => t.encode(text)?,
        })
    }

    /// Text of `ids` (bytes past 255, and invalid UTF-8, as U+FFFD).
    fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(match self {
            Tokens::Bytes => {
                let b: Vec<u8> = ids
                    .iter()
                    .map(|&t| u8::try_from(t).unwrap_or(b'?'))
                    .collect();
                String::from_utf8_lossy(&b).into_owned()
            }
            Tokens::Hf(t) => t.decode(ids)?,
        })
    }

    /// The end-of-sequence token, if the tokenizer has one.
    fn eos(&self) -> Option<u32> {
        match self {
            Tokens::Bytes => None,
            Tokens::Hf(t) => t.eos_id(),
        }
    }

    /// A file's tokenizer for `cfg`, checked against `vocab_size`.
    fn from_file(path: &Path, cfg: &LlamaConfig, config: &Path) -> Result<Self> {
        let t = TextTokenizer::from_file(path)?;
        t.check_vocab(cfg, config)?;
        Ok(Tokens::Hf(Box::new(t)))
    }
}

/// Writes each new piece of text as tokens arrive: raw bytes for byte-level
/// tokens (a multi-byte character is complete once all its bytes are out),
/// the growth of the decoded text for a tokenizer.
struct Printer<'a> {
    tokens: &'a Tokens,
    ids: Vec<u32>,
    printed: usize,
}

impl Printer<'_> {
    fn push(&mut self, out: &mut impl Write, t: u32) -> Result<()> {
        match self.tokens {
            Tokens::Bytes => {
                // Ids past 255 (a config with a larger vocabulary) print as '?'.
                out.write_all(&[u8::try_from(t).unwrap_or(b'?')])?;
            }
            Tokens::Hf(tok) => {
                self.ids.push(t);
                let text = tok.decode(&self.ids)?;
                if text.len() > self.printed && text.is_char_boundary(self.printed) {
                    out.write_all(&text.as_bytes()[self.printed..])?;
                    self.printed = text.len();
                }
            }
        }
        Ok(out.flush()?)
    }
}

/// Prints the prompt and the sampled text as it comes, then the speed.
fn run(a: &Args, model: &Llama, tokens: &Tokens) -> Result<()> {
    let prompt = tokens.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt {:?} encodes to no tokens", a.prompt);
    }
    let mut out = std::io::stdout().lock();
    out.write_all(a.prompt.as_bytes())?;
    let mut err = None;
    let mut printer = Printer {
        tokens,
        ids: Vec::new(),
        printed: 0,
    };
    let started = std::time::Instant::now();
    let new = generate(
        model,
        &prompt,
        a.max_tokens,
        a.temperature,
        a.top_p,
        a.seed,
        |t| {
            if let Err(e) = printer.push(&mut out, t) {
                err.get_or_insert(e);
            }
        },
    )?;
    let secs = started.elapsed().as_secs_f64();
    writeln!(out)?;
    if let Some(e) = err {
        return Err(e);
    }
    eprintln!(
        "{} tokens in {secs:.2} s ({:.1} tokens/s; the time includes the {}-token prompt)",
        new.len(),
        new.len() as f64 / secs,
        prompt.len()
    );
    if let Some(s) = model.stats()? {
        eprintln!("{s}");
    }
    Ok(())
}

/// `--gpu-weight-budget` in bytes and the `--quantize` scheme, parsed.
fn budget_and_scheme(a: &Args) -> Result<(Option<usize>, Option<QuantScheme>)> {
    let budget = a
        .gpu_weight_budget
        .as_deref()
        .map(parse_bytes)
        .transpose()?;
    let scheme = a.quantize.as_deref().map(QuantScheme::parse).transpose()?;
    Ok((budget, scheme))
}

/// The device bytes of a decoder layer of the model `a` loads: packed when
/// it is quantized (`--quantize`, or a folder whose `config.json` has a
/// `quantization_config`), else dense in `dtype`.
fn layer_footprint(a: &Args, cfg: &LlamaConfig, dtype: DType) -> Result<LayerFootprint> {
    let (_, scheme) = budget_and_scheme(a)?;
    Ok(LayerFootprint::of_base(
        cfg,
        dtype,
        a.model.as_deref(),
        scheme,
    )?)
}

/// Streaming for inference: each decode step's first layers load behind the
/// previous step's tail (norm, head, sampling), so the copies never pause.
fn inference_stream(dev: &Device, prefetch_ahead: usize, dtype: DType) -> StreamConfig {
    // SAFETY: this program never changes a master of the model it streams
    // (LoRA adapters are set before the first forward and are not masters).
    let across = unsafe { streamer_core::AcrossCalls::promise_masters_unchanged() };
    StreamConfig {
        device: dev.clone(),
        prefetch_ahead,
        dtype,
        prefetch_across_calls: Some(across),
        on_setup: Some(candle_streamer::report::setup_progress("generate")),
        ..Default::default()
    }
}

/// `--model DIR`: the folder's config, weights and tokenizer, placed as
/// `planned` says (a `--device-budget` plan), else by `--streamed` /
/// `--gpu-weight-budget`.
fn from_folder(
    a: &Args,
    dir: &Path,
    (dev, dtype): (&Device, DType),
    planned: Option<BatchPlacement>,
) -> Result<(Llama, Tokens)> {
    if a.checkpoint.is_some() || !a.weights.is_empty() || a.preset.is_some() || a.config.is_some() {
        bail!("--model takes its config and weights from the folder: drop --checkpoint, --weights, --preset and --config");
    }
    let (budget, scheme) = budget_and_scheme(a)?;
    let stream = |prefetch_ahead| {
        let stream = inference_stream(dev, prefetch_ahead, dtype);
        match scheme {
            Some(scheme) => Placement::Quantized { stream, scheme },
            None => Placement::Streamed(stream),
        }
    };
    let streamed = a.streamed || scheme.is_some();
    let planned = planned.filter(|p| !(scheme.is_some() && *p == BatchPlacement::Resident));
    let placement = match (planned, streamed, budget) {
        (Some(BatchPlacement::Resident), ..) | (None, false, None) => Placement::Resident {
            device: dev.clone(),
            dtype,
        },
        (Some(BatchPlacement::Streamed { window, resident }), ..) if resident > 0 => {
            Placement::Split {
                stream: inference_stream(dev, window - 1, dtype),
                resident_layers: resident,
            }
        }
        (Some(BatchPlacement::Streamed { window, .. }), ..) => stream(window - 1),
        (None, false, Some(budget)) => Placement::Budget {
            device: dev.clone(),
            dtype,
            budget,
        },
        (None, true, _) => {
            let files = streamer_models::PretrainedFiles::in_dir(dir)?;
            let cfg = LlamaConfig::from_json_file(&files.config)?;
            stream(match budget {
                Some(b) => prefetch_for_budget(&cfg, dtype, b)?,
                None => cli::prefetch("--prefetch", a.prefetch, cfg.num_hidden_layers)?,
            })
        }
    };
    let p = Llama::from_pretrained(dir, placement)?;
    let tokens = match &a.tokenizer {
        Some(t) => Tokens::from_file(t, p.model.config(), &p.files.config)?,
        None => match p.tokenizer {
            Some(t) => Tokens::Hf(Box::new(t)),
            None => bail!(
                "{} has no tokenizer.json: give --tokenizer FILE",
                dir.display()
            ),
        },
    };
    eprintln!(
        "{}: {} ({} layers), {}",
        dir.display(),
        p.model.config().model_type,
        p.model.config().num_hidden_layers,
        if p.model.is_streamed() {
            "streamed"
        } else {
            "resident"
        }
    );
    Ok((p.model, tokens))
}

fn main() -> Result<()> {
    let a = Args::parse();
    check_args(&a)?;
    // The prompts file is read (and a bad line refused) before the model loads.
    let jobs = match (&a.prompts, &a.out) {
        (Some(p), Some(o)) => Some(batch::Jobs::read(p, o, a.skip_bad_lines)?),
        _ => None,
    };
    if jobs.as_ref().is_some_and(|j| j.lines.is_empty()) {
        eprintln!("every prompt already has its result in --out: nothing to run");
        return Ok(());
    }
    let (dev, dtype) = a.run_on.resolve()?;
    let lora = match &a.lora {
        Some(d) => Some(LoraAdapters::load_peft(d, &model_config(&a)?, &dev)?),
        None => None,
    };
    match jobs {
        Some(jobs) => jobs.plan_and_run(&a, (&dev, dtype), lora),
        None => {
            let (model, tokens) = load(&a, (&dev, dtype), lora, None)?;
            run(&a, &model, &tokens)
        }
    }
}

/// The model and its tokens from the chosen source, with `lora` applied;
/// `planned`: where a `--device-budget` plan puts the layers.
fn load(
    a: &Args,
    (dev, dtype): (&Device, DType),
    lora: Option<LoraAdapters>,
    planned: Option<BatchPlacement>,
) -> Result<(Llama, Tokens)> {
    let (model, tokens) = match &a.model {
        Some(dir) => from_folder(a, dir, (dev, dtype), planned)?,
        None => from_files(a, (dev, dtype), planned)?,
    };
    if let Some(l) = lora {
        eprintln!(
            "LoRA: r {} on {:?}",
            l.config().r,
            l.config().target_modules
        );
        model.set_lora(Some(l))?;
    }
    Ok((model, tokens))
}

/// The model's configuration and tokens, read before any weight loads (the
/// tokenizer is checked against the configuration).
fn tokens_before_load(a: &Args) -> Result<(LlamaConfig, Tokens)> {
    let cfg = model_config(a)?;
    let tokens = match &a.model {
        Some(dir) => {
            let files = streamer_models::PretrainedFiles::in_dir(dir)?;
            match (&a.tokenizer, &files.tokenizer) {
                (Some(t), _) | (None, Some(t)) => Tokens::from_file(t, &cfg, &files.config)?,
                (None, None) => bail!(
                    "{} has no tokenizer.json: give --tokenizer FILE",
                    dir.display()
                ),
            }
        }
        None => tokens_for(a, &cfg, Path::new("the model's config"))?,
    };
    Ok((cfg, tokens))
}

/// `--prompts FILE --out FILE`: batched, resumable generation.
mod batch {
    use super::{Args, Tokens};
    use anyhow::{Context, Result};
    use candle_core::{DType, Device};
    use indicatif::{ProgressBar, ProgressStyle};
    use std::path::Path;
    use std::time::Instant;
    use streamer_models::prompt_file::{
        find_stop, output_line, parse_prompt_line, LineOutcome, OutputFile, PromptLine,
    };
    use streamer_models::{
        generate_batch, parse_bytes, plan_batch, BatchLimits, BatchOutput, BatchPlan, BatchRequest,
        BatchRun, BatchSink, ChatTemplate, DecodeRates, LayerFootprint, Llama, LlamaConfig,
        LoraAdapters, PlacementChoice,
    };

    /// The lines still to run, and the output they go to.
    pub(super) struct Jobs {
        pub(super) lines: Vec<PromptLine>,
        out: OutputFile,
        /// Input lines in all (blank ones excluded) and those already done.
        total: usize,
        done_before: usize,
    }

    impl Jobs {
        /// Reads `prompts`, opens `out` and drops the lines it already has.
        /// A malformed line is an error, or with `skip_bad` its result.
        pub(super) fn read(prompts: &Path, out: &Path, skip_bad: bool) -> Result<Self> {
            let text = std::fs::read_to_string(prompts)
                .with_context(|| format!("reading --prompts {}", prompts.display()))?;
            let (mut file, done) = OutputFile::open_resume(out)?;
            let (mut lines, mut total) = (Vec::new(), 0);
            for (i, l) in text.lines().enumerate() {
                if l.trim().is_empty() {
                    continue;
                }
                total += 1;
                let n = i + 1;
                let parsed = parse_prompt_line(n, l);
                if done.contains(&n) {
                    continue;
                }
                match parsed {
                    Ok(p) => lines.push(p),
                    Err(e) if skip_bad => {
                        eprintln!("{}: skipped: {e}", prompts.display());
                        let e = e.to_string();
                        file.append(&output_line(
                            n,
                            &Default::default(),
                            &LineOutcome::Error(&e),
                        ))?;
                    }
                    Err(e) => anyhow::bail!(
                        "{}: {e} (--skip-bad-lines records it and goes on)",
                        prompts.display()
                    ),
                }
            }
            let done_before = total - lines.len();
            Ok(Self {
                lines,
                out: file,
                total,
                done_before,
            })
        }

        /// Plans the run (`--device-budget`: where the layers live and the
        /// batch, before any weight loads), loads the model and runs every
        /// line, appending results as they finish.
        pub(super) fn plan_and_run(
            mut self,
            a: &Args,
            (dev, dtype): (&Device, DType),
            lora: Option<LoraAdapters>,
        ) -> Result<()> {
            // What this process holds on the device before the model: the
            // budget counts it (the CUDA context, as the driver counts it).
            let held = device_in_use(dev)?;
            let (cfg, tokens) = super::tokens_before_load(a)?;
            let chat = match &a.model {
                Some(dir) => ChatTemplate::from_folder(dir)?,
                None => None,
            };
            eprintln!(
                "{} of {} prompts to run ({} already in the output)",
                self.lines.len(),
                self.total,
                self.done_before,
            );
            let reqs = self.requests(a, &tokens, chat.as_ref())?;
            let (planned, limits) = match &a.device_budget {
                Some(b) => {
                    let p = plan(a, b, (&cfg, dtype, dev), &reqs, held)?;
                    (Some(p.placement), p.limits())
                }
                None => (None, fixed_limits(a)),
            };
            let (model, _) = super::load(a, (dev, dtype), lora, planned)?;
            self.run((&model, &tokens), reqs, limits)
        }

        /// The requests of the lines; a line whose prompt cannot be made
        /// gets its error as its result.
        fn requests(
            &mut self,
            a: &Args,
            tokens: &Tokens,
            chat: Option<&ChatTemplate>,
        ) -> Result<Vec<BatchRequest>> {
            let mut reqs = Vec::with_capacity(self.lines.len());
            for (id, p) in self.lines.iter().enumerate() {
                match prompt_tokens(p, tokens, chat) {
                    Ok(prompt) => reqs.push(BatchRequest {
                        id,
                        prompt,
                        max_tokens: p.max_tokens.unwrap_or(a.max_tokens),
                        temperature: p.temperature.unwrap_or(a.temperature),
                        top_p: p.top_p.unwrap_or(a.top_p),
                        seed: p.seed.unwrap_or(a.seed.wrapping_add(p.line as u64)),
                    }),
                    Err(e) => {
                        let e = e.to_string();
                        self.out.append(&output_line(
                            p.line,
                            &p.passthrough,
                            &LineOutcome::Error(&e),
                        ))?;
                        self.done_before += 1;
                    }
                }
            }
            Ok(reqs)
        }

        /// Runs `reqs` in batches of `limits`, appending results as they finish.
        fn run(
            mut self,
            (model, tokens): (&Llama, &Tokens),
            reqs: Vec<BatchRequest>,
            limits: BatchLimits,
        ) -> Result<()> {
            let bar = ProgressBar::new(self.total as u64);
            bar.set_position(self.done_before as u64);
            if let Ok(s) = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} lines [{elapsed_precise}<{eta_precise}] {msg}",
            ) {
                bar.set_style(s);
            }
            let eos: Vec<u32> = tokens.eos().into_iter().collect();
            let mut sink = Sink {
                lines: &self.lines,
                tokens,
                out: &mut self.out,
                bar: &bar,
                generated: 0,
                started: Instant::now(),
                every: self.total.div_ceil(20).max(1) as u64,
            };
            generate_batch(model, reqs, limits, &eos, &mut sink)?;
            let (n, secs) = (sink.generated, sink.started.elapsed().as_secs_f64());
            bar.finish();
            eprintln!(
                "{n} tokens in {secs:.1} s ({:.1} tokens/s, prompts included in the time)",
                n as f64 / secs
            );
            if let Some(s) = model.stats()? {
                eprintln!("{s}");
            }
            Ok(())
        }
    }

    /// A line's prompt tokens: its text, or its messages rendered by the
    /// model folder's chat template (with the assistant's turn opened).
    fn prompt_tokens(
        p: &PromptLine,
        tokens: &Tokens,
        chat: Option<&ChatTemplate>,
    ) -> Result<Vec<u32>> {
        let text = match (&p.messages, chat) {
            (None, _) => p.prompt.clone(),
            (Some(m), Some(t)) => t.render(m, true)?,
            (Some(_), None) => anyhow::bail!(
                "`messages` needs a chat template, and the model has none \
                 (tokenizer_config.json's chat_template or chat_template.jinja in --model DIR)"
            ),
        };
        tokens
            .encode(&text)
            .map_err(|e| anyhow::anyhow!("encoding the prompt: {e}"))
    }

    /// `--batch` (8) sequences, steps of `--step-rows`.
    fn fixed_limits(a: &Args) -> BatchLimits {
        let sequences = a.batch.unwrap_or(8);
        eprintln!("batch {sequences}, steps of at most {} rows", a.step_rows);
        BatchLimits {
            sequences,
            step_rows: a.step_rows,
            host_kv: 0,
        }
    }

    /// Bytes this process holds on `dev` now (0 on the CPU).
    fn device_in_use(dev: &Device) -> Result<usize> {
        streamer_core::trim_device_memory(dev)?;
        let total = streamer_core::device_total_memory(dev)?;
        let free = streamer_core::free_device_memory(dev)?;
        Ok(total.zip(free).map_or(0, |(t, f)| t.saturating_sub(f)))
    }

    /// `--device-budget`: resident or streamed (`--streamed`: streamed), and
    /// as many sequences as the budget holds at the longest request's length
    /// (at most `--batch`), whichever the measured rates say is faster.
    fn plan(
        a: &Args,
        budget: &str,
        (cfg, dtype, dev): (&LlamaConfig, DType, &Device),
        reqs: &[BatchRequest],
        held: usize,
    ) -> Result<BatchPlan> {
        let ctx = cfg.max_position_embeddings;
        let capacity = reqs
            .iter()
            .map(|r| r.prompt.len().saturating_add(r.max_tokens).min(ctx))
            .max()
            .unwrap_or(1);
        let n = reqs.len().max(1) as f64;
        let layer = super::layer_footprint(a, cfg, dtype)?;
        let run = BatchRun {
            capacity,
            step_rows: a.step_rows,
            most: a.batch.unwrap_or(1 << 16).min(reqs.len().max(1)),
            prompt_len: reqs.iter().map(|r| r.prompt.len() as f64).sum::<f64>() / n,
            new_tokens: reqs.iter().map(|r| r.max_tokens as f64).sum::<f64>() / n,
            host_kv_bytes: host_kv_budget(a, cfg, dtype, &layer)?,
        };
        let bytes = parse_bytes(budget)?;
        let Some(left) = bytes.checked_sub(held).filter(|&l| l > 0) else {
            anyhow::bail!(
                "--device-budget {budget}: this process already holds {:.2} GiB of the device",
                held as f64 / (1u64 << 30) as f64
            );
        };
        let rates = DecodeRates::measure(cfg, dtype, dev)?;
        let window =
            candle_streamer::cli::prefetch("--prefetch", a.prefetch, cfg.num_hidden_layers)? + 1;
        let choice = match a.streamed {
            true => PlacementChoice::Streaming,
            false => PlacementChoice::Any,
        };
        let p = plan_batch(cfg, (dtype, layer), (left, window, choice), run, &rates)
            .with_context(|| format!("--device-budget {budget}"))?;
        eprintln!(
            "--device-budget {budget} ({:.2} GiB held already): {p} (rates: H2D {:.1} GB/s, \
             weight reads {:.0} GB/s, GEMM {:.0} TFLOP/s)",
            held as f64 / (1u64 << 30) as f64,
            rates.h2d_bytes_per_s / 1e9,
            rates.device_bytes_per_s / 1e9,
            rates.flops_per_s / 1e12
        );
        Ok(p)
    }

    /// `--host-kv-budget` in bytes; auto (the default): half of the host
    /// memory available beside the model's weights (every layer's and the
    /// outer ones, as the host will hold them).
    fn host_kv_budget(
        a: &Args,
        cfg: &LlamaConfig,
        dtype: DType,
        layer: &LayerFootprint,
    ) -> Result<usize> {
        match a.host_kv_budget.as_deref().unwrap_or("auto") {
            "auto" => {}
            v => return Ok(parse_bytes(v)?),
        }
        let model = streamer_models::streamed_masters_bytes(cfg, layer.slot, dtype);
        let available = streamer_device::host_available_memory().unwrap_or(0);
        Ok(available.saturating_sub(model) / 2)
    }

    /// Writes each finished line and keeps the progress bar.
    struct Sink<'a> {
        lines: &'a [PromptLine],
        tokens: &'a Tokens,
        out: &'a mut OutputFile,
        bar: &'a ProgressBar,
        generated: usize,
        started: Instant,
        /// Lines between plain progress lines when stderr is not a terminal.
        every: u64,
    }

    impl Sink<'_> {
        fn tokens_per_s(&self) -> f64 {
            self.generated as f64 / self.started.elapsed().as_secs_f64().max(1e-9)
        }
    }

    impl BatchSink for Sink<'_> {
        fn done(&mut self, o: BatchOutput) -> candle_core::Result<()> {
            let p = &self.lines[o.id];
            let text;
            let outcome = match &o.result {
                Ok(g) => {
                    text = self
                        .tokens
                        .decode(&g.tokens)
                        .map_err(candle_core::Error::msg)?;
                    let cut = find_stop(&text, &p.stop).unwrap_or(text.len());
                    LineOutcome::Text {
                        text: &text[..cut],
                        prompt_tokens: o.prompt_tokens,
                        tokens: g.tokens.len(),
                        finish_reason: g.finish.name(),
                    }
                }
                Err(e) => LineOutcome::Error(e),
            };
            self.out
                .append(&output_line(p.line, &p.passthrough, &outcome))?;
            self.bar.inc(1);
            // A hidden bar (stderr is a log): a plain line now and then.
            let (pos, len) = (self.bar.position(), self.bar.length().unwrap_or(0));
            if self.bar.is_hidden() && (pos % self.every == 0 || pos == len) {
                eprintln!("{pos}/{len} lines  {:.1} tokens/s", self.tokens_per_s());
            }
            Ok(())
        }

        fn stop(&mut self, r: &BatchRequest, tokens: &[u32]) -> bool {
            let stop = &self.lines[r.id].stop;
            // A token that does not decode cannot complete a stop string yet.
            !stop.is_empty()
                && self
                    .tokens
                    .decode(tokens)
                    .is_ok_and(|t| find_stop(&t, stop).is_some())
        }

        fn step(&mut self, tokens: usize, _rows: usize) {
            self.generated += tokens;
            let rate = self.tokens_per_s();
            self.bar.set_message(format!("{rate:.1} tokens/s"));
        }
    }
}

/// The model's configuration as the chosen source gives it (read before any
/// weight, to check adapters against).
fn model_config(a: &Args) -> Result<LlamaConfig> {
    Ok(match (&a.model, &a.config, &a.checkpoint, &a.preset) {
        (Some(dir), ..) => {
            LlamaConfig::from_json_file(streamer_models::PretrainedFiles::in_dir(dir)?.config)?
        }
        (None, Some(c), ..) => LlamaConfig::from_json_file(c)?,
        (None, None, Some(dir), _) => {
            LlamaConfig::from_json_file(CheckpointFiles::read(dir)?.config)?
        }
        (None, None, None, Some(p)) => LlamaConfig::preset(p)?,
        _ => bail!("give one of --model, --checkpoint, --weights (with --config) or --preset"),
    })
}

/// Where the weights come from: files, or a preset's seeded initialisation.
enum From {
    Files(Vec<PathBuf>),
    Init(HashMap<String, Tensor>),
}

/// The tokens for a model that is not a folder: `--tokenizer`, the
/// checkpoint folder's `tokenizer.json`, or bytes.
fn tokens_for(a: &Args, cfg: &LlamaConfig, config: &Path) -> Result<Tokens> {
    let in_ckpt = a.checkpoint.as_ref().map(|d| d.join("tokenizer.json"));
    match (&a.tokenizer, in_ckpt) {
        (Some(t), _) => Tokens::from_file(t, cfg, config),
        (None, Some(t)) if t.is_file() => Tokens::from_file(&t, cfg, config),
        _ if cfg.vocab_size < 256 => bail!(
            "byte-level tokens need vocab_size >= 256, {} has {} (give --tokenizer FILE)",
            config.display(),
            cfg.vocab_size
        ),
        _ => Ok(Tokens::Bytes),
    }
}

/// `--checkpoint`, `--weights` with `--config`, or `--preset`.
fn from_files(
    a: &Args,
    (dev, dtype): (&Device, DType),
    planned: Option<BatchPlacement>,
) -> Result<(Llama, Tokens)> {
    let (from, config) = match (&a.checkpoint, a.weights.is_empty(), &a.preset) {
        (Some(dir), true, None) => {
            let f = CheckpointFiles::read(dir)?;
            let config = a.config.clone().unwrap_or(f.config);
            (From::Files(vec![f.weights]), config)
        }
        (None, false, None) => {
            let config = a.config.clone().context("--weights needs --config")?;
            (From::Files(a.weights.clone()), config)
        }
        (None, true, Some(p)) => {
            let cfg = LlamaConfig::preset(p)?;
            let t = tokens_for(a, &cfg, Path::new("--preset"))?;
            return Ok((
                place(
                    a,
                    From::Init(init_weights(&cfg, a.init_seed)?),
                    &cfg,
                    (dev, dtype),
                    planned,
                )?,
                t,
            ));
        }
        _ => bail!("give one of --model, --checkpoint, --weights (with --config) or --preset"),
    };
    let cfg = LlamaConfig::from_json_file(&config)?;
    let tokens = tokens_for(a, &cfg, &config)?;
    Ok((place(a, from, &cfg, (dev, dtype), planned)?, tokens))
}

/// Resident, or streamed by `--streamed` / `--gpu-weight-budget`.
fn place(
    a: &Args,
    from: From,
    cfg: &LlamaConfig,
    (dev, dtype): (&Device, DType),
    planned: Option<BatchPlacement>,
) -> Result<Llama> {
    let layers_bytes = layer_bytes(cfg, dtype) * cfg.num_hidden_layers;
    let (budget, scheme) = budget_and_scheme(a)?;
    let streamed = scheme.is_some()
        || match planned {
            Some(p) => p != BatchPlacement::Resident,
            None => a.streamed || budget.is_some_and(|b| layers_bytes > b),
        };
    Ok(if streamed {
        // A plan's window and the layers it keeps resident (a quantized
        // base's plan keeps none, and its layers only stream).
        let (prefetch, keep) = match (planned, budget) {
            (Some(BatchPlacement::Streamed { window, resident }), _) => (window - 1, resident),
            (Some(BatchPlacement::Resident), _) | (None, None) => (
                cli::prefetch("--prefetch", a.prefetch, cfg.num_hidden_layers)?,
                0,
            ),
            (None, Some(b)) if scheme.is_none() => split_for_budget(cfg, dtype, b)?,
            (None, Some(b)) => (prefetch_for_budget(cfg, dtype, b)?, 0),
        };
        eprintln!(
            "streamed: {} of {} layers of {:.1} MiB (the first {keep} resident), window {} on {:?}",
            cfg.num_hidden_layers - keep,
            cfg.num_hidden_layers,
            layer_bytes(cfg, dtype) as f64 / 1048576.0,
            prefetch + 1,
            dev.location()
        );
        let stream = inference_stream(dev, prefetch, dtype);
        match (from, scheme) {
            (From::Files(w), None) if keep == 0 => Llama::from_safetensors(&w, cfg, stream)?,
            (From::Files(w), None) => {
                Llama::streamed_keeping(&WeightSource::safetensors(&w)?, cfg, stream, keep)?
            }
            (From::Init(t), None) => {
                Llama::streamed_keeping(&WeightSource::Tensors(t), cfg, stream, keep)?
            }
            (From::Files(w), Some(s)) => {
                Llama::streamed_quantize_on_load(&WeightSource::safetensors(&w)?, s, cfg, stream)?
            }
            (From::Init(t), Some(s)) => {
                Llama::streamed_quantize_on_load(&WeightSource::Tensors(t), s, cfg, stream)?
            }
        }
    } else {
        eprintln!(
            "resident: {:.1} MiB of layer weights on {:?}",
            layers_bytes as f64 / 1048576.0,
            dev.location()
        );
        match from {
            From::Files(w) => Llama::load_resident(&w, cfg, dtype, dev)?,
            From::Init(t) => Llama::resident(VarBuilder::from_tensors(t, dtype, dev), cfg)?,
        }
    })
}
