//! `StreamedSequential`: a sequence of native Candle blocks run with their weights
//! streamed from host memory through the residency pool.
use crate::block::{Block, BlockCtx, BlockSpec};
use crate::config::StreamConfig;
use crate::host::HostMasters;
use crate::pool::{BlockLayout, ResidencyPool};
use crate::setup::{SetupEvent, SetupTimes};
use crate::source::WeightSource;
use crate::stats::{Observer, StreamStats};
use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

/// A sequence of blocks whose weights live on the host and visit the device
/// through a window of `prefetch_ahead + 1` slots.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{linear, Module, VarBuilder, VarMap};
/// use streamer_core::{BlockSpec, StreamConfig, StreamedSequential};
///
/// // Two linear blocks created the ordinary candle-nn way.
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let resident = [linear(4, 4, vb.pp("l0"))?, linear(4, 4, vb.pp("l1"))?];
///
/// let blocks = vec![
///     BlockSpec::module("l0", |vb| linear(4, 4, vb)),
///     BlockSpec::module("l1", |vb| linear(4, 4, vb)),
/// ];
/// let model = StreamedSequential::from_varmap(&varmap, blocks, StreamConfig::default())?;
/// let x = Tensor::randn(0f32, 1.0, (3, 4), &Device::Cpu)?;
/// let want = resident[1].forward(&resident[0].forward(&x)?)?;
/// let got = model.forward(&x)?;
/// assert!((got - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// assert_eq!(model.stats()?.peak_resident_blocks, 2);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct StreamedSequential {
    blocks: Vec<BlockSpec>,
    cfg: StreamConfig,
    masters: Arc<HostMasters>,
    /// Where each block's weights sit in a slot (kept for [`Self::replica`]).
    layouts: Vec<BlockLayout>,
    pool: Mutex<ResidencyPool>,
    setup: SetupTimes,
}

impl StreamedSequential {
    /// Builds from safetensors files (or a `model.safetensors.index.json`), read
    /// through mmap straight into the host masters.
    pub fn from_safetensors<P: AsRef<Path>>(
        paths: &[P],
        blocks: Vec<BlockSpec>,
        cfg: StreamConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        Self::from_source(&WeightSource::safetensors(paths)?, blocks, cfg)
    }

