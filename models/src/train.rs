//! Language-model training: a token corpus (bytes, or a tokenizer's ids), a trainer over a streamed
//! [`Llama`] with the AdamW optimizer on the host, and checkpoints that an
//! interrupted save never breaks.
use crate::checkpoint::SplitMix64;
use crate::config::LlamaConfig;
use crate::llama::Llama;
use candle_core::backprop::GradStore;
use candle_core::{bail, Device, Result, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use std::path::{Path, PathBuf};
use std::time::Instant;
use streamer_autograd::{
    accumulate_grad, CpuAdamW, DeviceAdamW, OptimizerPlace, PlacedAdamW, StateDtype,
};
use streamer_core::StreamConfig;

/// A training text as token ids: bytes ([`TokenCorpus::new`],
/// [`TokenCorpus::from_file`]: the tokenizer is the identity on bytes,
/// vocabulary 256), or the ids of a tokenizer
/// ([`crate::TextTokenizer::corpus_from_file`]).
#[derive(Clone, Debug)]
pub struct TokenCorpus {
    tokens: Vec<u32>,
}

/// The byte-level corpus (the name it had before tokenizers).
pub type ByteCorpus = TokenCorpus;

impl TokenCorpus {
    /// A corpus over `bytes` (byte-level tokens).
    pub fn new(bytes: Vec<u8>) -> Self {
        Self::from_tokens(bytes.into_iter().map(u32::from).collect())
    }

    /// A corpus over token ids.
    pub fn from_tokens(tokens: Vec<u32>) -> Self {
        Self { tokens }
    }

    /// The token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The largest token id (`None` when empty).
    pub fn max_token(&self) -> Option<u32> {
        self.tokens.iter().copied().max()
    }

    /// Reads a file as bytes.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| {
            candle_core::Error::Msg(format!("cannot read corpus {}: {e}", path.display()))
        })?;
        Ok(Self::new(bytes))
    }

    /// Tokens in the corpus.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token ids of a text (its bytes).
    pub fn encode(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// Text of token ids (invalid UTF-8 replaced; ids above 255 skipped).
    pub fn decode(ids: &[u32]) -> String {
        let b: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        String::from_utf8_lossy(&b).into_owned()
    }

    /// The batch of step `step`: `batch` windows at offsets drawn from
    /// `(seed, step)` only, so a resumed run sees the data an uninterrupted one
    /// would. Returns `(inputs, targets)`, each `(batch, seq)` u32 on `device`,
    /// targets shifted by one token.
    pub fn batch(
        &self,
        seed: u64,
        step: u64,
        batch: usize,
        seq: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        if self.tokens.len() < seq + 2 {
            bail!(
                "the corpus has {} tokens, too few for sequences of {seq}",
                self.tokens.len()
            );
        }
        let mut rng = SplitMix64::new(seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let mut x = Vec::with_capacity(batch * seq);
        let mut y = Vec::with_capacity(batch * seq);
        for _ in 0..batch {
            let o = rng.below(self.tokens.len() - seq - 1);
            x.extend_from_slice(&self.tokens[o..o + seq]);
            y.extend_from_slice(&self.tokens[o + 1..o + seq + 1]);
        }
        Ok((
            Tensor::from_vec(x, (batch, seq), device)?,
            Tensor::from_vec(y, (batch, seq), device)?,
        ))
    }
}

/// Where a checkpoint folder's files are: `checkpoint.json` names the weights
/// and optimizer files of the last complete save.
#[derive(Clone, Debug)]
pub struct CheckpointFiles {
    /// Optimizer steps done.
    pub step: usize,
    /// The model's `config.json`.
    pub config: PathBuf,
    /// The weights (Hugging Face names).
    pub weights: PathBuf,
    /// The AdamW state.
    pub optimizer: PathBuf,
}

impl CheckpointFiles {
    /// Reads `<dir>/checkpoint.json`.
    pub fn read(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let p = dir.join("checkpoint.json");
        let bad = |reason: String| -> candle_core::Error {
            streamer_device::Error::Checkpoint {
                path: p.clone(),
                reason,
            }
            .into()
        };
        let text = std::fs::read_to_string(&p).map_err(|e| bad(format!("cannot read: {e}")))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let field = |k: &str| -> Result<&serde_json::Value> {
            v.get(k).ok_or_else(|| bad(format!("no field {k:?}")))
        };
        let file = |k: &str| -> Result<PathBuf> {
            let s = field(k)?
                .as_str()
                .ok_or_else(|| bad(format!("field {k:?} is not a string")))?;
            streamer_device::sibling_file(dir, s, &format!("field {k:?}"))
                .map_err(|e| bad(e.to_string()))
        };
        let step = field("step")?
            .as_u64()
            .ok_or_else(|| bad("field \"step\" is not an integer".into()))?
            as usize;
        Ok(Self {
            step,
            config: file("config")?,
            weights: file("weights")?,
            optimizer: file("optimizer")?,
        })
    }
}

/// Trains a [`Llama`] with AdamW ([`OptimizerPlace`]) over all of its
/// weights (layers, embedding, norm, head): forward, cross-entropy, backward,
/// one optimizer step. A streamed model trains its host masters through the
/// streamed layers; a resident one (from [`Llama::resident`],
/// [`Llama::load_resident`] or `Llama::from_pretrained` with
/// `Placement::Resident`) trains its weights as variables in its own dtype
/// ([`Llama::into_trainable`]), with the optimizer on the host for a CPU model
/// and [`OptimizerPlace::Device`] for a GPU one.
///
/// With `overlap` on, the layers' weights are stepped on a host thread while
/// backward continues with earlier layers (`TrainableSequential::backward_step`);
/// the embedding, norm and head are stepped after. Both give the same update.
/// With [`OptimizerPlace::Device`] the layers are always stepped on the device
/// during backward (`backward_step_device`), whatever `overlap` says, and on
/// CUDA the embedding, norm and head masters move to the device
/// ([`Llama::outer_masters_to_device`]); checkpoints are the same either way.
pub struct LmTrainer {
    model: Llama,
    opt: PlacedAdamW,
    step: usize,
    overlap: bool,
    outer: Vec<usize>,
    /// Why an overlapped step failed after it may have updated some layers:
    /// the state is then part-way through a step, so steps and saves are refused.
    broken: Option<String>,
}

impl LmTrainer {
    /// A trainer over `model` (made trainable if it is not) with fresh optimizer state.
    pub fn new(model: Llama, params: ParamsAdamW) -> Result<Self> {
        Self::new_on(model, params, OptimizerPlace::Host)
    }

    /// A trainer whose optimizer runs where `place` says.
    pub fn new_on(model: Llama, params: ParamsAdamW, place: OptimizerPlace) -> Result<Self> {
        Self::new_with(model, params, place, StateDtype::F32)
    }

    /// A trainer whose optimizer runs where `place` says with moments of
    /// `state` (bf16 halves the moments on the host or the device; see
    /// [`StateDtype`]).
    pub fn new_with(
        model: Llama,
        params: ParamsAdamW,
        place: OptimizerPlace,
        state: StateDtype,
    ) -> Result<Self> {
        if !model.is_streamed() && !model.device().is_cpu() && place == OptimizerPlace::Host {
            bail!(
                "LmTrainer: a resident model on {:?} has no host masters for the host optimizer; \
                 use OptimizerPlace::Device (--optimizer device), or load it streamed",
                model.device().location()
            );
        }
        let mut model = model.into_trainable()?;
        if place == OptimizerPlace::Device && model.device().is_cuda() {
            // Stepped where their moments are, with no host round trips.
            model = model.outer_masters_to_device()?;
        } else {
            // Stepped on the host: their copies each way by DMA.
            model.pin_outer_masters()?;
        }
        let named = model.parameters();
        let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
        let outer = names
            .iter()
            .enumerate()
            .filter(|(_, n)| !n.starts_with("model.layers."))
            .map(|(i, _)| i)
            .collect();
        let vars: Vec<_> = named.into_iter().map(|(_, v)| v).collect();
        let mut opt = PlacedAdamW::with_state_dtype(vars, params, place, model.device(), state)?;
        opt.set_param_names(names)?;
        Ok(Self {
            model,
            opt,
            step: 0,
            overlap: false,
            outer,
            broken: None,
        })
    }

    /// Resumes from a checkpoint folder written by [`LmTrainer::save`]: the
    /// config, weights and optimizer state of its last complete save, streamed
    /// as `stream` says. `params` replaces the saved hyper-parameters' learning
    /// rate. Every file is checked before the model is usable.
    pub fn resume(
        dir: impl AsRef<Path>,
        stream: StreamConfig,
        params: ParamsAdamW,
    ) -> Result<Self> {
        Self::resume_on(dir, stream, params, OptimizerPlace::Host)
    }

    /// [`LmTrainer::resume`] with the optimizer where `place` says (the
    /// state file is the same either way).
    pub fn resume_on(
        dir: impl AsRef<Path>,
        stream: StreamConfig,
        params: ParamsAdamW,
        place: OptimizerPlace,
    ) -> Result<Self> {
        Self::resume_with(dir, stream, params, place, StateDtype::F32)
    }

    /// [`LmTrainer::resume_on`] with moments of `state` (a state file of
    /// either dtype loads into either).
    pub fn resume_with(
        dir: impl AsRef<Path>,
        stream: StreamConfig,
        params: ParamsAdamW,
        place: OptimizerPlace,
        state: StateDtype,
    ) -> Result<Self> {
        let files = CheckpointFiles::read(dir)?;
        let cfg = LlamaConfig::from_json_file(&files.config)?;
        let model = Llama::from_safetensors(&[&files.weights], &cfg, stream)?;
        let lr = params.lr;
        let mut t = Self::new_with(model, params, place, state)?;
        t.opt.load(&files.optimizer)?;
        t.opt.set_learning_rate(lr);
        if t.opt.step_count() != files.step {
            return Err(streamer_device::Error::Checkpoint {
                path: files.optimizer.clone(),
                reason: format!(
                    "the optimizer state is at step {} but checkpoint.json says {}",
                    t.opt.step_count(),
                    files.step
                ),
            }
            .into());
        }
        t.step = files.step;
        Ok(t)
    }

    /// Overlaps the layers' optimizer step with backward.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The host optimizer ([`OptimizerPlace::Host`]).
    pub fn optimizer(&self) -> Option<&CpuAdamW> {
        match &self.opt {
            PlacedAdamW::Host(o) => Some(o),
            PlacedAdamW::Device(_) => None,
        }
    }

    /// The device optimizer ([`OptimizerPlace::Device`]).
    pub fn device_optimizer(&self) -> Option<&DeviceAdamW> {
        match &self.opt {
            PlacedAdamW::Device(o) => Some(o),
            PlacedAdamW::Host(_) => None,
        }
    }

    /// Sets the learning rate of the next steps.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.opt.set_learning_rate(lr);
    }

    /// Optimizer steps done.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// One step on `(inputs, targets)`, each `(batch, seq)` u32; returns the loss
    /// before the update.
    ///
    /// A step that cannot be taken cleanly is refused: a NaN or infinite loss
    /// before backward, a non-finite gradient or learning rate by the optimizer
    /// before it changes anything (weights, moments and the step count stay
    /// bit-identical). With the overlapped step, layers may already have been
    /// updated when a later gradient is refused; the trainer then refuses every
    /// further step and save (resume from the last checkpoint).
    pub fn step(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<f32> {
        self.check_usable()?;
        let loss = spanned(&self.model, "loss (forward, head)", || {
            self.model.loss(inputs, targets)
        })?;
        let value = self.finite_loss(&loss, "")?;
        let stepped = self.backward_and_step(&loss, (&[], &GradStore::default()));
        let zeroed = self.model.zero_grad();
        stepped?;
        zeroed?;
        self.step += 1;
        Ok(value)
    }

    /// Backward and one optimizer step; `earlier` holds gradients of earlier
    /// micro-batches for the listed variables, added before the step.
    fn backward_and_step(&mut self, loss: &Tensor, earlier: (&[Var], &GradStore)) -> Result<()> {
        let device = self.opt.place() == OptimizerPlace::Device;
        match (self.overlap || device, self.model.trainable_layers()) {
            (true, Some(layers)) => {
                let model = &self.model;
                let (opt, outer) = (&mut self.opt, &self.outer);
                let r = opt.backward_step(layers, loss).and_then(|mut grads| {
                    // SAFETY: `grads` lives in this closure only: the step
                    // below reads the buffers, and they are dropped before the
                    // next backward rewrites them.
                    spanned(model, "outer gradients to their masters", || unsafe {
                        model.outer_grads_down(&mut grads)
                    })?;
                    add_grads(&mut grads, earlier)?;
                    spanned(model, "outer step (embedding, norm, head)", || {
                        opt.step_params(&grads, outer)
                    })
                });
                if let Err(e) = &r {
                    self.broken = Some(e.to_string());
                }
                r
            }
            _ => {
                let mut grads = self.model.backward(loss)?;
                add_grads(&mut grads, earlier)?;
                self.opt.step(&grads)
            }
        }
    }

    /// One optimizer step over `micro` micro-batches: `inputs` and `targets`
    /// (`(micro x batch, seq)` u32) split into `micro` equal parts along the
    /// batch; returns the mean loss. The result is the step over the whole
    /// batch at once (each part's loss weighted 1 / `micro`), with the
    /// transient activation memory of one part.
    ///
    /// On a streamed model every layer's weights arrive once for the whole
    /// step: each part's forward runs through a layer before the next layer,
    /// and in backward each part's recompute and backward, with the layer's
    /// gradients summed on the device and sent to the host (or stepped there)
    /// once ([`streamer_autograd::TrainableSequential::set_micro_batch_rows`]). The bytes copied
    /// a step do not grow with `micro`; the saved layer inputs do. On a
    /// resident model the parts run one after another with their gradients
    /// summed. A non-finite loss refuses the step: weights and optimizer state
    /// are unchanged.
    pub fn step_micro(&mut self, inputs: &Tensor, targets: &Tensor, micro: usize) -> Result<f32> {
        let rows = inputs.dim(0)?;
        if micro == 0 || rows % micro != 0 {
            bail!("{rows} sequences do not split into {micro} equal micro-batches");
        }
        if micro == 1 {
            return self.step(inputs, targets);
        }
        if let Some(layers) = self.model.trainable_layers() {
            let before = layers.micro_batch_rows()?;
            layers.set_micro_batch_rows(Some(rows / micro))?;
            let r = self.step(inputs, targets);
            if let Some(layers) = self.model.trainable_layers() {
                layers.set_micro_batch_rows(before)?;
            }
            return r;
        }
        let r = self.micro_steps(inputs, targets, micro);
        let zeroed = self.model.zero_grad();
        let value = r?;
        zeroed?;
        self.step += 1;
        Ok(value)
    }

    fn micro_steps(&mut self, inputs: &Tensor, targets: &Tensor, micro: usize) -> Result<f32> {
        self.check_usable()?;
        let part = inputs.dim(0)? / micro;
        let summed: Vec<Var> = self
            .model
            .parameters()
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        let mut earlier = GradStore::default();
        let mut total = 0f32;
        for j in 0..micro {
            let (x, y) = (
                inputs.narrow(0, j * part, part)?,
                targets.narrow(0, j * part, part)?,
            );
            let loss = self.model.loss(&x, &y)?;
            total += self.finite_loss(&loss, &format!(" in micro-batch {j}"))?;
            let loss = (loss / micro as f64)?;
            if j + 1 == micro {
                self.backward_and_step(&loss, (&summed, &earlier))?;
            } else {
                let grads = self.model.backward(&loss)?;
                add_grads(&mut earlier, (&summed, &grads))?;
            }
        }
        Ok(total / micro as f32)
    }

    /// Refuses to step a trainer whose overlapped step failed part-way.
    fn check_usable(&self) -> Result<()> {
        if let Some(why) = &self.broken {
            bail!(
                "step {} refused: an earlier overlapped step failed part-way ({why}); \
                 resume from the last checkpoint",
                self.step
            );
        }
        Ok(())
    }

    /// The loss's value, or the refusal of the step (before its backward and
    /// any optimizer step) when it is NaN or infinite; `where_` says which
    /// micro-batch.
    fn finite_loss(&self, loss: &Tensor, where_: &str) -> Result<f32> {
        let value = loss.to_scalar::<f32>()?;
        if !value.is_finite() {
            bail!(
                "loss is {value}{where_} at step {}: the step is refused before its \
                 backward (weights and optimizer state unchanged)",
                self.step
            );
        }
        Ok(value)
    }

    /// Refuses to save a state that is part-way through a step or holds a NaN or
    /// an infinity (in any weight or moment), so a checkpoint is always sound.
    fn check_savable(&self, dir: &Path) -> Result<()> {
        let keep = "the previous checkpoint (if any) stays";
        if let Some(why) = &self.broken {
            bail!(
                "not saving into {}: an overlapped step failed part-way ({why}); {keep}",
                dir.display()
            );
        }
        self.opt.check_finite().map_err(|e| {
            candle_core::Error::Msg(format!(
                "not saving into {} at step {}: {e}; {keep}",
                dir.display(),
                self.step
            ))
        })
    }

    /// Saves a checkpoint into `dir`: `config.json`, `weights-<step>.safetensors`
    /// and `optimizer-<step>.safetensors` (each through a temporary file and a
    /// rename), then `checkpoint.json` naming them, then removes the previous
    /// save's files. An interruption at any point leaves `checkpoint.json`
    /// pointing at a complete save.
    ///
    /// Every file is flushed to the disk before the rename that publishes it, and
    /// the folder after it ([`streamer_device::replace_atomic`]), so a power loss
    /// cannot leave `checkpoint.json` naming files that are not on the disk.
    /// Files of saves that were interrupted before their `checkpoint.json`
    /// (`weights-*`, `optimizer-*` and their `.tmp`) are removed too.
    pub fn save(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        self.check_savable(dir)?;
        if !dir.is_dir() {
            std::fs::create_dir_all(dir).map_err(|e| {
                candle_core::Error::Msg(format!("cannot create {}: {e}", dir.display()))
            })?;
            // The new folder's own entry, so that it survives with its files.
            streamer_device::sync_dir(dir.parent().unwrap_or(Path::new(".")))?;
        }
        let previous = CheckpointFiles::read(dir).ok();
        streamer_device::write_atomic(&dir.join("config.json"), &self.model.config().to_json()?)?;
        let w = format!("weights-{:08}.safetensors", self.step);
        let o = format!("optimizer-{:08}.safetensors", self.step);
        self.model.save_safetensors(dir.join(&w))?;
        self.opt.save(dir.join(&o))?;
        let pointer = serde_json::json!({
            "step": self.step,
            "config": "config.json",
            "weights": w,
            "optimizer": o,
        });
        streamer_device::write_atomic(&dir.join("checkpoint.json"), &pointer.to_string())?;
        if let Some(p) = previous {
            for f in [p.weights, p.optimizer] {
                if f != dir.join(&w) && f != dir.join(&o) {
                    let _ = std::fs::remove_file(f);
                }
            }
        }
        remove_stale_saves(dir, &[&w, &o]);
        Ok(())
    }
}

/// Adds the gradients `src` holds for `vars` into `dst`.
fn add_grads(dst: &mut GradStore, (vars, src): (&[Var], &GradStore)) -> Result<()> {
    for v in vars {
        if let Some(g) = src.get(v.as_tensor()) {
            accumulate_grad(dst, v.as_tensor(), g.clone())?;
        }
    }
    Ok(())
}

/// Removes the files of earlier saves in a checkpoint folder that
/// `checkpoint.json` does not name (`weights-<step>.safetensors`,
/// `optimizer-<step>.safetensors` and their `.tmp`, left by a save that was
/// killed), and the `.tmpXXXXXX` files safetensors' own writer (a `tempfile`
/// beside its target) leaves when killed mid-write, keeping `keep`. Best
/// effort: a file that cannot be removed stays.
fn remove_stale_saves(dir: &Path, keep: &[&str]) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let base = name.strip_suffix(".tmp").unwrap_or(name);
        let ours = ["weights-", "optimizer-"].iter().any(|prefix| {
            base.strip_prefix(prefix)
                .and_then(|r| r.strip_suffix(".safetensors"))
                .is_some_and(|step| !step.is_empty() && step.bytes().all(|b| b.is_ascii_digit()))
        });
        let safetensors_temp = name.len() == 10
            && name.starts_with(".tmp")
            && name[4..].bytes().all(|b| b.is_ascii_alphanumeric());
        if (ours || safetensors_temp) && !keep.contains(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// What the training loop reports after each step.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Steps done (1-based).
    pub step: usize,
    /// Loss of this step (before its update).
    pub loss: f32,
    /// Tokens per second of training since the loop started (seconds spent
    /// writing checkpoints left out).
    pub tokens_per_s: f64,
    /// Seconds of training since the loop started, checkpoints left out.
    pub train_s: f64,
    /// Whether a checkpoint was saved after this step.
    pub saved: bool,
}

/// Options of [`train_loop`].
#[derive(Clone, Debug)]
pub struct LoopOptions {
    /// Train until this many steps are done (a resumed trainer continues).
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step ([`LmTrainer::step_micro`]; 1: none):
    /// a step trains on `micro_batches x batch x seq` tokens.
    pub micro_batches: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Data seed (batches depend only on it and the step).
    pub seed: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Linear warm-up steps to `lr` (then `decay`).
    pub warmup: usize,
    /// The learning rate after the warm-up.
    pub decay: Decay,
    /// Save into `checkpoint_dir` every this many steps (and at the end).
    pub save_every: Option<usize>,
    /// Checkpoint folder.
    pub checkpoint_dir: Option<PathBuf>,
}

impl LoopOptions {
    /// The learning-rate schedule these options give.
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.lr,
            warmup: self.warmup,
            decay: self.decay,
            steps: self.steps,
        }
    }

    /// Checks the options against the model's configuration and the corpus
    /// before any work: positive sizes, `seq` within the model's context
    /// (`max_position_embeddings`; never clamped), a finite positive learning
    /// rate, a corpus long enough for one sequence whose ids fit `vocab_size`,
    /// `save_every` positive.
    pub fn check(&self, cfg: &LlamaConfig, corpus: &TokenCorpus) -> Result<()> {
        if self.batch == 0 || self.seq == 0 || self.micro_batches == 0 {
            bail!(
                "batch ({}), seq ({}) and micro_batches ({}) must be positive",
                self.batch,
                self.seq,
                self.micro_batches
            );
        }
        if self.seq > cfg.max_position_embeddings {
            bail!(
                "seq = {} is beyond the model's context (max_position_embeddings = {})",
                self.seq,
                cfg.max_position_embeddings
            );
        }
        let logits = self
            .batch
            .checked_mul(self.seq)
            .and_then(|n| n.checked_mul(cfg.vocab_size));
        if logits.is_none_or(|n| n > 1 << 40) {
            bail!(
                "batch {} x seq {} x vocab_size {} logits per step is beyond 2^40 elements",
                self.batch,
                self.seq,
                cfg.vocab_size
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("learning rate must be finite and positive, got {}", self.lr);
        }
        if let Decay::Cosine { min_ratio } = self.decay {
            if !(0.0..=1.0).contains(&min_ratio) {
                bail!("the cosine schedule's floor ratio must be in [0, 1], got {min_ratio}");
            }
        }
        if self.save_every == Some(0) {
            bail!("save_every must be positive (None: save only at the end)");
        }
        if corpus.len() < self.seq + 2 {
            bail!(
                "the corpus has {} tokens, too few for sequences of {}",
                corpus.len(),
                self.seq
            );
        }
        if let Some(m) = corpus.max_token().filter(|&m| m as usize >= cfg.vocab_size) {
            bail!(
                "the corpus has token id {m}, beyond the model's vocab_size = {}",
                cfg.vocab_size
            );
        }
        Ok(())
    }
}

