//! The residency pool: a bounded window of device slots that blocks' weights are
//! copied into from the host masters, in order, with copies overlapping compute.
//!
//! Protocol, per block: `load` (issue the copy into a free slot) → `acquire`
//! (compute waits for the copy, gets views of the weights) → run the block →
//! `release` (the slot may be refilled once this compute has finished). At most
//! `window` blocks are loaded and not yet released, so at most `window` blocks'
//! state is on the device, copies in flight included.
//!
//! On CUDA, copies run on a dedicated transfer stream; compute waits on each
//! block's ready event and the transfer stream waits on the slot's free event,
//! both on the device, so the host never blocks. The copies go through raw
//! device pointers, which cudarc's per-slice event tracking does not see, so
//! this ordering is complete on its own: the pool works the same whether the
//! context tracks events (the default, left alone) or the caller switched that
//! off ([`crate::disable_cuda_event_tracking`]). On the CPU the same protocol
//! runs with plain memory copies.
//!
//! Files: this one keeps the window, the slots and the public API; the
//! engines behind [`engine::Engine`] do the device's part (`cpu.rs`, and
//! `cuda.rs` with the `cuda` feature); `account.rs` adds up what they measured
//! into the statistics and the timeline; `layout.rs` places weights in slots.
//!
//! Soundness: the views and variables handed out between `acquire` and
//! `release` share memory with a slot that the next `load` overwrites (and that
//! the pool frees when it drops), so nothing safe outside this crate can get
//! them: `acquire` is crate-private, and [`ResidencyPool::acquire_vars`] (for the
//! training crate) and [`crate::run_blocks_with`] are `unsafe fn`s whose
//! contract is that nothing they hand out outlives the block's `release`.
//! Loading, releasing and the queries are safe: without a view outstanding, a
//! refill cannot be observed.
use crate::config::StreamConfig;
use crate::host::HostMasters;
use crate::stats::{Observer, StreamStats, TransitionKind};
use crate::timeline::Timeline;
use candle_core::{DType, Device, Result, Tensor, Var};
use engine::{Engine, Parts, Timing};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

mod account;
mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod engine;
mod layout;
#[cfg(feature = "cuda")]
mod write_back;

use account::add_timing;

pub use layout::{BlockLayout, Entry};

/// The pool's [`Parts`], as disjoint borrows of its fields, so that a call on
/// `self.engine` can take them.
macro_rules! parts {
    ($pool:expr) => {
        Parts {
            masters: &$pool.masters,
            layouts: &$pool.layouts,
            names: &$pool.names,
            dtype: $pool.dtype,
        }
    };
}

/// One slot of the window: its memory and the block it holds. What an engine
/// keeps per slot (events, staging) lives in the engine, indexed by slot.
struct Slot {
    flat: Tensor,
    block: Option<usize>,
}

/// The device copy of one master, for an optimizer stepping it on the GPU
/// ([`ResidencyPool::device_masters`]).
#[derive(Clone, Copy, Debug)]
pub struct DeviceMaster {
    /// The master's index.
    pub master: usize,
    /// Device address of its first element.
    pub address: u64,
    /// Its dtype (the master's).
    pub dtype: DType,
    /// Its element count.
    pub elems: usize,
}