    /// Builds from named in-memory tensors (any device). Tensors that share
    /// storage are one tied weight.
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        blocks: Vec<BlockSpec>,
        cfg: StreamConfig,
    ) -> Result<Self> {
        Self::from_source(&WeightSource::Tensors(tensors), blocks, cfg)
    }

    /// Builds from a candle-nn `VarMap`. CPU variables already in the master dtype
    /// are used in place as the masters (not copied).
    pub fn from_varmap(
        varmap: &candle_nn::VarMap,
        blocks: Vec<BlockSpec>,
        cfg: StreamConfig,
    ) -> Result<Self> {
        let map = varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        Self::from_tensors(map, blocks, cfg)
    }

    /// Builds from any weight source. Every check (missing, unexpected and
    /// mis-shaped weights, block sizes against the slot budget, dtypes) runs here,
    /// before anything is copied to the device.
    pub fn from_source(
        src: &WeightSource,
        blocks: Vec<BlockSpec>,
        cfg: StreamConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        if blocks.is_empty() {
            candle_core::bail!("StreamedSequential needs at least one block");
        }
        let mut seen = BTreeSet::new();
        for b in &blocks {
            if !seen.insert(b.prefix.clone()) {
                candle_core::bail!("two blocks share the weight prefix {:?}", b.prefix);
            }
        }
        let t = std::time::Instant::now();
        let mut masters = HostMasters::new(&cfg.aliases);
        let mut layouts = Vec::with_capacity(blocks.len());
        let all_names = src.names();
        let emit = |e| cfg.on_setup.as_ref().map(|h| h.emit(e));
        for (i, b) in blocks.iter().enumerate() {
            layouts.push(discover(src, &mut masters, b, &cfg, &all_names)?);
            emit(SetupEvent::Masters {
                done: i + 1,
                total: blocks.len(),
            });
        }
        let masters_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = &cfg.device {
            emit(SetupEvent::PageLock {
                bytes: masters.bytes(),
            });
            masters.pin(dev.cuda_stream().context())?;
        }
        let setup = SetupTimes {
            masters_s,
            pin_s: t.elapsed().as_secs_f64(),
        };
        emit(SetupEvent::Built(setup));
        let masters = Arc::new(masters);
        let names = blocks.iter().map(|b| b.name.clone()).collect();
        let pool = ResidencyPool::new(&cfg, masters.clone(), layouts.clone(), names)?;
        Ok(Self {
            blocks,
            cfg,
            masters,
            layouts,
            pool: Mutex::new(pool),
            setup,
        })
    }

    /// How long building this model took, by phase.
    pub fn setup_times(&self) -> SetupTimes {
        self.setup
    }

    /// A second model over the same host masters (nothing is copied on the
    /// host), streaming to `device` through its own pool and window: one replica
    /// per GPU is how data-parallel training keeps one copy of the weights.
    /// Everything else in the configuration is this model's. The masters are
    /// page-locked once, when the first model was built on a CUDA device (the
    /// registration is portable to every context); a replica of a model built
    /// for the CPU streams from pageable memory. An optimizer step on the
    /// masters is seen by every replica (prefetching across calls must be off).
    pub fn replica(&self, device: &Device) -> Result<Self> {
        if self.cfg.prefetch_across_calls.is_some() {
            candle_core::bail!(
                "replica: prefetch_across_calls is on, so a replica could compute with weights \
                 loaded before an optimizer step; turn it off for replicated training"
            );
        }
        let cfg = StreamConfig {
            device: device.clone(),
            ..self.cfg.clone()
        };
        let names = self.blocks.iter().map(|b| b.name.clone()).collect();
        let pool = ResidencyPool::new(&cfg, self.masters.clone(), self.layouts.clone(), names)?;
        Ok(Self {
            blocks: self.blocks.clone(),
            cfg,
            masters: self.masters.clone(),
            layouts: self.layouts.clone(),
            pool: Mutex::new(pool),
            setup: SetupTimes::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &StreamConfig {
        &self.cfg
    }

    /// The blocks.
    pub fn blocks(&self) -> &[BlockSpec] {
        &self.blocks
    }

    /// The host masters.
    pub fn masters(&self) -> &Arc<HostMasters> {
        &self.masters
    }

    /// Every distinct weight as `(name, host variable)`, in load order. A tied
    /// weight appears once, under its first name.
    pub fn parameters(&self) -> Vec<(String, Var)> {
        self.masters
            .iter()
            .map(|m| (m.name.clone(), m.var.clone()))
            .collect()
    }

    /// Writes every distinct weight (its host master) to a safetensors file,
    /// through a temporary file renamed into place, so an interrupted save never
    /// leaves a broken file behind. Tied weights are written once, under their
    /// first name (declare the others as `StreamConfig::aliases` when loading).
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        // Copies in flight read the masters; nothing writes them during a save.
        let map: HashMap<String, Tensor> = self
            .parameters()
            .into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect();
        streamer_device::save_atomic(&map, path)
    }

    /// Read-only access to the pool (its layout, the blocks loaded, its
    /// window), under the lock a call holds: errors as [`Self::lock_pool_mut`].
    pub fn lock_pool(&self) -> Result<PoolView<'_>> {
        self.lock().map(PoolView)
    }

    /// Exclusive access to the pool, for the training crate, which drives the
    /// window itself; errors as the private lock below.
    ///
    /// # Safety
    /// Before the guard drops, the caller releases every block it loaded (on
    /// an error too: [`release_all`]), keeps nothing `acquire_vars` handed out
    /// past its block's release (that fn's contract), and leaves the
    /// statistics and the window's bookkeeping to the pool's own methods.
    #[doc(hidden)]
    pub unsafe fn lock_pool_mut(&self) -> Result<MutexGuard<'_, ResidencyPool>> {
        self.lock()
    }

    /// Exclusive access to the pool, or an error naming the misuse when another
    /// call holds it (a block that calls the model, or two threads sharing it).
    /// A pool poisoned by a panic (one that escaped a call while holding it) is
    /// reset first: every copy and compute it issued is waited for and its
    /// window emptied, so no call computes on half-released slots; if that
    /// reset fails, the error says the pool is poisoned.
    fn lock(&self) -> Result<MutexGuard<'_, ResidencyPool>> {
        match self.pool.try_lock() {
            Ok(g) => Ok(g),
            Err(TryLockError::Poisoned(p)) => {
                // A panic unwound through a call holding the pool: empty its
                // window before anything computes on it again.
                let mut pool = p.into_inner();
                pool.reset_window().map_err(|e| {
                    candle_core::Error::Msg(format!(
                        "the pool is poisoned: a call panicked while holding it and resetting \
                         its slots failed ({e}); build the model again"
                    ))
                })?;
                self.pool.clear_poison();
                Ok(pool)
            }
            Err(TryLockError::WouldBlock) => candle_core::bail!(
                "StreamedSequential is already running a call: reentrant or concurrent calls on \
                 the same model are not allowed (the pool has one window of slots)"
            ),
        }
    }

    /// Checks a call's inputs against the configuration, before any copy.
    pub fn check_inputs(&self, x: &Tensor, extras: &[Tensor]) -> Result<()> {
        if !x.device().same_device(&self.cfg.device) {
            candle_core::bail!(
                "input is on {:?} but the model computes on {:?}",
                x.device().location(),
                self.cfg.device.location()
            );
        }
        if x.dtype() != self.cfg.dtype {
            return Err(streamer_device::Error::Dtype {
                what: format!("StreamedSequential input (shape {:?})", x.dims()),
                got: x.dtype(),
                expected: format!("{:?}, the dtype the model computes in", self.cfg.dtype),
            }
            .into());
        }
        for (i, e) in extras.iter().enumerate() {
            if !e.device().same_device(&self.cfg.device) {
                candle_core::bail!(
                    "extra input {i} (shape {:?}) is on {:?} but the model computes on {:?}",
                    e.dims(),
                    e.device().location(),
                    self.cfg.device.location()
                );
            }
        }
        Ok(())
    }

    /// Runs the blocks on `x`; returns the last block's first output.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with(x, &[])?.swap_remove(0))
    }

    /// Runs the blocks with `extras` handed to every block; returns all of the
    /// last block's outputs. Intermediate blocks pass their first output on.
    pub fn forward_with(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>> {
        self.forward_in(x, extras, false)
    }

    /// [`Self::forward_with`] with [`BlockCtx::kv_cache`] set for every block:
    /// blocks that keep a kv cache attend over it and extend it.
    pub fn forward_cached_with(&self, x: &Tensor, extras: &[Tensor]) -> Result<Vec<Tensor>> {
        self.forward_in(x, extras, true)
    }

    fn forward_in(&self, x: &Tensor, extras: &[Tensor], kv_cache: bool) -> Result<Vec<Tensor>> {
        self.check_inputs(x, extras)?;
        let mut pool = self.lock()?;
        let r = run_blocks(
            &mut pool,
            &self.blocks,
            x,
            extras,
            (self.cfg.prefetch_across_calls.is_some(), kv_cache),
            |_, _| Ok(()),
        );
        if r.is_err() {
            release_all(&mut pool);
        }
        r
    }

    /// Drops blocks loaded ahead for the next call (`prefetch_across_calls`), so
    /// the next call copies fresh weights; call after changing masters.
    pub fn evict_all(&self) -> Result<()> {
        let mut pool = self.lock()?;
        release_all(&mut pool);
        Ok(())
    }

    /// Statistics so far.
    pub fn stats(&self) -> Result<StreamStats> {
        self.lock()?.stats()
    }

    /// Clears the statistics.
    pub fn reset_stats(&self) -> Result<()> {
        self.lock()?.reset_stats()
    }

    /// Sets the function called on every residency transition.
    pub fn set_observer(&self, observer: Option<Observer>) -> Result<()> {
        self.lock()?.set_observer(observer);
        Ok(())
    }

    /// Records `start..end` of host time as a span named `name` on the
    /// timeline's host lane (beside the pool's own spans: each block's
    /// forward and backward issue, the reuse verdict, `loss.backward`), to
    /// see where the host thread's time goes between GPU work. Does nothing
    /// without `StreamConfig::timeline`; take the instants only when
    /// [`Self::timeline_on`] says so.
    pub fn record_host_span(
        &self,
        name: &str,
        start: std::time::Instant,
        end: std::time::Instant,
    ) -> Result<()> {
        if self.cfg.timeline {
            self.lock()?.host_span(name, start, end);
        }
        Ok(())
    }

    /// Whether a timeline is being recorded (`StreamConfig::timeline`).
    pub fn timeline_on(&self) -> bool {
        self.cfg.timeline
    }

    /// Writes the recorded timeline (needs `StreamConfig::timeline`) as Chrome-trace
    /// JSON to `path`, or to `StreamConfig::timeline_path` when `None`.
    pub fn write_timeline(&self, path: Option<&Path>) -> Result<()> {
        let path = path
            .map(Path::to_path_buf)
            .or_else(|| self.cfg.timeline_path.clone())
            .ok_or_else(|| candle_core::Error::Msg("no timeline path given".into()))?;
        let mut pool = self.lock()?;
        match pool.timeline()? {
            Some(t) => t.write(path),
            None => candle_core::bail!("the timeline is off: set StreamConfig.timeline = true"),
        }
    }
}

