//! `TrainableSequential`: training through the residency pool.
//!
//! Forward keeps only each block's input (on the device) and its dropout seed.
//! Backward visits blocks in reverse through the same bounded window (block
//! `i - 1` loads while block `i` recomputes), recomputes each block under Candle
//! autograd with its weights as variables, sends the weight gradients to host
//! buffers on their own stream, and returns one Candle `GradStore` holding the
//! gradients of everything before, inside and after the streamed part.
//!
//! Blocks with a hand-written backward (`Block::manual`, e.g. the models
//! crate's `FusedMlp`) skip Candle autograd: they recompute their activations
//! with `forward_train` (or keep them from the first forward, as the
//! [`ActivationPolicy`] allows) and produce each gradient once.
use crate::activations::{ActivationPlace, ActivationPolicy};
use crate::dropout::with_seed;
use crate::grads::{accumulate_grad, HostGrads};
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use streamer_core::{
    release_all, run_blocks_with, Block, BlockCtx, BlockSpec, ManualBackward, ResidencyPool,
    SavedActivations, StreamedSequential,
};

/// An optimizer that can step some parameters as soon as their gradients have
/// landed (the overlapped step of [`TrainableSequential::backward_step`]).
pub trait OverlapStep: Send {
    /// Starts a step (bias corrections, step counters).
    fn begin_step(&mut self);
    /// Steps the given variables with their gradients; each at most once per step.
    fn step_vars(&mut self, updates: &[(Var, Tensor)]) -> Result<()>;
}

fn index_updates<'a>(
    vars: &[Var],
    updates: &'a [(Var, Tensor)],
) -> Result<Vec<(usize, &'a Tensor)>> {
    updates
        .iter()
        .map(|(v, g)| {
            vars.iter()
                .position(|o| o.as_tensor().id() == v.as_tensor().id())
                .map(|i| (i, g))
                .ok_or_else(|| {
                    candle_core::Error::Msg(
                        "overlapped step: a streamed parameter is not in the optimizer".into(),
                    )
                })
        })
        .collect()
}

impl<R: crate::UpdateRule> OverlapStep for crate::HostOptimizer<R> {
    fn begin_step(&mut self) {
        crate::HostOptimizer::begin_step(self)
    }

    fn step_vars(&mut self, updates: &[(Var, Tensor)]) -> Result<()> {
        let idx = index_updates(self.vars(), updates)?;
        self.step_tensors(&idx)
    }
}

/// What a backward does with the streamed weights' gradients.
enum Stepper<'a, 'o> {
    /// Sends them to host buffers (returned in the `GradStore`).
    Offload,
    /// Sends them to host buffers and hands each completed weight to the
    /// overlapped host optimizer's thread.
    Host(&'a std::sync::mpsc::Sender<StepJob>),
    /// Steps each completed weight on the device (no gradient transfer).
    Device(&'a mut crate::device_step::DeviceStep<'o>),
}

/// Work for the overlapped optimizer thread: wait for the marker, then step.
struct StepJob {
    marker: streamer_core::OffloadMarker,
    updates: Vec<(Var, Tensor)>,
}

/// What a training forward leaves for its backward.
struct Saved {
    /// Each block's input, detached (the first is the model input); a host
    /// copy where `on_host` says so ([`ActivationPolicy::OffloadInputs`]).
    inputs: Vec<Tensor>,
    on_host: Vec<bool>,
    /// The model input and extras as the caller passed them (maybe tracked).
    x: Tensor,
    extras: Vec<Tensor>,
    /// The extras as the forward handed them to the blocks (detached, and
    /// variables copied: see `snapshot_extras`). Kept activations hold these,
    /// so a hand-written backward's extras gradients are keyed by their ids.
    extras_det: Vec<Tensor>,
    /// The outputs handed back, as variables the loss's backward reaches.
    outputs: Vec<Var>,
    seeds: Vec<u64>,
    fingerprints: Vec<u64>,
    /// The rows each block ran over, piece by piece, in one visit of its weights.
    pieces: Vec<Vec<Rows>>,
    /// Activations kept by blocks with a hand-written backward (no recompute),
    /// one entry per piece.
    kept: Vec<Vec<Option<Kept>>>,
}

/// Where a block's pieces left their activations: spilled if any piece
/// spilled, else on the device if any piece kept them.
fn place_of(pieces: &[Option<Kept>]) -> ActivationPlace {
    let mut place = ActivationPlace::Recomputed;
    for k in pieces.iter().flatten() {
        match k {
            Kept::Host(_) => return ActivationPlace::Host,
            Kept::Device(_) => place = ActivationPlace::Device,
        }
    }
    place
}

/// A piece's kept activations: on the device, or spilled to the host
/// ([`ActivationPolicy::Spill`]) until their block's backward nears.
enum Kept {
    Device(SavedActivations),
    Host(crate::host_saved::Spilled),
}

impl Saved {
    /// Block `i`'s input and spilled activations back on the device, where
    /// they were offloaded.
    fn bring_back(
        &mut self,
        i: usize,
        host: &mut crate::host_saved::HostSaved,
        device: &candle_core::Device,
    ) -> Result<()> {
        if self.on_host[i] {
            self.inputs[i] = host.fetch(&self.inputs[i], device)?;
            self.on_host[i] = false;
        }
        for k in self.kept[i].iter_mut() {
            *k = match k.take() {
                Some(Kept::Host(s)) => Some(Kept::Device(host.bring_acts(s, device)?)),
                other => other,
            };
        }
        Ok(())
    }
}

/// What a training forward records block by block.
#[derive(Default)]
struct Record {
    inputs: Vec<Tensor>,
    on_host: Vec<bool>,
    pieces: Vec<Vec<Rows>>,
    kept: Vec<Vec<Option<Kept>>>,
    /// Bytes of activations kept on the device so far.
    used: usize,
    /// Bytes of activations spilled to the host so far.
    spilled: usize,
    /// The last block that spilled (the next one may not).
    last_spill: Option<usize>,
    /// What each block's pieces needed to keep their activations (0: no
    /// hand-written backward), for the next forward's placement.
    needs: Vec<Vec<usize>>,
}

impl Saved {
    /// Drops block `i`'s saved input once its backward has run.
    fn drop_input(&mut self, i: usize) -> Result<()> {
        self.inputs[i] = Tensor::zeros(0, self.inputs[i].dtype(), &candle_core::Device::Cpu)?;
        Ok(())
    }
}

/// What backward through one block produced.
struct BlockStep {
    grads: BlockGrads,
    g_x: Option<Tensor>,
    g_extras: Vec<Option<Tensor>>,
}

/// Weight gradients of one block: Candle's store, or a hand-written backward's.
enum BlockGrads {
    Autograd(GradStore),
    Manual(HashMap<candle_core::TensorId, Tensor>),
}

impl BlockGrads {
    fn get(&self, t: &Tensor) -> Option<&Tensor> {
        match self {
            Self::Autograd(g) => g.get(t),
            Self::Manual(m) => m.get(&t.id()),
        }
    }
}

/// A `StreamedSequential` that trains: see the module docs.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap};
/// use streamer_autograd::{CpuAdamW, Train};
/// use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// for i in 0..2 {
///     linear(4, 4, vb.pp(format!("l{i}")))?;
/// }
/// let blocks = (0..2).map(|i| BlockSpec::module(format!("l{i}"), |vb| linear(4, 4, vb))).collect();
/// let model = StreamedSequential::from_varmap(&varmap, blocks, StreamConfig::default())?.train();
/// let params: Vec<_> = model.parameters().into_iter().map(|(_, v)| v).collect();
/// let mut opt = CpuAdamW::new(params, ParamsAdamW { lr: 1e-2, ..Default::default() })?;
/// let x = Tensor::randn(0f32, 1.0, (8, 4), &Device::Cpu)?;
/// let target = Tensor::zeros((8, 4), DType::F32, &Device::Cpu)?;
/// let mut losses = vec![];
/// for _ in 0..20 {
///     let loss = model.forward(&x)?.sub(&target)?.sqr()?.mean_all()?;
///     losses.push(loss.to_scalar::<f32>()?);
///     let grads = model.backward(&loss)?;
///     opt.step(&grads)?;
///     model.zero_grad()?;
/// }
/// assert!(losses[19] < losses[0]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct TrainableSequential {
    model: StreamedSequential,
    training: AtomicBool,
    next_seed: AtomicU64,
    state: Mutex<TrainState>,
}