/// The pool of device slots and the host masters they are filled from.
///
/// Views of a slot are not available to safe code: `acquire` is private and
/// `acquire_vars` is `unsafe`, so a view cannot outlive the slot's refill
/// without an `unsafe` block whose contract the caller broke.
///
/// ```compile_fail,E0133
/// # fn f(pool: &mut streamer_core::ResidencyPool) -> candle_core::Result<()> {
/// // error[E0133]: call to unsafe function requires an unsafe block
/// let (weights, vars) = pool.acquire_vars(0, &[true])?;
/// pool.release(0)?;
/// # Ok(()) }
/// ```
///
/// ```compile_fail,E0624
/// # fn f(pool: &mut streamer_core::ResidencyPool) -> candle_core::Result<()> {
/// // error[E0624]: method `acquire` is private
/// let views = pool.acquire(0)?;
/// # Ok(()) }
/// ```
///
/// Nor can a block's views leak through the runners or the gradient offload:
///
/// ```compile_fail,E0133
/// # use candle_core::Tensor;
/// # fn f(pool: &mut streamer_core::ResidencyPool, blocks: &[streamer_core::BlockSpec], x: &Tensor) {
/// let mut kept = Vec::new();
/// // error[E0133]: `run_blocks_with` is unsafe (its closure could keep `block`'s weights)
/// let _ = streamer_core::run_blocks_with(pool, blocks, x, &[], (false, false), |_, _, block, h, e| {
///     let out = block.forward(h, e)?;
///     kept.push(out[0].clone());
///     Ok(out)
/// });
/// # }
/// ```
///
/// ```compile_fail,E0133
/// # use candle_core::Tensor;
/// # fn f(off: &mut streamer_core::Offloader, g: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
/// // error[E0133]: `enqueue` is unsafe (`dst` is written by DMA until synchronised)
/// off.enqueue(g, dst)?;
/// let racy = dst.to_vec1::<f32>()?;
/// # Ok(()) }
/// ```
///
/// ```compile_fail,E0425
/// // error[E0425]: the safe runners `run_blocks`/`run_block` are crate-private
/// let _ = streamer_core::run_blocks;
/// ```
pub struct ResidencyPool {
    device: Device,
    dtype: DType,
    masters: Arc<HostMasters>,
    layouts: Vec<BlockLayout>,
    names: Vec<String>,
    slots: Vec<Slot>,
    free: VecDeque<usize>,
    slot_of: Vec<Option<usize>>,
    engine: Box<dyn Engine>,
    stats: StreamStats,
    observer: Option<Observer>,
    timeline: Option<Timeline>,
    /// A host instant and the timeline time (µs) it corresponds to, for host
    /// spans (`host_span`): the engine's clock, taken at creation and at
    /// `reset_stats` with the timeline on (on CUDA that waits for an event).
    host_ref: (Instant, f64),
    /// An error of [`Self::settle`], returned by the next `load`,
    /// `synchronize` or `stats`.
    deferred: Option<candle_core::Error>,
}

/// Unresolved timings a long run may keep before a load folds in the
/// finished ones (the old ones, in steady state).
const MAX_UNRESOLVED: usize = 1024;

impl ResidencyPool {
    /// Allocates `cfg.window()` slots (no more than there are blocks: a wider
    /// window would hold memory no block uses), each as large as the largest
    /// block (or `slot_budget_bytes`, which no block may exceed: checked here,
    /// before any copy).
    pub fn new(
        cfg: &StreamConfig,
        masters: Arc<HostMasters>,
        layouts: Vec<BlockLayout>,
        names: Vec<String>,
    ) -> Result<Self> {
        cfg.validate()?;
        let narrowed;
        let cfg = match cfg.window() > layouts.len().max(1) {
            true => {
                narrowed = StreamConfig {
                    prefetch_ahead: layouts.len().max(1) - 1,
                    ..cfg.clone()
                };
                &narrowed
            }
            false => cfg,
        };
        let dtype = cfg.dtype;
        let largest = layouts.iter().map(|l| l.elems).max().unwrap_or(0);
        if let Some(budget) = cfg.slot_budget_bytes {
            for (l, name) in layouts.iter().zip(&names) {
                if l.bytes(dtype) > budget {
                    candle_core::bail!(
                        "block {name:?} needs {} bytes ({:.1} MiB) of {dtype:?} weights, over slot_budget_bytes = {budget} ({:.1} MiB)",
                        l.bytes(dtype),
                        l.bytes(dtype) as f64 / 1048576.0,
                        budget as f64 / 1048576.0
                    );
                }
            }
        }
        if names.len() != layouts.len() {
            candle_core::bail!("{} block names for {} layouts", names.len(), layouts.len());
        }
        for (l, name) in layouts.iter().zip(&names) {
            l.check(&masters, dtype, name)?;
        }
        let slot_elems = largest.max(1);
        let window = cfg.window();
        let (engine, flats): (Box<dyn Engine>, _) = match &cfg.device {
            Device::Cpu => {
                let (e, flats) = cpu::CpuEngine::new(cfg, slot_elems)?;
                (Box::new(e), flats)
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                let (e, flats) = cuda::CudaEngine::new(dev, &masters, &layouts, cfg, slot_elems)?;
                (Box::new(e), flats)
            }
            d => candle_core::bail!("streaming to {:?} is not supported", d.location()),
        };
        let slots = flats
            .into_iter()
            .map(|flat| Slot { flat, block: None })
            .collect();
        let stats = StreamStats {
            slot_bytes: window * slot_elems * dtype.size_in_bytes(),
            ..Default::default()
        };
        let mut pool = Self {
            device: cfg.device.clone(),
            dtype,
            masters,
            slot_of: vec![None; layouts.len()],
            layouts,
            names,
            slots,
            free: (0..window).collect(),
            engine,
            stats,
            observer: None,
            timeline: cfg.timeline.then(Timeline::default),
            host_ref: (Instant::now(), 0.0),
            deferred: None,
        };
        pool.calibrate_host_clock()?;
        Ok(pool)
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.layouts.len()
    }

