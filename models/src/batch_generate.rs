//! Many sequences per weight visit: continuous batched decoding of a
//! [`Llama`], for throughput when the weights stream from host memory.
//!
//! [`generate_batch`] keeps up to `batch` sequences in flight. Every step is
//! one forward in which each decoder layer runs once over the new rows of
//! every sequence, so a streamed model copies each layer to the device once a
//! step for the whole batch: the bytes moved per generated token fall by the
//! number of sequences in flight.
//!
//! Design (no padding): the step packs the sequences' new rows one after
//! another into one `(1, rows, hidden)` call, each row with its own rotary
//! position; the projections, norms and MLP run over all rows at once, and
//! attention runs per sequence over that sequence's own slot of the kv cache.
//! A sequence admitted this step contributes its whole prompt (its prefill
//! shares the step's weight visit), the others one token each. Every row
//! computed is a real token, so ragged prompt lengths waste no compute (a
//! left-padded design would compute up to `batch x (longest - shortest
//! prompt)` padding rows a step). The cache reserves the same rows for every
//! slot (`crate::batch_kv` states the bound), and a step's attention is one
//! call per layer over all slots. When a sequence
//! finishes (end-of-sequence token, a stop the caller detects, its
//! `max_tokens`, or a full context) its slot is emptied and the next queued
//! request takes it in the following step.
//!
//! Each sequence is sampled with its own [`SplitMix64`] seeded by its request,
//! through [`crate::sample_rows`] (one call a step), as [`crate::generate`] samples it alone: the same
//! logits give the same tokens (greedy or not).
//!
//! ```
//! # use candle_core::{DType, Device};
//! # use candle_nn::VarBuilder;
//! use streamer_models::{generate, generate_batch, init_weights, BatchOutput, BatchRequest, Llama, LlamaConfig};
//! let cfg = LlamaConfig { max_position_embeddings: 32, ..LlamaConfig::bytes(32, 2, 4, 2) };
//! let vb = VarBuilder::from_tensors(init_weights(&cfg, 0)?, DType::F32, &Device::Cpu);
//! let model = Llama::resident(vb, &cfg)?;
//! let prompts = [vec![1u32, 2, 3], vec![4], vec![5, 6]];
//! let requests = prompts.iter().enumerate().map(|(id, p)| BatchRequest::greedy(id, p.clone(), 5));
//! let mut outs = Vec::new();
//! generate_batch(&model, requests, 2, &[], &mut |o: BatchOutput| { outs.push(o); Ok(()) })?;
//! outs.sort_by_key(|o| o.id);
//! for (p, o) in prompts.iter().zip(&outs) {
//!     assert_eq!(o.result.as_ref().unwrap().tokens, generate(&model, p, 5, 0.0, 1.0, 0, |_| ())?);
//! }
//! # Ok::<(), candle_core::Error>(())
//! ```
use crate::checkpoint::SplitMix64;
use crate::llama::Llama;
use crate::sample::{sample_rows, Sampling};
use candle_core::{bail, Result, Tensor};

/// Rows a step of [`generate_batch`] computes at most by default: a 16K-row
/// step keeps a step's activations to a few GiB at 8B shapes, and is enough
/// rows to keep the GPU's compute busy while the next layer's weights copy.
pub const DEFAULT_STEP_ROWS: usize = 16384;

/// How much a batched decode runs at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Sequences in flight (the kv cache's slots).
    pub sequences: usize,
    /// Rows one step computes at most: prompts join a step while its rows
    /// stay within this (the first one whatever its length). It bounds a
    /// step's activations, and when many sequences finish together it spreads
    /// the next prompts over several steps, so that their prefill overlaps the
    /// others' decoding instead of stalling it.
    pub step_rows: usize,
    /// Sequences of `sequences` whose kv cache lives in page-locked host
    /// memory and comes to the device layer by layer each step
    /// (`crate::host_kv`); the others keep theirs on the device.
    pub host_kv: usize,
}

impl From<usize> for BatchLimits {
    fn from(sequences: usize) -> Self {
        Self {
            sequences,
            step_rows: DEFAULT_STEP_ROWS,
            host_kv: 0,
        }
    }
}

/// One sequence to continue.
#[derive(Clone, Debug)]
pub struct BatchRequest {
    /// The caller's name for it (e.g. its input line), given back in
    /// [`BatchOutput::id`].
    pub id: usize,
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// New tokens at most.
    pub max_tokens: usize,
    /// Softmax temperature (`<= 0`: greedy), as [`crate::sample_token`].
    pub temperature: f64,
    /// Nucleus mass, as [`crate::sample_token`].
    pub top_p: f64,
    /// Seed of this sequence's sampler.
    pub seed: u64,
}