struct TrainState {
    saved: Option<Saved>,
    /// Mode of the forward whose state is saved.
    saved_training: bool,
    grads: HostGrads,
    /// Host copies of block inputs under `OffloadInputs`.
    host_saved: crate::host_saved::HostSaved,
    trainable: Vec<bool>,
    /// Weights the overlapped step already stepped in this backward.
    stepped: Vec<bool>,
    optimizer_seconds: f64,
    optimizer_pool: Option<std::sync::Arc<rayon::ThreadPool>>,
    policy: ActivationPolicy,
    /// Where the last training forward left each block's activations.
    places: Vec<ActivationPlace>,
    /// What each block's pieces needed to keep their activations in the
    /// last training forward (its `Record::needs`).
    needs: Vec<Vec<usize>>,
    /// Rows of the batch a block runs over at a time (`None`: all at once).
    micro_rows: Option<usize>,
    /// The first dropout seed of the last training forward: given back if a
    /// panic interrupts its step, as an error does, or on request
    /// (`rewind_dropout_seeds`).
    step_seeds: Option<u64>,
}

/// Turns a streamed model into a trainable one.
pub trait Train {
    /// The trainable model, in training mode.
    fn train(self) -> TrainableSequential;
}

impl Train for StreamedSequential {
    fn train(self) -> TrainableSequential {
        TrainableSequential::new(self)
    }
}

impl TrainableSequential {
    /// Wraps `model`; every float weight is trainable (packed, quantized
    /// ones never are) and the model is in training mode.
    pub fn new(model: StreamedSequential) -> Self {
        let n = model.masters().len();
        let trainable = model.masters().iter().map(|m| !m.is_packed()).collect();
        Self {
            training: AtomicBool::new(true),
            next_seed: AtomicU64::new(0x5EED),
            state: Mutex::new(TrainState {
                saved: None,
                saved_training: true,
                grads: HostGrads::new(n),
                host_saved: Default::default(),
                trainable,
                stepped: vec![false; n],
                optimizer_seconds: 0.0,
                optimizer_pool: None,
                policy: ActivationPolicy::default(),
                places: Vec::new(),
                needs: Vec::new(),
                micro_rows: None,
                step_seeds: None,
            }),
            model,
        }
    }

    /// The streamed model underneath.
    pub fn inner(&self) -> &StreamedSequential {
        &self.model
    }

    /// Every distinct weight as `(name, host variable)`. After `backward`, each
    /// trainable one's gradient is in the returned `GradStore` under this
    /// variable, as an f32 host tensor, so any candle-nn `Optimizer` can use it.
    pub fn parameters(&self) -> Vec<(String, Var)> {
        self.model.parameters()
    }

    /// The trainable weights' variables (what an optimizer should get).
    pub fn trainable_vars(&self) -> Result<Vec<Var>> {
        let st = self.lock()?;
        Ok(self
            .model
            .parameters()
            .into_iter()
            .zip(&st.trainable)
            .filter(|(_, t)| **t)
            .map(|((_, v), _)| v)
            .collect())
    }

    /// The training state. After a panic that escaped a call holding it, the
    /// half-done call's state is dropped first (its saved forward, its partial
    /// gradients), so the next call starts clean: a backward then asks for a
    /// new forward.
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, TrainState>> {
        self.state.lock().or_else(|poisoned| {
            let mut st = poisoned.into_inner();
            st.saved = None;
            st.grads.abort();
            st.stepped.iter_mut().for_each(|s| *s = false);
            if let Some(base) = st.step_seeds.take() {
                self.rewind_seeds(base);
            }
            self.state.clear_poison();
            Ok(st)
        })
    }

    /// Gives back the dropout seeds of the last training forward, so that the
    /// next training forward replays its masks: for a step that failed after
    /// its backward (in the optimizer, say), so that retrying it gives what a
    /// run that never failed gives. A failed (or panicked) forward or backward
    /// does this itself. Does nothing if no training forward ran, or another
    /// drew seeds since.
    pub fn rewind_dropout_seeds(&self) -> Result<()> {
        if let Some(base) = self.lock()?.step_seeds.take() {
            self.rewind_seeds(base);
        }
        Ok(())
    }