    /// Whether there are no blocks.
    pub fn is_empty(&self) -> bool {
        self.layouts.is_empty()
    }

    /// Slots in the window.
    pub fn window(&self) -> usize {
        self.slots.len()
    }

    /// The device blocks compute on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The host masters.
    pub fn masters(&self) -> &Arc<HostMasters> {
        &self.masters
    }

    /// A block's slot layout.
    pub fn layout(&self, block: usize) -> &BlockLayout {
        &self.layouts[block]
    }

    /// Whether `block` is loaded (its copy issued and not yet released).
    pub fn is_loaded(&self, block: usize) -> bool {
        self.slot_of.get(block).is_some_and(|s| s.is_some())
    }

    /// Issues the copy of `block`'s weights into a free slot.
    pub fn load(&mut self, block: usize) -> Result<()> {
        self.take_deferred()?;
        self.check_loadable(block)?;
        if let Some(slot) = self.engine.lend(block, &mut self.free, parts!(self)) {
            self.stats.reused_loads += 1;
            self.occupy(block, slot);
            return Ok(());
        }
        let slot = self.free_slot_for(block)?;
        let target = (block, slot, &self.slots[slot].flat);
        let (bytes, timing) = self.engine.copy_in(target, parts!(self), &mut self.stats)?;
        if let Some(t) = timing {
            add_timing(&mut self.stats, self.timeline.as_mut(), &self.names, t);
        }
        // Keep the queue of timings bounded on long runs.
        if self.engine.unresolved() > MAX_UNRESOLVED {
            self.resolve_timings(false)?;
        }
        self.stats.loads += 1;
        self.stats.h2d_bytes += bytes;
        self.occupy(block, slot);
        Ok(())
    }

    /// Fails unless `block` exists and is not loaded, and lets an injected
    /// weight-load fault (`crate::faults`) fail the load before anything moves.
    fn check_loadable(&self, block: usize) -> Result<()> {
        if block >= self.layouts.len() {
            candle_core::bail!(
                "block index {block} out of range ({} blocks)",
                self.layouts.len()
            );
        }
        if self.slot_of[block].is_some() {
            candle_core::bail!("block {:?} is already loaded", self.names[block]);
        }
        crate::faults::check(crate::faults::FaultPoint::WeightLoad, || {
            format!("loading block {:?}", self.names[block])
        })
    }

    /// Takes a free slot for `block`; with none, the error names the loaded
    /// blocks so the caller sees which one it forgot to release.
    fn free_slot_for(&mut self, block: usize) -> Result<usize> {
        let Some(slot) = self.take_free_slot() else {
            let loaded: Vec<&str> = (0..self.layouts.len())
                .filter(|&b| self.slot_of[b].is_some())
                .map(|b| self.names[b].as_str())
                .collect();
            candle_core::bail!(
                "cannot load block {:?}: all {} slots hold blocks {loaded:?}; release one first",
                self.names[block],
                self.slots.len()
            );
        };
        Ok(slot)
    }

    /// Records `block` as loaded in `slot`.
    fn occupy(&mut self, block: usize, slot: usize) {
        let layout = &self.layouts[block];
        self.slots[slot].block = Some(block);
        self.slot_of[block] = Some(slot);
        self.stats.resident_blocks += 1;
        self.stats.resident_bytes += layout.bytes(self.dtype);
        self.stats.peak_resident_blocks = self
            .stats
            .peak_resident_blocks
            .max(self.stats.resident_blocks);
        self.stats.peak_resident_bytes = self
            .stats
            .peak_resident_bytes
            .max(self.stats.resident_bytes);
        self.transition(block, slot, TransitionKind::LoadIssued);
    }

    /// A free slot, one that holds no stepped copy when there is one.
    fn take_free_slot(&mut self) -> Option<usize> {
        let engine = &self.engine;
        match self
            .free
            .iter()
            .position(|&s| !engine.holds_stepped_copy(s))
        {
            Some(pos) => self.free.remove(pos),
            None => self.free.pop_front(),
        }
    }

    /// Lets the next load lend a stepped slot (`crate::run_blocks_with`, which
    /// asks for [`Self::lent_blocks_stale`] before it returns), or not.
    pub(crate) fn open_reuse(&mut self, open: bool) {
        self.engine.open_reuse(open);
    }