impl candle_core::Module for StreamedSequential {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        StreamedSequential::forward(self, xs)
    }
}

/// Runs `blocks` through `pool` in order, keeping `window` loads in flight.
/// Blocks already loaded (by a previous call's `cyclic` prefetch) are used as
/// they are. With `cyclic`, the slots that free up at the end start loading the
/// first blocks for the next call. `on_input(i, x)` sees each block's input
/// before it runs.
pub(crate) fn run_blocks(
    pool: &mut ResidencyPool,
    blocks: &[BlockSpec],
    x: &Tensor,
    extras: &[Tensor],
    (cyclic, kv_cache): (bool, bool),
    mut on_input: impl FnMut(usize, &Tensor) -> Result<()>,
) -> Result<Vec<Tensor>> {
    // SAFETY: the closure keeps nothing: it passes the block's input to
    // `on_input` (an input, not slot memory) and returns the block's outputs,
    // which `run_block_with` copies when they alias a slot. (A block that
    // stashes its own weights, against `Block`'s documented contract, can see
    // them refilled: a stale read, not freed memory, since views share the
    // slot's reference-counted storage.)
    unsafe {
        run_blocks_with(
            pool,
            blocks,
            x,
            extras,
            (cyclic, false),
            |pool, i, block, h, extras| {
                on_input(i, h)?;
                let ctx = BlockCtx::inference(i, pool.device()).with_kv_cache(kv_cache);
                block.forward_ctx(h, extras, &ctx)
            },
        )
    }
}