    /// Gives back the dropout seeds a failed training forward (or the forward
    /// of a failed backward) drew, so that retrying the step replays the same
    /// masks as a run that never failed. Does nothing if a later forward drew
    /// seeds since.
    fn rewind_seeds(&self, base: u64) {
        let n = self.model.blocks().len() as u64;
        let _ = self.next_seed.compare_exchange(
            base.wrapping_add(n),
            base,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
    }

    /// Freezes (or unfreezes) the named weights: frozen ones get no gradient
    /// and cost no device-to-host transfer. A packed (quantized) weight
    /// cannot be made trainable: that is an error naming it, with nothing
    /// changed.
    pub fn set_trainable(&self, names: &[&str], trainable: bool) -> Result<()> {
        let mut st = self.lock()?;
        let mut which = Vec::with_capacity(names.len());
        for n in names {
            let i = self.model.masters().index_of(n).ok_or_else(|| {
                candle_core::Error::Msg(format!("no weight named {n:?} in the model"))
            })?;
            if trainable && self.model.masters().get(i).is_packed() {
                return Err(streamer_device::Error::Dtype {
                    what: format!("weight {n:?}"),
                    got: candle_core::DType::U8,
                    expected: "a float dtype: it is quantized (packed bytes) and cannot be \
                               trained; train LoRA adapters on it instead"
                        .into(),
                }
                .into());
            }
            which.push(i);
        }
        which.into_iter().for_each(|i| st.trainable[i] = trainable);
        Ok(())
    }

    /// Sets the seed the next training forward's dropout masks derive from (block
    /// `i` of that forward uses `seed + i`, replayable with `with_seed(seed + i, ..)`).
    pub fn set_seed(&self, seed: u64) {
        self.next_seed.store(seed, Ordering::SeqCst);
    }

    /// Sets what training forwards keep for backward (see [`ActivationPolicy`]);
    /// an impossible policy is an error and changes nothing.
    pub fn set_activation_policy(&self, policy: ActivationPolicy) -> Result<()> {
        policy.validate(&self.model.config().device)?;
        self.lock()?.policy = policy;
        Ok(())
    }

    /// The activation policy in force.
    pub fn activation_policy(&self) -> Result<ActivationPolicy> {
        Ok(self.lock()?.policy)
    }

    /// Runs each block over at most `rows` rows of the batch at a time (pieces
    /// along dimension 0 of the model input), every piece during the same
    /// visit of the block's weights: its weights arrive once, every piece's
    /// forward runs through it, and in backward every piece's recompute and
    /// backward run before its gradients, summed on the device, leave it once.
    /// A step over many micro-batches thus moves the weights as often as a step
    /// over one, with the transient activation memory of one piece (kept
    /// activations and saved block inputs still grow with the batch). The
    /// gradients equal those of the whole batch at once. Extras are handed
    /// whole to every piece: they must not have a batch dimension. Dropout
    /// draws a different mask for each piece. `None` runs the whole batch at
    /// once (the default); `Some(0)` is an error.
    pub fn set_micro_batch_rows(&self, rows: Option<usize>) -> Result<()> {
        if rows == Some(0) {
            candle_core::bail!("set_micro_batch_rows: pieces of 0 rows");
        }
        self.lock()?.micro_rows = rows;
        Ok(())
    }

    /// Rows a block runs over at a time ([`Self::set_micro_batch_rows`]).
    pub fn micro_batch_rows(&self) -> Result<Option<usize>> {
        Ok(self.lock()?.micro_rows)
    }

    /// How many blocks kept their activations in the last training forward,
    /// on the device or spilled (the others recompute in backward).
    pub fn kept_blocks(&self) -> Result<usize> {
        let places = self.activation_places()?;
        Ok(places
            .iter()
            .filter(|&&p| p != ActivationPlace::Recomputed)
            .count())
    }

    /// How many of [`Self::kept_blocks`] were spilled to the host
    /// ([`ActivationPolicy::Spill`]).
    pub fn spilled_blocks(&self) -> Result<usize> {
        let places = self.activation_places()?;
        Ok(places
            .iter()
            .filter(|&&p| p == ActivationPlace::Host)
            .count())
    }

    /// Where the last training forward left each block's activations for its
    /// backward (empty before the first).
    pub fn activation_places(&self) -> Result<Vec<ActivationPlace>> {
        Ok(self.lock()?.places.clone())
    }

    /// Training mode: forwards save what backward needs.
    pub fn set_training(&self, on: bool) {
        self.training.store(on, Ordering::SeqCst);
    }

    /// Whether in training mode.
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::SeqCst)
    }

    /// Clears the accumulated host gradients.
    pub fn zero_grad(&self) -> Result<()> {
        self.lock()?.grads.zero();
        Ok(())
    }

    /// Statistics of the pool (copies both ways, stalls, residency).
    pub fn stats(&self) -> Result<streamer_core::StreamStats> {
        self.model.stats()
    }

    /// Runs the blocks; returns the last block's first output.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with(x, &[])?.swap_remove(0))
    }

    /// [`StreamedSequential::forward_cached_with`]: inference with every
    /// block's kv cache in use (an error in training mode).
    pub fn forward_cached_with(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>> {
        if self.is_training() {
            candle_core::bail!("forward_cached_with: the model is in training mode");
        }
        self.model.forward_cached_with(x, extras)
    }

    /// Runs the blocks with `extras` handed to every block. In training mode the
    /// outputs are tracked: a loss built on them can be passed to `backward`.
    /// A variable among the extras reaches the blocks as a copy taken here
    /// (the backward reads it as this forward did, whatever is set in between),
    /// and its gradient comes back on the variable in the variable's dtype,
    /// whatever dtype the blocks computed it in.
    pub fn forward_with(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>> {
        let training = self.is_training();
        if !training {
            return self.model.forward_with(x, extras);
        }
        self.model.check_inputs(x, extras)?;
        let t0 = self.span_start();
        let mut st = self.lock()?;
        // SAFETY: the forward below releases every block it loads (on errors
        // too) and keeps no slot view past its release (`run_blocks_with`).
        let mut pool = unsafe { self.model.lock_pool_mut()? };
        let n = self.model.blocks().len();
        let base = self.next_seed.fetch_add(n as u64, Ordering::SeqCst);
        st.step_seeds = Some(base);
        let seeds: Vec<u64> = (0..n as u64).map(|i| base.wrapping_add(i)).collect();
        let mut rec = Record::default();
        let offload = st.policy == ActivationPolicy::OffloadInputs;
        let micro = st.micro_rows;
        let budget = (st.policy.budget(pool.device())?, st.policy.host_budget());
        let x_det = x.detach();
        let extras_det = snapshot_extras(extras)?;
        let prev = std::mem::take(&mut st.needs);
        let r = run_recorded(
            &mut pool,
            self.model.blocks(),
            (&x_det, &extras_det),
            &seeds,
            ForwardPlan {
                offload,
                micro,
                budget,
                prev: &prev,
            },
            &mut st.host_saved,
            &mut rec,
        );
        clear_current_seed();
        let r = r.and_then(|o| st.host_saved.settle().map(|_| o));
        // Backward starts with the last blocks: start copying them now, so the
        // copies overlap whatever runs between this forward and its backward.
        let r = r.and_then(|o| load_last(&mut pool, n).map(|_| o));
        let outs = match r {
            Ok(o) => o,
            Err(e) => {
                release_all(&mut pool);
                self.rewind_seeds(base);
                return Err(e);
            }
        };
        let inputs = (x, extras, extras_det);
        let ret = self.save_forward(&mut st, rec, inputs, outs, seeds)?;
        st.saved_training = training;
        pool.span_end(t0, || "forward call".into());
        Ok(ret)
    }

    /// Stores what the backward of a training forward needs (its record, the
    /// caller's inputs, the seeds and the weights' fingerprints) and returns
    /// the outputs as variables, so a loss built on them reaches `backward`.
    fn save_forward(
        &self,
        st: &mut TrainState,
        rec: Record,
        (x, extras, extras_det): (&Tensor, &[Tensor], Vec<Tensor>),
        outs: Vec<Tensor>,
        seeds: Vec<u64>,
    ) -> Result<Vec<Tensor>> {
        st.places = rec.kept.iter().map(|k| place_of(k)).collect();
        st.needs = rec.needs;
        let outputs = outs
            .iter()
            .map(Var::from_tensor)
            .collect::<Result<Vec<_>>>()?;
        let ret = outputs.iter().map(|v| v.as_tensor().clone()).collect();
        st.saved = Some(Saved {
            inputs: rec.inputs,
            on_host: rec.on_host,
            x: x.clone(),
            extras: extras.to_vec(),
            extras_det,
            outputs,
            seeds,
            fingerprints: self.fingerprints()?,
            pieces: rec.pieces,
            kept: rec.kept,
        });
        Ok(ret)
    }

    /// The start of a host span, when the timeline is on (else nothing is
    /// measured: see `StreamedSequential::record_host_span`).
    fn span_start(&self) -> Option<std::time::Instant> {
        self.model.timeline_on().then(std::time::Instant::now)
    }

    /// Records the host span `name` from `t0` to now, if one was started.
    fn span_end(&self, name: &str, t0: Option<std::time::Instant>) -> Result<()> {
        match t0 {
            Some(t0) => self
                .model
                .record_host_span(name, t0, std::time::Instant::now()),
            None => Ok(()),
        }
    }

    /// Candle's backward of `loss` (a host span on the timeline).
    fn loss_backward(&self, loss: &Tensor) -> Result<GradStore> {
        let t0 = self.span_start();
        let grads = loss.backward()?;
        self.span_end("loss.backward", t0)?;
        Ok(grads)
    }

    fn fingerprints(&self) -> Result<Vec<u64>> {
        self.model
            .masters()
            .iter()
            .map(|m| crate::grads::fingerprint(m.var.as_tensor()))
            .collect()
    }

    /// Backpropagates `loss` through everything: the Candle graph after the
    /// streamed part, the streamed blocks (recomputed in reverse through the
    /// window), and the graph before them. Streamed weights' gradients
    /// accumulate in host buffers until `zero_grad`: the returned host tensors
    /// are those buffers, so the next backward rewrites them in place (by DMA on
    /// CUDA). Read or step them between backward calls, never during one.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut grads = self.loss_backward(loss)?;
        self.backward_into(&mut grads)?;
        Ok(grads)
    }

    /// Backward with the optimizer step overlapped: each streamed weight is
    /// stepped by `opt` on a host thread as soon as its gradient has landed (after
    /// the last block that uses it in reverse order), while the GPU continues
    /// with earlier blocks. Weights outside the model (a head, an embedding) get
    /// their gradients in the returned `GradStore` as usual; step those yourself.
    /// `opt` must hold the model's trainable variables, and gradients must be
    /// zeroed between steps (nothing accumulates across calls in this mode). If
    /// backward fails midway, some weights may have been stepped already.
    pub fn backward_step<O: OverlapStep>(&self, loss: &Tensor, opt: &mut O) -> Result<GradStore> {
        let mut grads = self.loss_backward(loss)?;
        opt.begin_step();
        std::thread::scope(|scope| -> Result<()> {
            let (tx, rx) = std::sync::mpsc::channel::<StepJob>();
            let pool = self.optimizer_pool()?;
            let worker = scope.spawn(move || -> Result<f64> {
                let mut busy = 0.0;
                for job in rx {
                    job.marker.wait()?;
                    let t = std::time::Instant::now();
                    // On a pool that leaves cores free: the thread driving the GPU
                    // must keep issuing work while the optimizer runs.
                    pool.install(|| opt.step_vars(&job.updates))?;
                    busy += t.elapsed().as_secs_f64();
                }
                Ok(busy)
            });
            let r = self.backward_impl(&mut grads, Stepper::Host(&tx));
            drop(tx);
            let busy = worker
                .join()
                .map_err(|_| candle_core::Error::Msg("optimizer thread panicked".into()))??;
            self.lock()?.optimizer_seconds = busy;
            r
        })?;
        Ok(grads)
    }

    /// The thread pool the overlapped optimizer runs on: all cores but two (one
    /// for the thread issuing GPU work, one for the thread waiting on copies).
    fn optimizer_pool(&self) -> Result<std::sync::Arc<rayon::ThreadPool>> {
        let mut st = self.lock()?;
        if st.optimizer_pool.is_none() {
            let cores = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(4);
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(cores.saturating_sub(2).max(1))
                .thread_name(|i| format!("overlapped-optimizer-{i}"))
                .build()
                .map_err(candle_core::Error::wrap)?;
            st.optimizer_pool = Some(std::sync::Arc::new(pool));
        }
        Ok(st.optimizer_pool.clone().expect("set above"))
    }

    /// Seconds the last `backward_step` spent in the optimizer (on its thread).
    pub fn last_optimizer_seconds(&self) -> Result<f64> {
        Ok(self.lock()?.optimizer_seconds)
    }

    /// Like [`Self::backward`], for a `GradStore` the caller already computed
    /// (it must hold the gradients of this model's last outputs).
    pub fn backward_into(&self, grads: &mut GradStore) -> Result<()> {
        self.backward_impl(grads, Stepper::Offload)
    }

    /// Backward with the streamed weights stepped on the device by `opt`: each
    /// weight is stepped as soon as its gradient is complete, while its f32
    /// master is still staged on the GPU for this backward, and the updated
    /// master is copied back to the host in place of the gradient. The host
    /// does no optimizer work and receives 4 bytes per parameter instead of a
    /// gradient. `opt` must hold the model's trainable streamed parameters
    /// (`trainable_vars`); weights outside the model get their gradients in
    /// the returned `GradStore` as usual (step those yourself), streamed ones
    /// do not appear in it. On the CPU the host masters are stepped directly
    /// (the same arithmetic).
    ///
    /// A weight whose gradient holds a NaN or an infinity is left unchanged,
    /// moments included, and the call then fails naming it; the other streamed
    /// weights of this step have been stepped (as with `backward_step`, the
    /// step overlaps backward, so it cannot be refused whole). Other threads
    /// must not use the streamed parameters during the call: their host
    /// memory is written by DMA.
    pub fn backward_step_device(
        &self,
        loss: &Tensor,
        opt: &mut crate::DeviceAdamW,
    ) -> Result<GradStore> {
        let device = &self.model.config().device;
        if !opt.device().same_device(device) {
            candle_core::bail!(
                "backward_step_device: the DeviceAdamW keeps its moments on {:?} but the model \
                 streams to {:?}",
                opt.device().location(),
                device.location()
            );
        }
        let mut grads = self.loss_backward(loss)?;
        let trainable = self.lock()?.trainable.clone();
        let mut step = crate::device_step::DeviceStep::new(opt, self.model.masters(), &trainable)?;
        self.backward_impl(&mut grads, Stepper::Device(&mut step))?;
        let t0 = self.span_start();
        step.finish(self.model.masters())?;
        self.span_end("optimizer finish (reads the flags)", t0)?;
        Ok(grads)
    }

    fn backward_impl(&self, grads: &mut GradStore, mut stepper: Stepper<'_, '_>) -> Result<()> {
        let t0 = self.span_start();
        let mut st = self.lock()?;
        let Some(mut saved) = st.saved.take() else {
            candle_core::bail!(
                "backward without a training forward: call forward in training mode first \
                 (each forward can be backpropagated once)"
            );
        };
        self.check_unchanged_since_forward(st.saved_training, &saved)?;
        let g_outs: Vec<Option<Tensor>> = saved
            .outputs
            .iter()
            .map(|v| grads.remove(v.as_tensor()))
            .collect();
        if g_outs.iter().all(Option::is_none) {
            return Ok(());
        }
        // SAFETY: the backward releases every block it loads (`release_all`
        // on errors) and keeps only fresh gradients past a block's release.
        let mut pool = unsafe { self.model.lock_pool_mut()? };
        pool.span_end(t0, || "backward checks".into());
        let trainable = st.trainable.clone();
        let mut host_saved = std::mem::take(&mut st.host_saved);
        let r = self.streamed_backward(
            &mut pool,
            (&mut st.grads, &mut host_saved),
            &trainable,
            &mut saved,
            g_outs,
            &mut stepper,
        );
        st.host_saved = host_saved;
        let (g_x, g_extras) = match r {
            Ok((g_x, g_extras, stepped)) => {
                st.stepped = stepped;
                (g_x, g_extras)
            }
            Err(e) => {
                release_all(&mut pool);
                if matches!(stepper, Stepper::Device(_)) {
                    // Masters already written back must be whole before anything
                    // reads them (their pageable ends land at synchronize).
                    pool.settle();
                }
                st.grads.abort();
                if let Some(&base) = saved.seeds.first() {
                    self.rewind_seeds(base);
                }
                return Err(e);
            }
        };
        let (bytes, secs) = st.grads.take_counters();
        pool.add_d2h(bytes, secs);
        drop(pool);
        let t0 = self.span_start();
        self.hand_over_host_grads(&mut st, grads, &stepper)?;
        self.span_end("backward: host gradients collected", t0)?;
        let t0 = self.span_start();
        continue_upstream(grads, &saved, g_x, g_extras)?;
        drop(saved);
        self.span_end(
            "backward: upstream of the blocks, the forward's state freed",
            t0,
        )
    }

    /// The host gradients of a finished backward into `grads`, under their
    /// masters' variables; with the overlapped host optimizer, the weights
    /// not stepped during the loop (tied across blocks: their sum was
    /// complete only now) go to its thread.
    fn hand_over_host_grads(
        &self,
        st: &mut TrainState,
        grads: &mut GradStore,
        stepper: &Stepper<'_, '_>,
    ) -> Result<()> {
        let mut rest = Vec::new();
        for (m, g) in st.grads.collect()? {
            let var = &self.model.masters().get(m).var;
            grads.insert(var.as_tensor(), g.clone());
            if matches!(stepper, Stepper::Host(_)) && !st.stepped[m] {
                rest.push((var.clone(), g));
            }
        }
        if let Stepper::Host(tx) = stepper {
            if !rest.is_empty() {
                let marker = st.grads.marker()?;
                tx.send(StepJob {
                    marker,
                    updates: rest,
                })
                .map_err(|_| candle_core::Error::Msg("optimizer thread stopped".into()))?;
            }
            st.stepped.iter_mut().for_each(|s| *s = false);
        }
        Ok(())
    }

    /// Refuses a backward whose forward ran in the other mode or whose weights
    /// changed since (the recompute would give silently wrong gradients).
    fn check_unchanged_since_forward(&self, saved_training: bool, saved: &Saved) -> Result<()> {
        let mode = |t: bool| if t { "training" } else { "evaluation" };
        if saved_training != self.is_training() {
            candle_core::bail!(
                "the model switched from {} to {} mode between forward and backward",
                mode(saved_training),
                mode(self.is_training())
            );
        }
        let now = self.fingerprints()?;
        for (i, (a, b)) in saved.fingerprints.iter().zip(&now).enumerate() {
            if a != b {
                candle_core::bail!(
                    "weight {:?} changed between forward and backward (an optimizer step or \
                     Var::set before backward): gradients would be silently wrong",
                    self.model.masters().get(i).name
                );
            }
        }
        Ok(())
    }

    #[allow(clippy::type_complexity)]
    fn streamed_backward(
        &self,
        pool: &mut ResidencyPool,
        (host, inputs): (&mut HostGrads, &mut crate::host_saved::HostSaved),
        trainable: &[bool],
        saved: &mut Saved,
        g_outs: Vec<Option<Tensor>>,
        stepper: &mut Stepper<'_, '_>,
    ) -> Result<(Option<Tensor>, Vec<Option<Tensor>>, Vec<bool>)> {
        let t0 = pool.span_start();
        let blocks = self.model.blocks();
        let n = blocks.len();
        let window = pool.window();
        let last_user = last_users(pool, n, trainable.len());
        let mut stepped = vec![false; trainable.len()];
        host.begin(pool.device(), self.model.masters())?;
        load_window_for_backward(pool, n)?;
        let mut g_next = g_outs;
        let mut g_extras: Vec<Option<Tensor>> = vec![None; saved.extras.len()];
        // Two blocks ahead: a copy back waits (on the device) for the compute
        // issued before it, so it overlaps the block after that.
        for i in (n.saturating_sub(2)..n).rev() {
            saved.bring_back(i, inputs, pool.device())?;
        }
        pool.span_end(t0, || "backward setup".into());
        for i in (0..n).rev() {
            let t0 = pool.span_start();
            let flow = self.backward_block(
                pool,
                host,
                trainable,
                saved,
                i,
                &g_next,
                (stepper, last_user.as_slice(), stepped.as_mut_slice()),
            );
            let flow = flow?;
            move_window_back(pool, saved, inputs, i, window)?;
            pool.span_end(t0, || format!("{} backward issued", blocks[i].name()));
            let Some((g_x, g_ex)) = flow else {
                // Nothing flows back through this block (or anything before it).
                g_next = vec![None];
                continue;
            };
            add_extras(&mut g_extras, g_ex)?;
            g_next = vec![g_x];
        }
        finish_streamed_backward(pool, host, inputs, stepper)?;
        Ok((g_next.swap_remove(0), g_extras, stepped))
    }

    /// Backward through block `i` (loaded, not yet acquired), with its weights
    /// bound as variables: sends their gradients to the host (and, as the
    /// stepper says, completed weights to the optimizer thread) or steps them
    /// on the device, and returns the
    /// gradients of its input and extras, or `None` when nothing flows back.
    /// Everything bound to the slot is dropped before this returns; the caller
    /// releases the block.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn backward_block(
        &self,
        pool: &mut ResidencyPool,
        host: &mut HostGrads,
        trainable: &[bool],
        saved: &mut Saved,
        i: usize,
        g_next: &[Option<Tensor>],
        (stepper, last_user, stepped): (&mut Stepper<'_, '_>, &[usize], &mut [bool]),
    ) -> Result<Option<(Option<Tensor>, Vec<Option<Tensor>>)>> {
        // SAFETY: the weights, the variables and the block built from them are
        // locals of this function, dropped before it returns and so before the
        // caller's `release(i)`; what leaves it (the input and extras gradients,
        // and the weight gradients being offloaded) is checked against the slots
        // below and copied if a hand-written backward returned slot memory.
        let (weights, vars) = unsafe { pool.acquire_vars(i, trainable)? };
        let vb = VarBuilder::from_tensors(weights, pool.dtype(), pool.device());
        let spec = &self.model.blocks()[i];
        // A panic in the block's code is an error like any other (the caller
        // releases the window); the block dies with the unwound closure.
        let step = streamer_core::faults::catch_block_panic(spec.name(), "backward", || {
            let block = spec.build(vb)?;
            pieces_step(block.as_ref(), saved, i, g_next, &vars)
        })
        .map_err(|e| e.context(format!("in the backward of block {:?}", spec.name())))?;
        let Some(step) = step else {
            return Ok(None);
        };
        // The previous block's gradients have been copying out while this one
        // computed; their device memory may be reused after those copies.
        host.release_sources()?;
        if let Stepper::Device(dev) = stepper {
            let grads: Vec<(usize, Tensor)> = vars
                .iter()
                .filter_map(|(m, v)| step.grads.get(v.as_tensor()).map(|g| (*m, g.clone())))
                .collect();
            dev.step_block(pool, i, &grads, last_user)?;
        } else {
            for (m, v) in &vars {
                if let Some(g) = step.grads.get(v.as_tensor()) {
                    host.offload(*m, &fresh(pool, g)?)?;
                }
            }
        }
        if let Stepper::Host(tx) = stepper {
            self.send_ready(host, tx, &vars, last_user, i, stepped)?;
        }
        drop(vars);
        let g_x = step.g_x.map(|g| fresh(pool, &g)).transpose()?;
        let g_extras = step
            .g_extras
            .into_iter()
            .map(|g| g.map(|g| fresh(pool, &g)).transpose())
            .collect::<Result<Vec<_>>>()?;
        Ok(Some((g_x, g_extras)))
    }

    /// Hands the overlapped optimizer the weights block `i` completed.
    fn send_ready(
        &self,
        host: &HostGrads,
        tx: &std::sync::mpsc::Sender<StepJob>,
        vars: &[(usize, Var)],
        last_user: &[usize],
        i: usize,
        stepped: &mut [bool],
    ) -> Result<()> {
        let updates: Vec<(Var, Tensor)> = vars
            .iter()
            .filter(|(m, _)| last_user[*m] == i)
            .filter_map(|(m, _)| host.written(*m).map(|g| (*m, g)))
            .map(|(m, g)| {
                stepped[m] = true;
                (self.model.masters().get(m).var.clone(), g)
            })
            .collect();
        if !updates.is_empty() {
            let marker = host.marker()?;
            tx.send(StepJob { marker, updates })
                .map_err(|_| candle_core::Error::Msg("optimizer thread stopped".into()))?;
        }
        Ok(())
    }
}