    /// Whether any block lent since the last call differed from its host
    /// masters (waits for the comparisons). When one did, no slot keeps a
    /// stepped copy any more, so a second run copies every block.
    pub(crate) fn lent_blocks_stale(&mut self) -> Result<bool> {
        self.engine.lent_stale(parts!(self), &mut self.stats)
    }

    /// Forgets the comparisons of a call that failed (its results are gone) and
    /// every stepped copy.
    pub(crate) fn drop_lent(&mut self) {
        self.engine.drop_lent();
    }

    /// Orders compute after `block`'s copy and returns its weights as device
    /// tensors keyed by their names relative to the block's prefix. The tensors
    /// are views into the slot: nothing may keep them past `release` (the next
    /// `load` overwrites the slot), which is why this is crate-private.
    pub(crate) fn acquire(&mut self, block: usize) -> Result<HashMap<String, Tensor>> {
        let Some(slot) = self.slot_of.get(block).copied().flatten() else {
            candle_core::bail!("block {block} was not loaded before use");
        };
        self.engine.begin_compute(slot).map_err(|err| {
            err.context(format!(
                "converting block {:?}'s weights",
                self.names[block]
            ))
        })?;
        let flat = &self.slots[slot].flat;
        let mut views = HashMap::with_capacity(self.layouts[block].entries.len());
        for e in &self.layouts[block].entries {
            let v = if self.masters.get(e.master).is_packed() {
                let p = parts!(self);
                self.engine.packed_view((block, slot, flat), e, p)?
            } else {
                flat.narrow(0, e.offset, e.shape.elem_count())?
                    .reshape(e.shape.clone())?
            };
            views.insert(e.local.clone(), v);
        }
        self.transition(block, slot, TransitionKind::ComputeStart);
        Ok(views)
    }

    /// Like [`Self::acquire`], for training: each distinct weight whose `trainable`
    /// flag (indexed by master) is set comes back as an autograd variable, so a
    /// recompute under Candle autograd yields its gradient; frozen weights come
    /// back as plain tensors. Returns the tensors by local name and the
    /// `(master, variable)` pairs. On CUDA the variables alias the slot's memory
    /// (no copy); on the CPU they are copies of the slot.
    ///
    /// # Safety
    /// The returned tensors and variables, and every tensor sharing memory with
    /// them (views, reshapes, a block built from them, anything a block keeps),
    /// must not be used by work issued after `release(block)`, and must all be
    /// dropped before the pool is: on CUDA the variables alias slot memory that
    /// the next `load` overwrites and that the pool frees when it drops, so a
    /// later use is a stale read or a use after free. Gradients computed from
    /// them before `release` are fresh tensors and may be kept (check with
    /// [`Self::aliases_slot`] when a block's code is not trusted to return fresh
    /// tensors).
    #[doc(hidden)]
    #[allow(clippy::type_complexity)]
    pub unsafe fn acquire_vars(
        &mut self,
        block: usize,
        trainable: &[bool],
    ) -> Result<(HashMap<String, Tensor>, Vec<(usize, Var)>)> {
        let views = self.acquire(block)?;
        let slot = self.slot_of[block].expect("acquired above");
        let mut vars = self.engine.alias_vars(block, slot, parts!(self))?;
        let layout = &self.layouts[block];
        let trainable_m = |m: usize| trainable.get(m).copied().unwrap_or(false);
        if vars.is_empty() {
            // No aliases (CPU): the variables are copies of the slot's views
            // (trainable only).
            for &(m, _) in layout.unique.iter().filter(|(m, _)| trainable_m(*m)) {
                let e = layout
                    .entries
                    .iter()
                    .find(|e| e.master == m)
                    .expect("unique entries exist");
                vars.push((m, Var::from_tensor(&views[&e.local])?));
            }
        }
        let mut out = HashMap::with_capacity(views.len());
        for e in &layout.entries {
            let t = if trainable_m(e.master) {
                vars.iter()
                    .find(|(m, _)| *m == e.master)
                    .expect("every master has a var")
                    .1
                    .as_tensor()
                    .clone()
            } else {
                views[&e.local].clone()
            };
            out.insert(e.local.clone(), t);
        }
        vars.retain(|(m, _)| trainable_m(*m));
        Ok((out, vars))
    }