/// How the learning rate moves after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    /// Stays at the peak.
    Constant,
    /// Half a cosine from the peak down to `min_ratio` x the peak at step
    /// `LoopOptions::steps` (one past the last), as Hugging Face's cosine
    /// schedule does with `min_ratio = 0`.
    Cosine {
        /// The floor as a fraction of the peak, in `[0, 1]`.
        min_ratio: f64,
    },
}

impl Decay {
    /// `"constant"`, `"cosine"` (down to 0) or `"cosine:R"` (down to `R` x the peak).
    pub fn parse(text: &str) -> Result<Self> {
        let bad = || {
            candle_core::Error::Msg(format!(
                "learning-rate schedule {text:?}: expected constant, cosine or cosine:<floor ratio in [0, 1]>"
            ))
        };
        match text.split_once(':') {
            None if text == "constant" => Ok(Self::Constant),
            None if text == "cosine" => Ok(Self::Cosine { min_ratio: 0.0 }),
            Some(("cosine", r)) => {
                let min_ratio: f64 = r.parse().map_err(|_| bad())?;
                if !(0.0..=1.0).contains(&min_ratio) {
                    return Err(bad());
                }
                Ok(Self::Cosine { min_ratio })
            }
            _ => Err(bad()),
        }
    }
}

/// A learning-rate schedule: linear warm-up to `peak`, then `decay` until
/// step `steps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The rate at the end of the warm-up.
    pub peak: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// After the warm-up.
    pub decay: Decay,
    /// The run's steps (where a cosine would reach its floor).
    pub steps: usize,
}