/// Backward through block `i` over every piece of rows it ran over in the
/// forward: one piece's step as it is, or the pieces' steps with their weight
/// and extras gradients summed (on the device) and their input gradients
/// joined along the rows.
fn pieces_step(
    block: &dyn Block,
    saved: &mut Saved,
    i: usize,
    g_next: &[Option<Tensor>],
    vars: &[(usize, Var)],
) -> Result<Option<BlockStep>> {
    let rows = saved.pieces[i].clone();
    if rows.len() == 1 {
        return piece_step(block, saved, (i, 0, rows[0]), g_next);
    }
    let mut sum = PieceSum::default();
    for (p, &r) in rows.iter().enumerate() {
        let step = piece_step(block, saved, (i, p, r), g_next)?;
        let input = cut(&saved.inputs[i], r)?;
        sum.add(step, &input, vars)?;
    }
    sum.finish()
}

/// Backward through piece `p` (rows `r`) of block `i`.
fn piece_step(
    block: &dyn Block,
    saved: &mut Saved,
    (i, p, r): (usize, usize, Rows),
    g_next: &[Option<Tensor>],
) -> Result<Option<BlockStep>> {
    let g: Vec<Option<Tensor>> = g_next
        .iter()
        .map(|g| g.as_ref().map(|g| cut(g, r)).transpose())
        .collect::<Result<_>>()?;
    let piece = Piece {
        i,
        input: cut(&saved.inputs[i], r)?,
        seed: piece_seed(saved.seeds[i], p),
    };
    match block.manual() {
        Some(man) => {
            let kept = match saved.kept[i][p].take() {
                Some(Kept::Device(a)) => Some(a),
                Some(Kept::Host(_)) => candle_core::bail!(
                    "internal error: block {i}'s spilled activations were not brought back"
                ),
                None => None,
            };
            manual_step(man, &piece, kept, &saved.extras_det, &g)
        }
        None => autograd_step(block, &piece, &saved.extras, &g),
    }
}