impl BatchRequest {
    /// A greedy request.
    pub fn greedy(id: usize, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It reached its `max_tokens`.
    Length,
    /// It produced an end-of-sequence token (not included in the tokens).
    Eos,
    /// [`BatchSink::stop`] said so.
    Stop,
    /// Prompt and output filled `max_position_embeddings` (where
    /// [`crate::generate`] would go on with a sliding window, recomputing
    /// every position each step; a batch does not).
    Context,
}

impl Finish {
    /// A short lowercase name (`length`, `eos`, `stop`, `context`).
    pub fn name(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Eos => "eos",
            Finish::Stop => "stop",
            Finish::Context => "context",
        }
    }
}

/// What a finished sequence produced.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub finish: Finish,
}

/// A finished request: its tokens, or why it could not run (an empty prompt,
/// a prompt longer than the context). Such an error concerns this request
/// only; the batch goes on.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchOutput {
    /// [`BatchRequest::id`].
    pub id: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The result, or the reason for refusing the request.
    pub result: std::result::Result<Generated, String>,
}

/// Where [`generate_batch`] reports.
pub trait BatchSink {
    /// A request finished (in completion order, not request order). An
    /// error ends the batch.
    fn done(&mut self, out: BatchOutput) -> Result<()>;

    /// Whether `request` should stop after its new `tokens` so far (e.g. a
    /// stop string in their text). Called after every new token.
    fn stop(&mut self, _request: &BatchRequest, _tokens: &[u32]) -> bool {
        false
    }

    /// A step ended having produced `tokens` new tokens and computed
    /// `rows` rows (prompts included), for progress.
    fn step(&mut self, _tokens: usize, _rows: usize) {}
}

impl<F: FnMut(BatchOutput) -> Result<()>> BatchSink for F {
    fn done(&mut self, out: BatchOutput) -> Result<()> {
        self(out)
    }
}

/// A sequence in a slot of the batch.
struct Active {
    req: BatchRequest,
    rng: SplitMix64,
    out: Vec<u32>,
    /// Tokens to feed in the next step (the prompt, then the newest token).
    feed: Vec<u32>,
}

/// Continues every request of `requests`, `limits.sequences` at a time (a
/// plain number is that many sequences and [`DEFAULT_STEP_ROWS`]; see the
/// module's documentation): each step runs every decoder layer once for
/// all sequences in flight. A token in `eos` ends its sequence. Finished
/// requests go to `sink` as they finish; a request that cannot run (empty
/// prompt, longer than `max_position_embeddings`, a token outside the
/// vocabulary) goes there as an error and the rest go on. Requests are
/// taken from the iterator only when a slot is free. The model's kv cache
/// is used and emptied; a model error ends the batch (the requests in
/// flight are not reported).
pub fn generate_batch(
    model: &Llama,
    requests: impl IntoIterator<Item = BatchRequest>,
    limits: impl Into<BatchLimits>,
    eos: &[u32],
    sink: &mut impl BatchSink,
) -> Result<()> {
    let limits = limits.into();
    if limits.sequences == 0 || limits.step_rows == 0 {
        bail!("generate_batch: limits of 0 ({limits:?})");
    }
    if limits.host_kv > limits.sequences {
        bail!(
            "generate_batch: {} sequences with their kv cache in host memory, more than the {} \
             in flight",
            limits.host_kv,
            limits.sequences
        );
    }
    let was_training = model.is_training();
    model.set_training(false);
    let r = model
        .begin_batch(limits.sequences, limits.host_kv)
        .and_then(|()| decode_loop(model, &mut requests.into_iter(), limits, eos, sink));
    let ended = model.end_batch();
    model.set_training(was_training);
    r?;
    ended
}

fn decode_loop(
    model: &Llama,
    queue: &mut impl Iterator<Item = BatchRequest>,
    limits: BatchLimits,
    eos: &[u32],
    sink: &mut impl BatchSink,
) -> Result<()> {
    let mut slots: Vec<Option<Active>> = (0..limits.sequences).map(|_| None).collect();
    // A request taken from the queue that did not fit the last step's rows.
    let mut held = None;
    // Host work between the layers, marked on a streamed model's timeline.
    let mut t = std::time::Instant::now();
    loop {
        admit(
            model,
            (queue, &mut held),
            &mut slots,
            limits.step_rows,
            sink,
        )?;
        model.host_span("decode admit", &mut t)?;
        if slots.iter().all(Option::is_none) {
            return Ok(());
        }
        let (mut tokens, mut positions, mut step) = (Vec::new(), Vec::new(), Vec::new());
        let (mut need, mut hint) = (0, 0);
        for (i, a) in slots.iter().enumerate() {
            let Some(a) = a else { continue };
            let past = model.batch_slot_positions(i)?;
            positions.extend((0..a.feed.len()).map(|p| (past + p) as u32));
            tokens.extend_from_slice(&a.feed);
            step.push((i, a.feed.len()));
            need = need.max(past + a.feed.len());
            let ctx = model.config().max_position_embeddings;
            hint = hint.max(a.req.prompt.len().saturating_add(a.req.max_tokens).min(ctx));
        }
        model.reserve_batch(need, hint)?;
        model.host_span("decode step rows", &mut t)?;
        let rows = tokens.len();
        let logits = model
            .forward_packed(&tokens, &positions, step.clone())
            .map_err(|e| e.context(format!("batched decoding: a step of {rows} rows")))?;
        // `forward_packed` marks its own parts.
        t = std::time::Instant::now();
        let picked = sample_step(&logits, &mut slots, &step)?;
        model.host_span("decode sample (waits for the logits)", &mut t)?;
        for (&t, &(i, _)) in picked.iter().zip(&step) {
            let a = slots[i].as_mut().expect("in the step, so active");
            let finish = if eos.contains(&t) {
                Some(Finish::Eos)
            } else {
                a.out.push(t);
                a.feed = vec![t];
                finished(model, a, sink)
            };
            if let Some(finish) = finish {
                let a = slots[i].take().expect("active");
                model.clear_batch_slot(i)?;
                sink.done(BatchOutput {
                    id: a.req.id,
                    prompt_tokens: a.req.prompt.len(),
                    result: Ok(Generated {
                        tokens: a.out,
                        finish,
                    }),
                })?;
            }
        }
        model.host_span("decode finish", &mut t)?;
        sink.step(step.len(), rows);
    }
}