impl LrSchedule {
    /// The rate of step `step` (0-based): `peak * (step + 1) / warmup` during
    /// the warm-up (so the first step already moves the weights), then
    /// `decay` over the remaining steps as Hugging Face's schedules do: the
    /// cosine would reach its floor one step after the last (`steps`), so no
    /// step is taken at a floor of 0.
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Cosine { min_ratio } => {
                let span = self.steps.saturating_sub(self.warmup).max(1);
                let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.peak * (min_ratio + (1.0 - min_ratio) * cos)
            }
        }
    }
}

/// The learning rate of step `step` (0-based) under `opts`
/// ([`LoopOptions::schedule`]).
pub fn lr_at(opts: &LoopOptions, step: usize) -> f64 {
    opts.schedule().at(step)
}

/// Trains from `trainer.steps_done()` to `opts.steps` on `corpus`, calling
/// `on_step` after each step; returns the losses `(step, loss)`. The options
/// are checked first ([`LoopOptions::check`]); a refused step ends the loop
/// with its error, the last checkpoint untouched.
pub fn train_loop(
    trainer: &mut LmTrainer,
    corpus: &TokenCorpus,
    opts: &LoopOptions,
    mut on_step: impl FnMut(&StepReport),
) -> Result<Vec<(usize, f32)>> {
    opts.check(trainer.model().config(), corpus)?;
    let dev = trainer.model().device().clone();
    let start = trainer.steps_done();
    let (mut losses, mut train_s) = (Vec::new(), 0.0);
    for s in start..opts.steps {
        let t0 = Instant::now();
        let rows = opts.batch * opts.micro_batches;
        let (x, y) = corpus.batch(opts.seed, s as u64, rows, opts.seq, &dev)?;
        trainer.set_learning_rate(lr_at(opts, s));
        let loss = trainer.step_micro(&x, &y, opts.micro_batches)?;
        losses.push((s + 1, loss));
        train_s += t0.elapsed().as_secs_f64();
        let done = s + 1;
        let saved = match (&opts.checkpoint_dir, opts.save_every) {
            (Some(dir), Some(every)) if every > 0 && (done % every == 0 || done == opts.steps) => {
                trainer.save(dir)?;
                true
            }
            (Some(dir), None) if done == opts.steps => {
                trainer.save(dir)?;
                true
            }
            _ => false,
        };
        let tokens = (done - start) * opts.batch * opts.micro_batches * opts.seq;
        on_step(&StepReport {
            step: done,
            loss,
            tokens_per_s: tokens as f64 / train_s.max(1e-9),
            train_s,
            saved,
        });
    }
    Ok(losses)
}

/// Runs `f`, recorded as the host span `name` on the streamed layers'
/// timeline when one is being recorded (`StreamConfig::timeline`): the
/// trainer's own phases beside the pool's copies and compute.
fn spanned<T>(model: &Llama, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(layers) = model.trainable_layers().filter(|l| l.inner().timeline_on()) else {
        return f();
    };
    let t0 = Instant::now();
    let r = f();
    layers.inner().record_host_span(name, t0, Instant::now())?;
    r
}