/// One piece of a block's rows in backward: the block, its input rows and
/// the dropout seed its forward ran with.
struct Piece {
    i: usize,
    input: Tensor,
    seed: u64,
}

/// The pieces of one block's backward, summed as they come.
#[derive(Default)]
struct PieceSum {
    grads: HashMap<candle_core::TensorId, Tensor>,
    g_x: Vec<Option<Tensor>>,
    g_extras: Vec<Option<Tensor>>,
    /// Rows of each piece's input, for a piece that sent no gradient back.
    inputs: Vec<Tensor>,
    any: bool,
}

impl PieceSum {
    fn add(
        &mut self,
        step: Option<BlockStep>,
        input: &Tensor,
        vars: &[(usize, Var)],
    ) -> Result<()> {
        self.inputs.push(input.clone());
        let Some(step) = step else {
            self.g_x.push(None);
            return Ok(());
        };
        self.any = true;
        for (_, v) in vars {
            if let Some(g) = step.grads.get(v.as_tensor()) {
                add_into(&mut self.grads, v.as_tensor().id(), g.detach())?;
            }
        }
        self.g_x.push(step.g_x);
        if self.g_extras.len() < step.g_extras.len() {
            self.g_extras.resize(step.g_extras.len(), None);
        }
        add_extras(&mut self.g_extras, step.g_extras)?;
        Ok(())
    }