/// How [`run_blocks_with`] runs one bound block: `(pool, index, block, input,
/// extras) -> outputs`. Training uses it to keep a block's activations.
#[doc(hidden)]
pub trait RunBlock:
    FnMut(&ResidencyPool, usize, &dyn Block, &Tensor, &[Tensor]) -> Result<Vec<Tensor>>
{
}
impl<F: FnMut(&ResidencyPool, usize, &dyn Block, &Tensor, &[Tensor]) -> Result<Vec<Tensor>>>
    RunBlock for F
{
}

/// Runs `blocks` through `pool` in order, keeping `window` loads in flight, with
/// the call of each bound block left to `run`. Blocks already loaded (by a
/// previous call's `cyclic` prefetch) are used as they are. With `cyclic`, the
/// slots that free up at the end start loading the first blocks for the next
/// call. For the training crate; `StreamedSequential::forward_with` is the safe
/// way to run blocks.
///
/// With `reuse`, the first block loaded, when its slot still holds its
/// device-stepped masters, is computed without a copy and checked against the
/// host masters before this returns (`StreamConfig::reuse_stepped_blocks`); if
/// they had changed, every block runs again from fresh copies, so `run` is then
/// called a second time from block 0 and must start its record over when it
/// sees block 0.
///
/// # Safety
/// `run` gets a block bound to views of its slot, which the pool refills after
/// `run` returns. Apart from its returned outputs (copied here when they share
/// a slot's storage), `run` must not keep anything that shares memory with the
/// block's weights (a view, a reshape, activations a `forward_train` kept that
/// alias them) beyond its return; check with [`ResidencyPool::aliases_slot`].
/// A kept alias reads another block's weights after the refill.
#[doc(hidden)]
pub unsafe fn run_blocks_with(
    pool: &mut ResidencyPool,
    blocks: &[BlockSpec],
    x: &Tensor,
    extras: &[Tensor],
    (cyclic, reuse): (bool, bool),
    mut run: impl RunBlock,
) -> Result<Vec<Tensor>> {
    if !reuse {
        // SAFETY: forwarded from the caller.
        return unsafe { run_blocks_once(pool, blocks, x, extras, cyclic, &mut run) };
    }
    pool.open_reuse(true);
    // SAFETY: forwarded from the caller.
    let r = unsafe { run_blocks_once(pool, blocks, x, extras, cyclic, &mut run) };
    pool.open_reuse(false);
    let out = match r {
        Ok(out) => out,
        Err(e) => {
            pool.drop_lent();
            return Err(e);
        }
    };
    let t0 = pool.span_start();
    let stale = pool.lent_blocks_stale()?;
    pool.span_end(t0, || "reuse verdict".into());
    if !stale {
        return Ok(out);
    }
    // A lent block's masters changed on the host after its step: nothing of
    // this run is returned, and the verdict left no slot to lend.
    drop(out);
    // SAFETY: forwarded from the caller.
    unsafe { run_blocks_once(pool, blocks, x, extras, cyclic, &mut run) }
}