    /// Marks `block`'s compute as issued: its slot is refilled only after that
    /// compute has finished (ordered on the device on CUDA).
    pub fn release(&mut self, block: usize) -> Result<()> {
        let Some(slot) = self.slot_of.get(block).copied().flatten() else {
            candle_core::bail!("block {block} released without being loaded");
        };
        if let Some(t) = self.engine.end_compute(block, slot, parts!(self))? {
            add_timing(&mut self.stats, self.timeline.as_mut(), &self.names, t);
        }
        self.slots[slot].block = None;
        self.slot_of[block] = None;
        self.free.push_back(slot);
        self.stats.resident_blocks -= 1;
        self.stats.resident_bytes -= self.layouts[block].bytes(self.dtype);
        self.transition(block, slot, TransitionKind::Evicted);
        Ok(())
    }

    /// After a panic unwound through a call that held the pool (its bookkeeping
    /// may be half-updated): waits for all work the pool issued, then empties
    /// the window (every slot free, no block loaded), so the next call starts
    /// as on a new pool. Nothing bound to a slot survives the unwinding.
    pub(crate) fn reset_window(&mut self) -> Result<()> {
        self.synchronize()?;
        self.slots.iter_mut().for_each(|s| s.block = None);
        // The streams are idle (synchronised above): no event to wait on.
        self.engine.reset();
        self.drop_lent();
        self.free = (0..self.slots.len()).collect();
        self.slot_of.iter_mut().for_each(|s| *s = None);
        self.stats.resident_blocks = 0;
        self.stats.resident_bytes = 0;
        Ok(())
    }

    /// Whether `t` shares storage with a slot or with a variable aliasing one (and
    /// so would be overwritten when the slot is refilled).
    pub fn aliases_slot(&self, t: &Tensor) -> bool {
        let key = storage_key(t);
        self.slots.iter().any(|s| storage_key(&s.flat) == key) || self.engine.aliases(key)
    }

    /// Where the device copy of each master in `which` of the acquired
    /// `block` lives, in the master's own dtype: the staging buffer its load
    /// filled (masters in another dtype than the compute dtype) or the slot
    /// itself. An optimizer may step these in place on the compute stream
    /// between `acquire` and `release`, then [`Self::write_back_masters`].
    /// The CPU pool keeps no such copies (its masters are the host tensors).
    pub fn device_masters(&self, block: usize, which: &[usize]) -> Result<Vec<DeviceMaster>> {
        let Some(slot) = self.slot_of.get(block).copied().flatten() else {
            candle_core::bail!("block {block} is not loaded: its masters have no device copy");
        };
        self.engine
            .device_masters((block, slot), which, parts!(self))
    }

    /// Copies the device copies of `which` (see [`Self::device_masters`]) back
    /// into their host masters, on the transfer stream after everything the
    /// compute stream has been given so far (an optimizer step on them), and
    /// before the slot's next load overwrites them. Complete when
    /// [`Self::synchronize`] returns.
    ///
    /// # Safety
    /// The copies write the host masters' memory by DMA: nothing may read or
    /// write those masters (their `Var`s, clones, views) until
    /// [`Self::synchronize`] has returned.
    #[doc(hidden)]
    pub unsafe fn write_back_masters(&mut self, block: usize, which: &[usize]) -> Result<()> {
        let targets = self.device_masters(block, which)?;
        let slot = self.slot_of[block].expect("device_masters checked it is loaded");
        // SAFETY: nothing touches the masters until `synchronize` (this fn's contract).
        unsafe { (self.engine).write_back(slot, &targets, parts!(self), &mut self.stats) }
    }

    /// Waits for every copy and compute the pool issued (and completes the
    /// host side of [`Self::write_back_masters`]).
    pub fn synchronize(&mut self) -> Result<()> {
        self.take_deferred()?;
        self.engine.synchronize()
    }

    /// Waits for every copy and compute, on a path that already has an error
    /// to return (cleaning up after a failed step): an error of its own is
    /// kept and returned by this pool's next `load`, `synchronize` or `stats`.
    pub fn settle(&mut self) {
        if let Err(e) = self.synchronize() {
            self.deferred.get_or_insert(e);
        }
    }

    /// The error [`Self::settle`] kept, if any (taken).
    fn take_deferred(&mut self) -> Result<()> {
        self.deferred.take().map_or(Ok(()), Err)
    }
}

impl Drop for ResidencyPool {
    fn drop(&mut self) {
        // Copies in flight read host masters and write slots: let them finish
        // before either can be freed. No caller is left to take an error: on
        // CUDA it is recorded on the context (cudarc's `record_err`), whose
        // next checked call returns it; on the CPU `synchronize` cannot fail.
        if let Err(err) = self.synchronize() {
            self.engine.record_dropped(&err);
        }
    }
}

/// A key equal for tensors that share storage.
pub(crate) fn storage_key(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const candle_core::Storage as usize
}