    fn finish(self) -> Result<Option<BlockStep>> {
        if !self.any {
            return Ok(None);
        }
        let g_x = if self.g_x.iter().all(Option::is_none) {
            None
        } else {
            let parts = self
                .g_x
                .into_iter()
                .zip(&self.inputs)
                .map(|(g, x)| g.map_or_else(|| x.zeros_like(), Ok))
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&parts, 0)?)
        };
        Ok(Some(BlockStep {
            grads: BlockGrads::Manual(self.grads),
            g_x,
            g_extras: self.g_extras,
        }))
    }
}

/// Adds each extra's gradient in `more` to its sum in `acc`.
fn add_extras(acc: &mut [Option<Tensor>], more: Vec<Option<Tensor>>) -> Result<()> {
    for (acc, g) in acc.iter_mut().zip(more) {
        if let Some(g) = g {
            *acc = Some(match acc.take() {
                None => g,
                Some(a) => a.add(&g)?,
            });
        }
    }
    Ok(())
}

/// Adds `g` to the gradient kept under `id`.
fn add_into(
    grads: &mut HashMap<candle_core::TensorId, Tensor>,
    id: candle_core::TensorId,
    g: Tensor,
) -> Result<()> {
    let sum = match grads.remove(&id) {
        Some(prev) => prev.add(&g)?,
        None => g,
    };
    grads.insert(id, sum);
    Ok(())
}

/// Rows of a batch: all of them, or `len` rows from `start` along dimension 0.
#[derive(Clone, Copy, Debug)]
enum Rows {
    All,
    Range(usize, usize),
}

/// The pieces a block runs over: pieces of at most `micro` rows of `h`, or
/// the whole of it (no setting, a scalar, or no more rows than a piece).
fn rows_of(h: &Tensor, micro: Option<usize>) -> Result<Vec<Rows>> {
    let Some(m) = micro else {
        return Ok(vec![Rows::All]);
    };
    if h.rank() == 0 || h.dim(0)? <= m {
        return Ok(vec![Rows::All]);
    }
    let n = h.dim(0)?;
    Ok((0..n)
        .step_by(m)
        .map(|s| Rows::Range(s, m.min(n - s)))
        .collect())
}

/// The rows `r` of `t`.
fn cut(t: &Tensor, r: Rows) -> Result<Tensor> {
    match r {
        Rows::All => Ok(t.clone()),
        Rows::Range(s, l) => t.narrow(0, s, l),
    }
}