/// One pass of [`run_blocks_with`] over the blocks.
///
/// # Safety
/// As [`run_blocks_with`].
unsafe fn run_blocks_once(
    pool: &mut ResidencyPool,
    blocks: &[BlockSpec],
    x: &Tensor,
    extras: &[Tensor],
    cyclic: bool,
    run: &mut impl RunBlock,
) -> Result<Vec<Tensor>> {
    let n = blocks.len();
    let window = pool.window();
    // Blocks an earlier call left loaded (a training forward prefetching for its
    // backward) that this call does not start with give their slots back.
    for b in window.min(n)..n {
        if pool.is_loaded(b) {
            pool.release(b)?;
        }
    }
    for i in 0..window.min(n) {
        if !pool.is_loaded(i) {
            pool.load(i)?;
        }
    }
    let mut h = x.clone();
    let mut last = Vec::new();
    for (i, spec) in blocks.iter().enumerate() {
        let t0 = pool.span_start();
        let mut out = run_block_with(pool, spec, i, &h, extras, run)?;
        if i + window < n {
            pool.load(i + window)?;
        } else if cyclic && !pool.is_loaded((i + window) % n) {
            pool.load((i + window) % n)?;
        }
        pool.span_end(t0, || format!("{} forward issued", spec.name));
        if i + 1 < n {
            out.truncate(1);
            h = out.swap_remove(0);
        } else {
            last = out;
        }
    }
    Ok(last)
}