/// The next token of every sequence in `step`, one row of `logits` each.
fn sample_step(
    logits: &Tensor,
    slots: &mut [Option<Active>],
    step: &[(usize, usize)],
) -> Result<Vec<u32>> {
    let mut rows = Vec::with_capacity(step.len());
    let mut active: Vec<&mut Active> = slots.iter_mut().flatten().collect();
    // `step` lists the active slots in slot order, as `active` holds them.
    if active.len() != step.len() {
        bail!(
            "batched decoding: {} sequences active, {} in the step",
            active.len(),
            step.len()
        );
    }
    for a in active.iter_mut() {
        rows.push(Sampling {
            temperature: a.req.temperature,
            top_p: a.req.top_p,
            rng: &mut a.rng,
        });
    }
    sample_rows(logits, &mut rows)
}

/// Fills empty slots from `held` and the queue while the step's rows stay
/// within `step_rows` (the first prompt of a step is admitted whatever its
/// length, so that none waits forever).
fn admit(
    model: &Llama,
    (queue, held): (&mut impl Iterator<Item = BatchRequest>, &mut Option<Active>),
    slots: &mut [Option<Active>],
    step_rows: usize,
    sink: &mut impl BatchSink,
) -> Result<()> {
    let mut rows: usize = slots.iter().flatten().map(|a| a.feed.len()).sum();
    for (admitted, slot) in slots.iter_mut().filter(|s| s.is_none()).enumerate() {
        if held.is_none() {
            *held = next_admitted(model, queue, sink)?;
        }
        let Some(a) = held.take() else { break };
        if admitted > 0 && rows + a.feed.len() > step_rows {
            *held = Some(a);
            break;
        }
        rows += a.feed.len();
        *slot = Some(a);
    }
    Ok(())
}

/// Whether `a`, having just produced a token, is done.
fn finished(model: &Llama, a: &Active, sink: &mut impl BatchSink) -> Option<Finish> {
    if sink.stop(&a.req, &a.out) {
        Some(Finish::Stop)
    } else if a.out.len() >= a.req.max_tokens {
        Some(Finish::Length)
    } else if a.req.prompt.len() + a.out.len() > model.config().max_position_embeddings {
        // The newest token would sit at position `max_position_embeddings`.
        Some(Finish::Context)
    } else {
        None
    }
}

/// The next request of `queue` that can run; those that cannot (and those
/// that ask for no token) are reported to `sink` on the way.
fn next_admitted(
    model: &Llama,
    queue: &mut impl Iterator<Item = BatchRequest>,
    sink: &mut impl BatchSink,
) -> Result<Option<Active>> {
    let (ctx, vocab) = (
        model.config().max_position_embeddings,
        model.config().vocab_size,
    );
    for req in queue.by_ref() {
        let outside = req.prompt.iter().position(|&t| t as usize >= vocab);
        let refused = if req.prompt.is_empty() {
            Some("the prompt is empty".to_string())
        } else if req.prompt.len() > ctx {
            Some(format!(
                "the prompt has {} tokens, more than the model's context of {ctx} \
                 (max_position_embeddings)",
                req.prompt.len()
            ))
        } else if let Some(p) = outside {
            Some(format!(
                "the prompt's token {} (position {p}) is outside the vocabulary of {vocab}",
                req.prompt[p]
            ))
        } else {
            None
        };
        if refused.is_some() || req.max_tokens == 0 {
            sink.done(BatchOutput {
                id: req.id,
                prompt_tokens: req.prompt.len(),
                result: match refused {
                    Some(e) => Err(e),
                    None => Ok(Generated {
                        tokens: Vec::new(),
                        finish: Finish::Length,
                    }),
                },
            })?;
            continue;
        }
        return Ok(Some(Active {
            rng: SplitMix64::new(req.seed),
            out: Vec::new(),
            feed: req.prompt.clone(),
            req,
        }));
    }
    Ok(None)
}