/// Each piece's outputs joined along the rows (one piece: as they are).
fn join_pieces(mut outs: Vec<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    if outs.len() == 1 {
        return Ok(outs.swap_remove(0));
    }
    let k = outs[0].len();
    (0..k)
        .map(|j| {
            let parts = outs
                .iter()
                .map(|o| {
                    o.get(j).cloned().ok_or_else(|| {
                        candle_core::Error::Msg(
                            "a block returned a different number of outputs for two pieces of \
                             its batch"
                                .into(),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0).map_err(|e| {
                e.context(format!(
                    "joining output {j} of the pieces of a micro-batched block (outputs must \
                     have the batch as dimension 0)"
                ))
            })
        })
        .collect()
}

/// Piece `p`'s dropout seed: the block's own for the first piece (a whole
/// batch replays as before), a distinct one for each further piece.
fn piece_seed(seed: u64, p: usize) -> u64 {
    if p == 0 {
        seed
    } else {
        seed ^ (p as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

/// Backward through one piece of block `i` by recomputing it under Candle
/// autograd.
fn autograd_step(
    block: &dyn Block,
    piece: &Piece,
    extras: &[Tensor],
    g_next: &[Option<Tensor>],
) -> Result<Option<BlockStep>> {
    let x_var = Var::from_tensor(&piece.input)?;
    let extra_vars = extras
        .iter()
        .map(|e| {
            if e.dtype().is_float() {
                Var::from_tensor(&e.detach()).map(|v| v.as_tensor().clone())
            } else {
                Ok(e.clone())
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let ctx = BlockCtx::training(piece.i, x_var.device(), piece.seed, false);
    let outs = with_seed(piece.seed, || {
        block.forward_ctx(x_var.as_tensor(), &extra_vars, &ctx)
    })?;
    // A surrogate whose gradient with respect to each output is the upstream
    // gradient: backward of sum(out ⊙ g) = Jᵀ g.
    let mut surrogate: Option<Tensor> = None;
    for (o, g) in outs.iter().zip(g_next) {
        if let Some(g) = g {
            let term = o
                .mul(&g.to_dtype(o.dtype())?.detach())?
                .to_dtype(candle_core::DType::F32)?
                .sum_all()?;
            surrogate = Some(match surrogate {
                None => term,
                Some(s) => s.add(&term)?,
            });
        }
    }
    let Some(surrogate) = surrogate else {
        return Ok(None);
    };
    let bg = surrogate.backward()?;
    drop(outs);
    let g_extras = extra_vars.iter().map(|ev| bg.get(ev).cloned()).collect();
    let g_x = bg.get(x_var.as_tensor()).cloned();
    Ok(Some(BlockStep {
        grads: BlockGrads::Autograd(bg),
        g_x,
        g_extras,
    }))
}

/// Backward through one piece of a block by its hand-written backward, from
/// the `kept` activations or a recompute of them.
fn manual_step(
    man: &dyn ManualBackward,
    piece: &Piece,
    kept: Option<SavedActivations>,
    extras_det: &[Tensor],
    g_next: &[Option<Tensor>],
) -> Result<Option<BlockStep>> {
    let i = piece.i;
    if g_next.len() > 1 {
        candle_core::bail!(
            "block {i} has a hand-written backward but is the last block with {} outputs              (such blocks return one output)",
            g_next.len()
        );
    }
    let Some(Some(g)) = g_next.first() else {
        return Ok(None);
    };
    let acts = match kept {
        Some(a) => a,
        None => {
            let ctx = BlockCtx::training(i, piece.input.device(), piece.seed, false);
            with_seed(piece.seed, || {
                man.recompute_ctx(&piece.input, extras_det, &ctx)
            })?
        }
    };
    let (g_x, list) = man.backward(acts, g)?;
    // Detached: a backward computed with the pool's variables may have recorded
    // a Candle graph, which the next block's backward would otherwise keep alive.
    let g_x = g_x.detach();
    let mut grads: HashMap<candle_core::TensorId, Tensor> = HashMap::with_capacity(list.len());
    for (w, g) in list {
        add_into(&mut grads, w.id(), g.detach())?;
    }
    // A hand-written backward may also return gradients of its extras (a
    // LoRA layer's adapters), keyed by the extras it was given: the forward's
    // detached ones, whether the activations were kept or recomputed.
    let g_extras = extras_det.iter().map(|e| grads.remove(&e.id())).collect();
    Ok(Some(BlockStep {
        grads: BlockGrads::Manual(grads),
        g_x: Some(g_x),
        g_extras,
    }))
}

/// `t`, or a copy of it when it shares memory with a slot (a hand-written
/// backward that returned a weight): the slot is refilled before `t` is used.
/// The check compares storage identities, so fresh tensors cost nothing.
fn fresh(pool: &ResidencyPool, t: &Tensor) -> Result<Tensor> {
    if pool.aliases_slot(t) {
        t.copy()
    } else {
        Ok(t.clone())
    }
}

/// Where a training forward may keep activations: `device` and `host` are
/// (budget, bytes used so far); spilled ones go through `saved`, and
/// `last_spill` is the last block that spilled. The device's budget is kept
/// for the last blocks (`tail`): their backward comes first, so a spilled
/// block is an early one, whose copies have the rest of the forward to leave
/// and the backward of every later block to come back.
struct Room<'a> {
    device: (usize, &'a mut usize),
    host: (usize, &'a mut usize),
    last_spill: &'a mut Option<usize>,
    saved: &'a mut crate::host_saved::HostSaved,
    tail: Tail<'a>,
    /// What each piece of this forward needs (0: no hand-written backward),
    /// by block: the next forward's `tail`.
    needs: &'a mut Vec<Vec<usize>>,
}

/// What the pieces after the current one are expected to keep: what they
/// needed in the last training forward, or, where that is unknown or stale
/// (the current piece needs other than it did), the current piece's need.
#[derive(Clone, Copy)]
struct Tail<'a> {
    prev: &'a [Vec<usize>],
    blocks: usize,
}

impl Tail<'_> {
    /// Bytes the pieces after piece `p` of `pieces` of block `i` will want.
    fn after(&self, (i, p, pieces): (usize, usize, usize), need: usize) -> usize {
        let fresh = self.prev.get(i).and_then(|v| v.get(p)) == Some(&need);
        let block = |j: usize| match self.prev.get(j) {
            Some(v) if fresh => v.iter().sum(),
            _ => need * pieces,
        };
        let here = match self.prev.get(i) {
            Some(v) if fresh => v[p + 1..].iter().sum(),
            _ => need * (pieces - 1 - p),
        };
        here + (i + 1..self.blocks).map(block).sum::<usize>()
    }
}

impl Room<'_> {
    /// Takes `need` bytes for piece `p` of `pieces` of block `i` on the
    /// device when they and every later piece's fit there (the last blocks
    /// are kept), else on the host; `None` when neither has room (the block
    /// recomputes). `Some(true)`: on the host. No block spills right after a
    /// block that spilled: a spill's copies (slower than the block's compute
    /// over PCIe) drain while the block after it runs, so the forward does
    /// not wait for them.
    fn take(&mut self, (i, p, pieces): (usize, usize, usize), need: usize) -> Option<bool> {
        self.note((i, p), need);
        let tail = self.tail.after((i, p, pieces), need);
        let (budget, used) = (self.device.0, *self.device.1);
        let on_device = budget > 0 && used + need + tail <= budget;
        let (host_budget, host_used) = (self.host.0, *self.host.1);
        let on_host = host_budget > 0 && host_used + need <= host_budget;
        let follows_spill = i > 0 && *self.last_spill == Some(i - 1);
        let host = if on_device {
            false
        } else if on_host && !follows_spill {
            *self.last_spill = Some(i);
            true
        } else {
            return None;
        };
        *(if host {
            &mut self.host
        } else {
            &mut self.device
        })
        .1 += need;
        Some(host)
    }

    /// Records what piece `p` of block `i` needs.
    fn note(&mut self, (i, p): (usize, usize), need: usize) {
        if self.needs.len() <= i {
            self.needs.resize_with(i + 1, Vec::new);
        }
        let v = &mut self.needs[i];
        if v.len() <= p {
            v.resize(p + 1, 0);
        }
        v[p] = need;
    }
}

/// Runs piece `p` of block `i` of a training forward with its dropout `seed`:
/// keeps its activations in `kept` when it has a hand-written backward and
/// they fit `room` (on the device, else spilled to the host), else runs it
/// plainly.
fn run_training_block(
    pool: &ResidencyPool,
    (i, p, pieces, seed): (usize, usize, usize, u64),
    block: &dyn Block,
    (h, extras): (&Tensor, &[Tensor]),
    room: &mut Room<'_>,
    kept: &mut Option<Kept>,
) -> Result<Vec<Tensor>> {
    let plain = BlockCtx::training(i, pool.device(), seed, false);
    let Some(man) = block.manual() else {
        room.note((i, p), 0);
        return block.forward_ctx(h, extras, &plain);
    };
    let need = man.saved_bytes(h.shape(), h.dtype());
    let Some(on_host) = room.take((i, p, pieces), need) else {
        return block.forward_ctx(h, extras, &plain);
    };
    let keep = BlockCtx::training(i, pool.device(), seed, true);
    let (y, acts) = man.forward_train_ctx(h, extras, &keep)?;
    check_saved(pool, &acts, i)?;
    *kept = Some(if on_host {
        // The extras stay: a hand-written backward keys their gradients by id.
        let ids: Vec<_> = extras.iter().map(Tensor::id).collect();
        Kept::Host(room.saved.spill((i, p), acts, &ids)?)
    } else {
        Kept::Device(acts)
    });
    Ok(vec![y])
}

/// Runs block `i` of a training forward over each piece of at most `micro`
/// rows of `h` (all of it when unset), each with its own dropout seed and its
/// kept activations in `kept`; returns the pieces' outputs joined and the rows
/// each covered.
fn run_training_pieces(
    pool: &ResidencyPool,
    (i, seed): (usize, u64),
    block: &dyn Block,
    (h, extras): (&Tensor, &[Tensor]),
    (micro, room): (Option<usize>, &mut Room<'_>),
    kept: &mut Vec<Option<Kept>>,
) -> Result<(Vec<Tensor>, Vec<Rows>)> {
    let rows = rows_of(h, micro)?;
    *kept = rows.iter().map(|_| None).collect();
    let mut outs = Vec::with_capacity(rows.len());
    for (p, &r) in rows.iter().enumerate() {
        let seed = piece_seed(seed, p);
        set_current_seed(seed);
        let h = cut(h, r)?;
        outs.push(run_training_block(
            pool,
            (i, p, rows.len(), seed),
            block,
            (&h, extras),
            room,
            &mut kept[p],
        )?);
    }
    Ok((join_pieces(outs)?, rows))
}

/// How a training forward runs its blocks: inputs offloaded, rows per
/// piece, the (device, host) bytes for kept activations, and what each
/// piece needed in the last forward ([`Tail`]).
struct ForwardPlan<'a> {
    offload: bool,
    micro: Option<usize>,
    budget: (usize, usize),
    prev: &'a [Vec<usize>],
}

/// Runs the blocks of a training forward over `x` (detached) and `extras`,
/// recording in `rec` what the backward needs. Each block's input is saved
/// (on the host under `offload`, but for the caller's input, which stays where
/// it is) and its dropout seed set just before it runs, so the recompute can
/// replay it; blocks with a hand-written backward keep their activations while
/// `budget` allows (device bytes, then host bytes: spilled). Returns the last
/// block's outputs.
fn run_recorded(
    pool: &mut ResidencyPool,
    blocks: &[BlockSpec],
    (x, extras): (&Tensor, &[Tensor]),
    seeds: &[u64],
    plan: ForwardPlan<'_>,
    host_saved: &mut crate::host_saved::HostSaved,
    rec: &mut Record,
) -> Result<Vec<Tensor>> {
    let ForwardPlan {
        offload,
        micro,
        budget: (budget, host_budget),
        prev,
    } = plan;
    // SAFETY: the closure keeps the block's input (the previous block's
    // output, which `run_blocks_with` copied if it aliased a slot, or the
    // caller's input) and activations that `check_saved` has verified share
    // no storage with a slot; its outputs are copied by `run_blocks_with`
    // when they alias one. Nothing else of the bound block survives it.
    unsafe {
        run_blocks_with(
            pool,
            blocks,
            x,
            extras,
            (false, true),
            |pool: &ResidencyPool, i, block: &dyn Block, h: &Tensor, extras: &[Tensor]| {
                if i == 0 {
                    // A run again from fresh weights (a stepped block lent
                    // to this forward was stale) starts the record over.
                    *rec = Record::default();
                }
                if offload || host_budget > 0 {
                    let lag = if host_budget > 0 { 2 } else { 1 };
                    host_saved.next_block(h.device(), lag)?;
                }
                // The first input is the caller's: it stays where it is.
                let to_host = offload && i > 0;
                rec.inputs.push(if to_host {
                    host_saved.save(i, h)?
                } else {
                    h.detach()
                });
                rec.on_host.push(to_host);
                let mut kept = Vec::new();
                let mut room = Room {
                    device: (budget, &mut rec.used),
                    host: (host_budget, &mut rec.spilled),
                    last_spill: &mut rec.last_spill,
                    saved: &mut *host_saved,
                    tail: Tail {
                        prev,
                        blocks: blocks.len(),
                    },
                    needs: &mut rec.needs,
                };
                let run = (h, extras);
                let (outs, rows) = run_training_pieces(
                    pool,
                    (i, seeds[i]),
                    block,
                    run,
                    (micro, &mut room),
                    &mut kept,
                )?;
                rec.pieces.push(rows);
                rec.kept.push(kept);
                Ok(outs)
            },
        )
    }
}

/// For each of `weights` weights, the lowest-index block of `n` that uses it
/// (`usize::MAX` for none): a reverse pass has the weight's gradient complete
/// after that block.
fn last_users(pool: &ResidencyPool, n: usize, weights: usize) -> Vec<usize> {
    let mut last_user = vec![usize::MAX; weights];
    for i in 0..n {
        for &(m, _) in &pool.layout(i).unique {
            last_user[m] = last_user[m].min(i);
        }
    }
    last_user
}

/// Fills the window with the last blocks of `n` for a reverse pass. The
/// training forward already issued their loads; any other loaded block (left
/// by an inference call with prefetch_across_calls) is released first, since
/// the reverse pass needs the window.
fn load_window_for_backward(pool: &mut ResidencyPool, n: usize) -> Result<()> {
    let first: Vec<usize> = (0..pool.window().min(n)).map(|k| n - 1 - k).collect();
    for b in 0..n {
        if pool.is_loaded(b) && !first.contains(&b) {
            pool.release(b)?;
        }
    }
    for &b in &first {
        if !pool.is_loaded(b) {
            pool.load(b)?;
        }
    }
    Ok(())
}

/// After block `i`'s backward: frees its input, brings block `i - 2`'s back
/// (input and spilled activations) and moves the window down one block
/// (releases `i`, loads `i - window`).
fn move_window_back(
    pool: &mut ResidencyPool,
    saved: &mut Saved,
    inputs: &mut crate::host_saved::HostSaved,
    i: usize,
    window: usize,
) -> Result<()> {
    // Block i's input is spent: its device memory (a whole batch's
    // rows under micro-batching) is free for the blocks before it.
    saved.drop_input(i)?;
    // Issued after block i's backward: the copy starts once that has run
    // (its destination is allocated on the compute stream, so the copy
    // waits for the work issued before) and overlaps block i - 1's. Bringing
    // back i - 1 here, its copy ran after block i's compute instead of beside
    // it: spilling every other layer of an 8B LoRA step on the H200, each
    // recomputed layer's span was 80 ms against 20 ms for a spilled one
    // (18 ms of recompute, then the next layer's 2.3 GB coming back).
    if i > 1 {
        saved.bring_back(i - 2, inputs, pool.device())?;
    }
    pool.release(i)?;
    if i >= window {
        pool.load(i - window)?;
    }
    Ok(())
}

/// Waits for the end of a reverse pass's copies: the gradients sent to the
/// host, the inputs brought back and, when stepping on the device, the
/// masters written back.
fn finish_streamed_backward(
    pool: &mut ResidencyPool,
    host: &mut HostGrads,
    inputs: &mut crate::host_saved::HostSaved,
    stepper: &Stepper<'_, '_>,
) -> Result<()> {
    let t0 = pool.span_start();
    host.finish()?;
    inputs.finish()?;
    if matches!(stepper, Stepper::Device(_)) {
        // The masters written back by DMA are complete (and the bounce
        // copies of their pageable ends done) only after this.
        pool.synchronize()?;
    }
    pool.span_end(t0, || "backward end (waits for the copies)".into());
    Ok(())
}

/// Starts loading the last blocks of `n` (as many as the window holds).
fn load_last(pool: &mut ResidencyPool, n: usize) -> Result<()> {
    (0..pool.window().min(n)).try_for_each(|k| pool.load(n - 1 - k))
}

/// Kept activations must not share memory with a pool slot: the slot is
/// refilled with other weights before the backward reads them.
fn check_saved(pool: &ResidencyPool, acts: &SavedActivations, i: usize) -> Result<()> {
    for (k, t) in acts.0.iter().enumerate() {
        if pool.aliases_slot(t) {
            candle_core::bail!(
                "block {i}'s forward_train kept a tensor (#{k}, {:?}) that shares memory with its \
                 weights; keep activations only (backward gets the weights from the block)",
                t.dims()
            );
        }
    }
    Ok(())
}

fn set_current_seed(seed: u64) {
    crate::dropout::set_seed(Some(seed));
}

fn clear_current_seed() {
    crate::dropout::set_seed(None);
}

/// The extras as the blocks see them: detached, so their gradients are
/// keyed by new ids, and a variable copied, so that a `Var::set` or an
/// optimizer step between this forward and its backward cannot change what
/// the recompute and the hand-written backward read.
fn snapshot_extras(extras: &[Tensor]) -> Result<Vec<Tensor>> {
    extras
        .iter()
        .map(|e| {
            if e.is_variable() {
                e.copy()
            } else {
                Ok(e.detach())
            }
        })
        .collect()
}

/// Continues backward into whatever produced the model input and the extras
/// (their gradients `g_x`, `g_extras` from the first block).
fn continue_upstream(
    grads: &mut GradStore,
    saved: &Saved,
    g_x: Option<Tensor>,
    g_extras: Vec<Option<Tensor>>,
) -> Result<()> {
    let mut upstream = Vec::new();
    if let Some(g) = g_x {
        upstream.push((saved.x.clone(), g));
    }
    for (e, g) in saved.extras.iter().zip(g_extras) {
        if let Some(g) = g {
            upstream.push((e.clone(), g));
        }
    }
    for (t, g) in upstream {
        if t.is_variable() {
            // A block may compute in another dtype than a variable extra's
            // (f32 LoRA adapters in a bf16 layer).
            accumulate_grad(grads, &t, g.to_dtype(t.dtype())?)?;
        } else if t.track_op() {
            // d/dθ sum(t ⊙ g) = J_tᵀ g: the chain rule into t's own graph.
            // A Candle backward per tensor, so extras with many of them should
            // be the variables themselves: 448 bf16 conversions of 8B LoRA
            // adapters took about 106 ms of host time here with the GPU idle
            // (`qlora-plan-timeline-8edefba-h100.txt`), one backward over
            // them all stacked 189 ms (`...-b1bcd9d-h100.txt`).
            let more = t.mul(&g.detach())?.sum_all()?.backward()?;
            grads.extend(more)?;
        }
    }
    Ok(())
}