/// Binds block `i`'s resident weights, runs it through `run` and releases its
/// slot. Outputs that would alias the slot are copied, so eviction really frees
/// the weights and a refill cannot change them; the views themselves die with
/// the block before `release` (what `run` may keep is [`run_blocks_with`]'s
/// contract).
fn run_block_with(
    pool: &mut ResidencyPool,
    spec: &BlockSpec,
    i: usize,
    x: &Tensor,
    extras: &[Tensor],
    run: &mut impl RunBlock,
) -> Result<Vec<Tensor>> {
    let views = pool.acquire(i)?;
    let vb = VarBuilder::from_tensors(views, pool.dtype(), pool.device());
    // A panic in the block's code is an error like any other: the caller then
    // releases the window (the views die with the unwound closure).
    let pool_ref = &*pool;
    let mut out = crate::faults::catch_block_panic(&spec.name, "forward", || {
        let block = spec.build(vb)?;
        run(pool_ref, i, block.as_ref(), x, extras)
    })
    .map_err(|e| e.context(format!("in the forward of block {:?}", spec.name)))?;
    if out.is_empty() {
        candle_core::bail!("block {:?} returned no output", spec.name);
    }
    for t in out.iter_mut() {
        if pool.aliases_slot(t) {
            *t = t.copy()?;
        }
    }
    pool.release(i)?;
    Ok(out)
}

/// After an error mid-call: releases whatever is still loaded so the next call
/// starts from an empty window.
pub fn release_all(pool: &mut ResidencyPool) {
    for b in 0..pool.len() {
        if pool.is_loaded(b) {
            let _ = pool.release(b);
        }
    }
}

/// What a block's builder asks for, checked against the source, at construction.
struct Recorder<'a> {
    src: &'a WeightSource,
    block: &'a BlockSpec,
    state: Mutex<RecState<'a>>,
}

struct RecState<'a> {
    masters: &'a mut HostMasters,
    master_dtype: DType,
    requested: Vec<(String, usize, Shape)>,
}

// SAFETY of Send/Sync is derived: WeightSource, BlockSpec and the Mutex are Sync.
impl Recorder<'_> {
    fn fetch(&self, name: &str, expected: Option<&Shape>, dtype: DType) -> Result<Tensor> {
        let prefix = format!("{}.", self.block.prefix);
        let local = name.strip_prefix(&prefix).unwrap_or(name).to_string();
        let mut st = self
            .state
            .lock()
            .map_err(|_| candle_core::Error::Msg("recorder lock poisoned".into()))?;
        let aliased =
            st.masters.index_of(name).is_some() || self.src.contains(name) || has_alias(&st, name);
        if !aliased {
            candle_core::bail!(
                "block {:?} needs weight {name:?}{} but the weights have no tensor of that name",
                self.block.name,
                expected
                    .map(|s| format!(" of shape {:?}", s.dims()))
                    .unwrap_or_default()
            );
        }
        let dt = st.master_dtype;
        let idx = st.masters.resolve(self.src, name, dt)?;
        let t = st.masters.get(idx).var.as_tensor().clone();
        if let Some(s) = expected {
            streamer_device::Error::check_shape(t.dims(), s.dims(), || {
                let what = format!("block {:?}: weight {name:?}", self.block.name);
                (what, format!("{:?}, as the block expects", s.dims()))
            })?;
        }
        if crate::packed::is_packed(t.dtype()) != crate::packed::is_packed(dtype) {
            return Err(streamer_device::Error::Dtype {
                what: format!("block {:?}: weight {name:?}", self.block.name),
                got: t.dtype(),
                expected: match crate::packed::is_packed(t.dtype()) {
                    true => "u8: it is packed (quantized); read it as u8 and dequantize it".into(),
                    false => format!("{dtype:?}: a float weight cannot be read as packed bytes"),
                },
            }
            .into());
        }
        st.requested.push((local, idx, t.shape().clone()));
        // The builder runs only to say what it reads: a stand-in spares a
        // conversion of every master (f32 masters of a bf16 model).
        stand_in(t.shape(), dtype)
    }
}

thread_local! {
    static DISCOVERING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is running a block's builder only to learn which
/// weights it reads (a [`StreamedSequential`] does so once per block, on the
/// host, when it is built, and drops what the builder made). The builder's
/// weights are then [`stand_in`]s, and a builder may skip work whose result
/// only computing needs: a dequantizing `VarBuilder` hands out stand-ins
/// rather than dequantizing a model on the host.
pub fn discovering() -> bool {
    DISCOVERING.with(|d| d.get())
}

/// A tensor of `shape` and `dtype` on the host that costs no memory (one
/// zero, broadcast): what a builder gets for a weight while
/// [`discovering`].
pub fn stand_in(shape: &Shape, dtype: DType) -> Result<Tensor> {
    Tensor::zeros((), dtype, &Device::Cpu)?.broadcast_as(shape)
}

/// Runs `f` with [`discovering`] true on this thread (restored after, also
/// on error or panic).
fn while_discovering<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            DISCOVERING.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(DISCOVERING.with(|d| d.replace(true)));
    f()
}

fn has_alias(st: &RecState<'_>, name: &str) -> bool {
    st.masters.has_alias(name)
}

impl SimpleBackend for Recorder<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: DType,
        _dev: &Device,
    ) -> Result<Tensor> {
        self.fetch(name, Some(&s), dtype)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, _dev: &Device) -> Result<Tensor> {
        self.fetch(name, None, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.src.contains(name)
            || self
                .state
                .lock()
                .map(|st| st.masters.index_of(name).is_some() || st.masters.has_alias(name))
                .unwrap_or(false)
    }
}

/// Runs a block's builder once on the host to learn its weights, checks them
/// strictly, and lays them out for a slot.
fn discover(
    src: &WeightSource,
    masters: &mut HostMasters,
    block: &BlockSpec,
    cfg: &StreamConfig,
    all_names: &BTreeSet<String>,
) -> Result<BlockLayout> {
    let rec = Recorder {
        src,
        block,
        state: Mutex::new(RecState {
            masters,
            master_dtype: cfg.master_dtype(),
            requested: Vec::new(),
        }),
    };
    {
        let vb = VarBuilder::from_backend(Box::new(&rec), cfg.dtype, Device::Cpu).pp(&block.prefix);
        while_discovering(|| block.build(vb)).map_err(|e| {
            streamer_device::Error::prefixed(e, format_args!("building block {:?}", block.name))
        })?;
    }
    let st = rec
        .state
        .into_inner()
        .map_err(|_| candle_core::Error::Msg("recorder lock poisoned".into()))?;
    let prefix = format!("{}.", block.prefix);
    let used: BTreeSet<String> = st
        .requested
        .iter()
        .map(|(l, _, _)| format!("{prefix}{l}"))
        .collect();
    let unexpected: Vec<&String> = all_names
        .range(prefix.clone()..)
        .take_while(|n| n.starts_with(&prefix))
        .filter(|n| !used.contains(*n))
        .collect();
    if !unexpected.is_empty() {
        candle_core::bail!(
            "block {:?}: the weights hold tensors under {prefix:?} that the block does not use: {unexpected:?}",
            block.name
        );
    }
    let mut layout = BlockLayout::default();
    let mut seen = BTreeSet::new();
    for (local, idx, shape) in st.requested {
        if seen.insert(local.clone()) {
            let elems = st.masters.get(idx).slot_elems(cfg.dtype);
            layout.push(local, (idx, elems), shape, cfg.dtype);
        }
    }
    Ok(layout)
}

impl SimpleBackend for &Recorder<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        (**self).get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        (**self).get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        (**self).contains_tensor(name)
    }
}

/// A read-only view of a model's pool ([`StreamedSequential::lock_pool`]):
/// safe code may look at the window but not load, release or reset it.
pub struct PoolView<'a>(MutexGuard<'a, ResidencyPool>);

impl std::ops::Deref for PoolView<'_> {
    type Target = ResidencyPool;

    fn deref(&self) -> &ResidencyPool {
        &self.0
    }
}
