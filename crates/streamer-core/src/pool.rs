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
use crate::stats::{Observer, StreamStats, Transition, TransitionKind};
use crate::timeline::{Timeline, TraceKind};
use candle_core::{DType, Device, Result, Shape, Tensor};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Offsets inside a slot are aligned to this many bytes (vector loads, tensor cores).
const ALIGN_BYTES: usize = 256;

/// One weight of a block, as laid out in a slot.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Name relative to the block's prefix (what the block's `VarBuilder` asks for).
    pub local: String,
    /// Index of the host master.
    pub master: usize,
    /// Offset in the slot, in elements of the compute dtype.
    pub offset: usize,
    /// Shape of the weight.
    pub shape: Shape,
}

/// Where each of a block's weights sits in a slot. Tied weights within a block
/// share one entry offset and are copied once.
#[derive(Debug, Clone, Default)]
pub struct BlockLayout {
    /// Every name the block uses.
    pub entries: Vec<Entry>,
    /// Distinct masters and their slot offsets: what one load copies.
    pub unique: Vec<(usize, usize)>,
    /// Elements of the slot this block occupies (compute dtype, with alignment).
    pub elems: usize,
}

impl BlockLayout {
    pub(crate) fn push(&mut self, local: String, master: usize, shape: Shape, dtype: DType) {
        let offset = match self.unique.iter().find(|(m, _)| *m == master) {
            Some(&(_, off)) => off,
            None => {
                let align = (ALIGN_BYTES / dtype.size_in_bytes()).max(1);
                let off = self.elems.div_ceil(align) * align;
                self.unique.push((master, off));
                self.elems = off + shape.elem_count();
                off
            }
        };
        self.entries.push(Entry {
            local,
            master,
            offset,
            shape,
        });
    }

    /// Bytes of device memory the block's weights occupy.
    pub fn bytes(&self, dtype: DType) -> usize {
        self.elems * dtype.size_in_bytes()
    }
}

struct Slot {
    flat: Tensor,
    block: Option<usize>,
    #[cfg(feature = "cuda")]
    ptr: u64,
    #[cfg(feature = "cuda")]
    free: Option<Arc<cudarc::driver::CudaEvent>>,
    #[cfg(feature = "cuda")]
    ready: Option<Arc<cudarc::driver::CudaEvent>>,
    #[cfg(feature = "cuda")]
    compute: Option<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    cpu_compute_start: Option<Instant>,
    /// Autograd variables aliasing this slot's memory, per block (CUDA only; see
    /// `acquire_vars`). Never dropped normally: they do not own their memory.
    #[cfg(feature = "cuda")]
    alias_vars: HashMap<usize, Vec<(usize, candle_core::Var)>>,
    /// This slot's staging buffer for masters in another dtype than the
    /// compute dtype (device pointer), and the conversions left for `acquire`
    /// (`(from, src, to, dst, elements)`): those of a block lent after a
    /// device step, whose staged masters the step changed on the compute
    /// stream (a load converts on the transfer stream itself).
    #[cfg(feature = "cuda")]
    stage: Option<u64>,
    #[cfg(feature = "cuda")]
    casts: Vec<(DType, u64, DType, u64, usize)>,
    /// Where the last load staged each master in its own dtype: `(master,
    /// address)` (empty when masters are copied into the slot directly).
    #[cfg(feature = "cuda")]
    staged: Vec<(usize, u64)>,
    /// Masters of the acquired block written back after a device step.
    #[cfg(feature = "cuda")]
    written_back: Vec<usize>,
    /// A free slot that still holds this block's device-stepped masters, every
    /// one written back (see `crate::reuse`).
    #[cfg(feature = "cuda")]
    stepped_copy_of: Option<usize>,
}

#[cfg(feature = "cuda")]
struct CudaEngine {
    dev: candle_core::CudaDevice,
    compute: Arc<cudarc::driver::CudaStream>,
    transfer: Arc<cudarc::driver::CudaStream>,
    /// Per slot, staging for a whole block's masters when their dtype differs
    /// from the compute dtype: the transfer stream only copies into it, and the
    /// compute stream converts into the slot when the block is acquired. (A
    /// conversion on the transfer stream waits for SMs behind the compute
    /// stream's GEMMs and, in stream order, holds up the next copy: f32 masters
    /// streamed at 25 GB/s that way instead of 55.)
    staging: Vec<(cudarc::driver::CudaSlice<u8>, u64)>,
    epoch: cudarc::driver::CudaEvent,
    pending: Vec<PendingTiming>,
    /// Write-backs of device-stepped masters (`write_back_masters`): a master's
    /// partial pages at either end are not page-locked, and a copy into
    /// pageable memory would block the host until the GPU reaches it, so they
    /// land in page-locked bounce buffers (per master, from `bounce`) and are
    /// copied into place by `synchronize`.
    bounce: crate::Offloader,
    bounce_bufs: HashMap<usize, Tensor>,
    bounce_pending: Vec<(usize, usize, usize)>,
    /// Checks blocks lent to the next forward as they are (`crate::reuse`).
    verifier: crate::reuse::Verifier,
}

#[cfg(feature = "cuda")]
enum PendingTiming {
    Load {
        block: usize,
        start: cudarc::driver::CudaEvent,
        end: Arc<cudarc::driver::CudaEvent>,
    },
    Compute {
        block: usize,
        wait: cudarc::driver::CudaEvent,
        start: cudarc::driver::CudaEvent,
        end: Arc<cudarc::driver::CudaEvent>,
    },
}

enum Engine {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaEngine>),
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
    engine: Engine,
    stats: StreamStats,
    observer: Option<Observer>,
    timeline: Option<Timeline>,
    cpu_epoch: Instant,
    /// A host instant and the timeline time (µs) it corresponds to, for host
    /// spans (`host_span`): on CUDA, taken when an event on the compute stream
    /// completes (at creation and at `reset_stats`, with the timeline on).
    host_ref: (Instant, f64),
    transfer_delay: Option<std::time::Duration>,
    /// `StreamConfig::reuse_stepped_blocks`.
    #[cfg(feature = "cuda")]
    reuse_enabled: bool,
    /// The next load may lend a stepped slot as it is (only the first load of
    /// a runner that asks for the verdict before returning: `crate::run_blocks_with`).
    #[cfg(feature = "cuda")]
    reuse_open: bool,
    /// An error of [`Self::settle`], returned by the next `load`,
    /// `synchronize` or `stats`.
    deferred: Option<candle_core::Error>,
}

impl ResidencyPool {
    /// Allocates `cfg.window()` slots, each as large as the largest block (or
    /// `slot_budget_bytes`, which no block may exceed: checked here, before any copy).
    pub fn new(
        cfg: &StreamConfig,
        masters: Arc<HostMasters>,
        layouts: Vec<BlockLayout>,
        names: Vec<String>,
    ) -> Result<Self> {
        cfg.validate()?;
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
        let slot_elems = largest.max(1);
        let window = cfg.window();
        let engine = match &cfg.device {
            Device::Cpu => Engine::Cpu,
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                Engine::Cuda(Box::new(CudaEngine::new(dev, &masters, &layouts, cfg)?))
            }
            d => candle_core::bail!("streaming to {:?} is not supported", d.location()),
        };
        let mut slots = Vec::with_capacity(window);
        for _k in 0..window {
            #[allow(unused_mut)]
            let mut slot = Slot::new(&cfg.device, dtype, slot_elems)?;
            #[cfg(feature = "cuda")]
            if let Engine::Cuda(e) = &engine {
                slot.stage = e.staging.get(_k).map(|s| s.1);
            }
            slots.push(slot);
        }
        // Slots are stream-ordered allocations (and zero fills) on the compute
        // stream: the transfer stream must not touch them before those happen.
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &engine {
            e.transfer
                .join(&e.compute)
                .map_err(candle_core::Error::wrap)?;
        }
        let stats = StreamStats {
            slot_bytes: window * slot_elems * dtype.size_in_bytes(),
            ..Default::default()
        };
        let cpu_epoch = Instant::now();
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
            cpu_epoch,
            host_ref: (cpu_epoch, 0.0),
            transfer_delay: cfg.transfer_delay,
            #[cfg(feature = "cuda")]
            reuse_enabled: cfg.reuse_stepped_blocks,
            #[cfg(feature = "cuda")]
            reuse_open: false,
            deferred: None,
        };
        pool.calibrate_host_clock()?;
        Ok(pool)
    }

    /// With the timeline on (CUDA): maps the host clock onto the timeline's,
    /// which counts from an event on the compute stream. Waits for the
    /// compute stream.
    fn calibrate_host_clock(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let (Engine::Cuda(e), Some(_)) = (&self.engine, &self.timeline) {
            let w = candle_core::Error::wrap;
            let now = CudaEngine::event(&e.compute)?;
            now.synchronize().map_err(w)?;
            let host = Instant::now();
            let us = e.epoch.elapsed_ms(&now).map_err(w)? as f64 * 1e3;
            self.host_ref = (host, us);
        }
        Ok(())
    }

    /// Whether a timeline is being recorded (host spans cost nothing when not:
    /// callers take their instants only when this is true).
    pub fn timeline_on(&self) -> bool {
        self.timeline.is_some()
    }

    /// Now, when a timeline is recorded: the start of a host span for
    /// [`Self::span_end`]. `None` otherwise, so that nothing is measured.
    pub fn span_start(&self) -> Option<Instant> {
        self.timeline.is_some().then(Instant::now)
    }

    /// Records the host span from `start` ([`Self::span_start`]) to now,
    /// naming it by `name` (called only then); nothing for `None`.
    pub fn span_end(&mut self, start: Option<Instant>, name: impl FnOnce() -> String) {
        if let Some(t0) = start {
            self.host_span(&name(), t0, Instant::now());
        }
    }

    /// Records a span of host time (`start..end`, on the calling thread) on
    /// the timeline's host lane, on the same time axis as the copies and
    /// compute (within tens of microseconds on CUDA). Does nothing when the
    /// timeline is off.
    pub fn host_span(&mut self, name: &str, start: Instant, end: Instant) {
        let Some(tl) = &mut self.timeline else {
            return;
        };
        let (at, us) = self.host_ref;
        let rel = |t: Instant| match t.checked_duration_since(at) {
            Some(d) => us + d.as_secs_f64() * 1e6,
            None => us - at.duration_since(t).as_secs_f64() * 1e6,
        };
        let ts = rel(start);
        tl.push(TraceKind::Host, name, ts, (rel(end) - ts).max(0.0));
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

    /// Sets the function called on every residency transition.
    pub fn set_observer(&mut self, observer: Option<Observer>) {
        self.observer = observer;
    }

    fn transition(&mut self, block: usize, slot: usize, kind: TransitionKind) {
        let t = Transition {
            block,
            slot,
            kind,
            resident_blocks: self.stats.resident_blocks,
            resident_bytes: self.stats.resident_bytes,
        };
        self.stats.push(t);
        if let Some(o) = &self.observer {
            o(&t);
        }
    }

    /// Issues the copy of `block`'s weights into a free slot.
    pub fn load(&mut self, block: usize) -> Result<()> {
        self.take_deferred()?;
        self.check_loadable(block)?;
        #[cfg(feature = "cuda")]
        {
            let lend = self.reusable_slot(block);
            // Only a runner's first load may lend: that block's copy is the one
            // nothing hides, while lending a later one would only add its
            // check's copy to the call's.
            self.reuse_open = false;
            if let Some(pos) = lend {
                return self.lend_stepped(block, pos);
            }
        }
        let slot = self.free_slot_for(block)?;
        let bytes = match self.engine {
            Engine::Cpu => self.copy_on_cpu(block, slot)?,
            #[cfg(feature = "cuda")]
            Engine::Cuda(_) => self.copy_on_cuda(block, slot)?,
        };
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

    /// Copies `block`'s masters into `slot` on the CPU engine (synchronously,
    /// so the copy's time is measured here) and returns the bytes read.
    fn copy_on_cpu(&mut self, block: usize, slot: usize) -> Result<u64> {
        let layout = &self.layouts[block];
        let mut bytes = 0u64;
        let t0 = Instant::now();
        let flat = &self.slots[slot].flat;
        for &(m, off) in &layout.unique {
            let master = self.masters.get(m).var.as_tensor();
            bytes += (master.elem_count() * master.dtype().size_in_bytes()) as u64;
            let src = master.flatten_all()?.to_dtype(self.dtype)?;
            flat.slice_set(&src, 0, off)?;
        }
        if let Some(d) = self.transfer_delay {
            std::thread::sleep(d);
        }
        let ts = (t0 - self.cpu_epoch).as_secs_f64() * 1e6;
        let timeline = self.timeline.as_mut();
        account_transfer(
            &mut self.stats,
            timeline,
            &self.names[block],
            ts,
            t0.elapsed(),
        );
        Ok(bytes)
    }

    /// Queues the copy of `block`'s masters into `slot` on the CUDA engine's
    /// transfer stream, between the lent-copy comparisons it must order with,
    /// and returns the bytes copied.
    #[cfg(feature = "cuda")]
    fn copy_on_cuda(&mut self, block: usize, slot: usize) -> Result<u64> {
        let Engine::Cuda(e) = &mut self.engine else {
            unreachable!("copy_on_cuda is called for the CUDA engine only")
        };
        let layout = &self.layouts[block];
        let s = &mut self.slots[slot];
        s.stepped_copy_of = None;
        s.written_back.clear();
        // A comparison of this slot's lent copy goes first (the copy waits).
        self.stats.verify_bytes +=
            e.verifier
                .issue(&e.dev, &e.transfer, &self.masters, Some(slot))?;
        e.verifier.before_refill(slot, &e.transfer)?;
        let bytes = e
            .load(
                block,
                layout,
                &self.masters,
                s,
                self.dtype,
                self.transfer_delay,
            )
            .map_err(|err| {
                err.context(format!("copying block {:?}'s weights", self.names[block]))
            })?;
        // Comparisons' host copies queue behind this copy, which the
        // next compute may be waiting for (kernels: `crate::reuse`).
        self.stats.verify_bytes += e.verifier.issue(&e.dev, &e.transfer, &self.masters, None)?;
        // Keep the queue of timing events bounded on long runs: fold in the
        // ones that have completed (the old ones, in steady state).
        if e.pending_len() > 1024 {
            e.resolve(false, &mut self.stats, self.timeline.as_mut(), &self.names)?;
        }
        Ok(bytes)
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
        #[cfg(feature = "cuda")]
        if let Some(pos) = self
            .free
            .iter()
            .position(|&s| self.slots[s].stepped_copy_of.is_none())
        {
            return self.free.remove(pos);
        }
        self.free.pop_front()
    }

    /// Where in the free list a slot holding `block`'s stepped masters is, if
    /// a runner that checks lent blocks is loading.
    #[cfg(feature = "cuda")]
    fn reusable_slot(&self, block: usize) -> Option<usize> {
        if !(self.reuse_enabled && self.reuse_open) {
            return None;
        }
        self.free
            .iter()
            .position(|&s| self.slots[s].stepped_copy_of == Some(block))
    }

    /// Lends the free slot at `pos` of the free list, which holds `block`'s
    /// stepped and written-back masters, without copying, and queues the
    /// comparison of those copies with the host masters (`crate::reuse`).
    #[cfg(feature = "cuda")]
    fn lend_stepped(&mut self, block: usize, pos: usize) -> Result<()> {
        let slot = self.free.remove(pos).expect("a position in the free list");
        let copies: crate::reuse::Copies = self.layouts[block]
            .unique
            .iter()
            .map(|&(m, _)| {
                let addr = self
                    .copy_address(slot, block, m)
                    .expect("a master of the block");
                (m, addr, self.masters.get(m).bytes())
            })
            .collect();
        let es = self.dtype.size_in_bytes() as u64;
        let dtype = self.dtype;
        let s = &mut self.slots[slot];
        s.stepped_copy_of = None;
        s.written_back.clear();
        s.ready = None;
        // With staging, the step changed the staged masters, not the slot's
        // compute-dtype weights: acquire converts them again.
        s.casts.clear();
        for &(m, off) in &self.layouts[block].unique {
            if let Some(&(_, at)) = s.staged.iter().find(|(k, _)| *k == m) {
                let master = self.masters.get(m);
                let dst = s.ptr + off as u64 * es;
                s.casts
                    .push((master.var.dtype(), at, dtype, dst, master.var.elem_count()));
            }
        }
        if let Engine::Cuda(e) = &mut self.engine {
            e.verifier.pending.push((slot, copies));
        }
        self.stats.reused_loads += 1;
        self.occupy(block, slot);
        Ok(())
    }

    /// Where the device copy of master `m` of the block in `slot` is, in the
    /// master's dtype: its staging piece, or its place in the slot.
    #[cfg(feature = "cuda")]
    fn copy_address(&self, slot: usize, block: usize, m: usize) -> Option<u64> {
        let s = &self.slots[slot];
        match s.stage {
            Some(_) => s.staged.iter().find(|(k, _)| *k == m).map(|x| x.1),
            None => self.layouts[block]
                .unique
                .iter()
                .find(|(k, _)| *k == m)
                .map(|&(_, off)| s.ptr + (off * self.dtype.size_in_bytes()) as u64),
        }
    }

    /// Lets the next load lend a stepped slot (`crate::run_blocks_with`, which
    /// asks for [`Self::lent_blocks_stale`] before it returns), or not.
    pub(crate) fn open_reuse(&mut self, open: bool) {
        #[cfg(feature = "cuda")]
        {
            self.reuse_open = open;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = open;
    }

    /// Whether any block lent since the last call differed from its host
    /// masters (waits for the comparisons). When one did, no slot keeps a
    /// stepped copy any more, so a second run copies every block.
    pub(crate) fn lent_blocks_stale(&mut self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &mut self.engine {
            self.stats.verify_bytes +=
                e.verifier.issue(&e.dev, &e.transfer, &self.masters, None)?;
            if e.verifier.verdict()? {
                self.stats.stale_reuses += 1;
                self.slots.iter_mut().for_each(|s| s.stepped_copy_of = None);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Forgets the comparisons of a call that failed (its results are gone) and
    /// every stepped copy.
    pub(crate) fn drop_lent(&mut self) {
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &mut self.engine {
            e.verifier.pending.clear();
            self.slots.iter_mut().for_each(|s| s.stepped_copy_of = None);
        }
    }

    /// Orders compute after `block`'s copy and returns its weights as device
    /// tensors keyed by their names relative to the block's prefix. The tensors
    /// are views into the slot: nothing may keep them past `release` (the next
    /// `load` overwrites the slot), which is why this is crate-private.
    pub(crate) fn acquire(&mut self, block: usize) -> Result<HashMap<String, Tensor>> {
        let Some(slot) = self.slot_of.get(block).copied().flatten() else {
            candle_core::bail!("block {block} was not loaded before use");
        };
        match &mut self.engine {
            Engine::Cpu => self.slots[slot].cpu_compute_start = Some(Instant::now()),
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => e.acquire(&mut self.slots[slot]).map_err(|err| {
                err.context(format!(
                    "converting block {:?}'s weights",
                    self.names[block]
                ))
            })?,
        }
        let flat = &self.slots[slot].flat;
        let mut views = HashMap::with_capacity(self.layouts[block].entries.len());
        for e in &self.layouts[block].entries {
            let v = flat
                .narrow(0, e.offset, e.shape.elem_count())?
                .reshape(e.shape.clone())?;
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
    ) -> Result<(HashMap<String, Tensor>, Vec<(usize, candle_core::Var)>)> {
        let views = self.acquire(block)?;
        let layout = &self.layouts[block];
        let trainable_m = |m: usize| trainable.get(m).copied().unwrap_or(false);
        let mut vars: Vec<(usize, candle_core::Var)> = Vec::new();
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &self.engine {
            let slot = self.slot_of[block].expect("acquired above");
            let s = &mut self.slots[slot];
            if !s.alias_vars.contains_key(&block) {
                let mut made = Vec::new();
                for &(m, off) in &layout.unique {
                    let shape = self.masters.get(m).shape().clone();
                    let ptr = s.ptr + (off * self.dtype.size_in_bytes()) as u64;
                    // SAFETY: [ptr, ptr + shape bytes) lies inside the slot, which
                    // outlives the variable (forgotten in Drop, never freed by it).
                    let v = unsafe { crate::cuda::alias_var(&e.dev, ptr, self.dtype, &shape)? };
                    made.push((m, v));
                }
                s.alias_vars.insert(block, made);
            }
            vars = s.alias_vars[&block].clone();
        }
        if vars.is_empty() {
            // CPU: the variables are copies of the slot's views (trainable only).
            for &(m, _) in layout.unique.iter().filter(|(m, _)| trainable_m(*m)) {
                let e = layout
                    .entries
                    .iter()
                    .find(|e| e.master == m)
                    .expect("unique entries exist");
                vars.push((m, candle_core::Var::from_tensor(&views[&e.local])?));
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
        match &mut self.engine {
            Engine::Cpu => {
                if let Some(t0) = self.slots[slot].cpu_compute_start.take() {
                    let ts = (t0 - self.cpu_epoch).as_secs_f64() * 1e6;
                    let (tl, name) = (self.timeline.as_mut(), &self.names[block]);
                    let span = (ts, Duration::ZERO, t0.elapsed());
                    account_compute(&mut self.stats, tl, name, span);
                }
            }
            #[cfg(feature = "cuda")]
            Engine::Cuda(e) => {
                let s = &mut self.slots[slot];
                e.release(block, s)?;
                // Every master stepped and written back: the slot equals the
                // host masters once that copy lands, and may be lent.
                let all = !s.written_back.is_empty()
                    && (self.layouts[block].unique.iter()).all(|(m, _)| s.written_back.contains(m));
                s.stepped_copy_of = all.then_some(block);
                s.written_back.clear();
            }
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
        for s in &mut self.slots {
            s.block = None;
            s.cpu_compute_start = None;
            #[cfg(feature = "cuda")]
            {
                // The streams are idle (synchronised above): no event to wait on.
                s.free = None;
                s.ready = None;
                s.compute = None;
                s.casts.clear();
                s.written_back.clear();
                s.stepped_copy_of = None;
            }
        }
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
        self.slots.iter().any(|s| {
            if storage_key(&s.flat) == key {
                return true;
            }
            #[cfg(feature = "cuda")]
            if s.alias_vars
                .values()
                .flatten()
                .any(|(_, v)| storage_key(v.as_tensor()) == key)
            {
                return true;
            }
            false
        })
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
        let layout = &self.layouts[block];
        match &self.engine {
            Engine::Cpu => {
                let _ = (slot, layout, which);
                candle_core::bail!(
                    "the CPU pool keeps no device copies of masters: step the host masters directly"
                )
            }
            #[cfg(feature = "cuda")]
            Engine::Cuda(_) => {
                let s = &self.slots[slot];
                if s.compute.is_none() {
                    candle_core::bail!(
                        "block {:?} is loaded but not acquired: its device copies are complete only after acquire",
                        self.names[block]
                    );
                }
                which
                    .iter()
                    .map(|&m| {
                        let Some(address) = self.copy_address(slot, block, m) else {
                            candle_core::bail!(
                                "weight {m} is not one of block {:?}'s masters",
                                self.names[block]
                            );
                        };
                        let var = &self.masters.get(m).var;
                        Ok(DeviceMaster {
                            master: m,
                            address,
                            dtype: var.dtype(),
                            elems: var.elem_count(),
                        })
                    })
                    .collect()
            }
        }
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
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &mut self.engine {
            let ready = CudaEngine::event(&e.compute)?;
            e.transfer.wait(&ready).map_err(candle_core::Error::wrap)?;
            for t in &targets {
                let master = self.masters.get(t.master);
                let (host, n) = crate::host::host_bytes(master.var.as_tensor())?;
                // SAFETY: `t.address` holds this master's device copy (n bytes,
                // its dtype); the host side is the master itself, untouched until
                // `synchronize` (this fn's contract), or a bounce buffer.
                unsafe { e.write_back(t, host as *mut u8, n, master.is_pinned())? };
                self.stats.d2h_bytes += n as u64;
            }
            if let Some(slot) = self.slot_of[block] {
                self.slots[slot].written_back.extend_from_slice(which);
            }
        }
        let _ = targets;
        Ok(())
    }

    /// Waits for every copy and compute the pool issued (and completes the
    /// host side of [`Self::write_back_masters`]).
    pub fn synchronize(&mut self) -> Result<()> {
        self.take_deferred()?;
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &mut self.engine {
            // Driver errors stay `Error::Cuda`, so `Drop` can record their code.
            let w = |e: cudarc::driver::DriverError| candle_core::Error::Cuda(Box::new(e));
            e.transfer.synchronize().map_err(w)?;
            e.compute.synchronize().map_err(w)?;
            // Comparisons of lent slots read slot and scratch memory.
            e.verifier.synchronize()?;
            for (dst, src, len) in e.bounce_pending.drain(..) {
                // SAFETY: `src` lies in a bounce buffer the engine owns, filled by
                // a copy the transfer stream has passed (synchronised above);
                // `dst` lies in a live host master that nothing touches until
                // this returns (`write_back_masters`' contract).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) };
            }
        }
        Ok(())
    }

    /// Statistics so far (on CUDA this waits for the timing events issued so far).
    pub fn stats(&mut self) -> Result<StreamStats> {
        self.take_deferred()?;
        self.resolve_timings(true)?;
        Ok(self.stats.clone())
    }

    /// Clears the statistics counters and the transition log.
    pub fn reset_stats(&mut self) -> Result<()> {
        self.resolve_timings(true)?;
        self.stats.reset();
        if let Some(tl) = &mut self.timeline {
            tl.clear();
        }
        self.calibrate_host_clock()
    }

    /// The recorded timeline, if enabled (on CUDA this waits for its events).
    pub fn timeline(&mut self) -> Result<Option<&Timeline>> {
        self.resolve_timings(true)?;
        Ok(self.timeline.as_ref())
    }

    /// Folds finished timing events into the statistics. With `all`, waits for all.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn resolve_timings(&mut self, all: bool) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Engine::Cuda(e) = &mut self.engine {
            e.resolve(all, &mut self.stats, self.timeline.as_mut(), &self.names)?;
        }
        Ok(())
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

    /// Adds device-to-host traffic (gradients) to the statistics.
    pub fn add_d2h(&mut self, bytes: u64, seconds: f64) {
        self.stats.d2h_bytes += bytes;
        self.stats.d2h_seconds += seconds;
    }

    /// Adds host time spent blocked on the pool's work.
    pub fn add_host_wait(&mut self, seconds: f64) {
        self.stats.host_wait_seconds += seconds;
    }
}

impl Drop for ResidencyPool {
    fn drop(&mut self) {
        // Copies in flight read host masters and write slots: let them finish
        // before either can be freed. No caller is left to take an error: on
        // CUDA it is recorded on the context (cudarc's `record_err`), whose
        // next checked call returns it; on the CPU `synchronize` cannot fail.
        let r = self.synchronize();
        #[cfg(feature = "cuda")]
        if let (Err(err), Engine::Cuda(e)) = (&r, &self.engine) {
            streamer_device::cuda::record_dropped_error(e.compute.context(), err);
        }
        debug_assert!(cfg!(feature = "cuda") || r.is_ok());
        // Alias variables point into slot memory they do not own: dropping them
        // would free it a second time, so they are forgotten (a few bytes each).
        // A forgotten clone also keeps the variable's reference count above zero
        // for good, so a clone someone else still holds never frees it either.
        #[cfg(feature = "cuda")]
        for s in self.slots.iter_mut() {
            for (_, vars) in s.alias_vars.drain() {
                for (_, v) in vars {
                    std::mem::forget(v);
                }
            }
        }
    }
}

/// Adds a block's copy, which took `took` from `ts` µs on the timeline's
/// axis, to the statistics and the timeline: one place for both engines.
fn account_transfer(
    stats: &mut StreamStats,
    timeline: Option<&mut Timeline>,
    name: &str,
    ts: f64,
    took: Duration,
) {
    stats.h2d_seconds += took.as_secs_f64();
    if let Some(tl) = timeline {
        tl.push(TraceKind::Transfer, name, ts, took.as_secs_f64() * 1e6);
    }
}

/// Adds a block's compute to the statistics and the timeline: `(ts, stall,
/// took)` is when its wait for the copy began (µs on the timeline's axis),
/// how long it waited, then how long it computed.
fn account_compute(
    stats: &mut StreamStats,
    timeline: Option<&mut Timeline>,
    name: &str,
    (ts, stall, took): (f64, Duration, Duration),
) {
    stats.stall_seconds += stall.as_secs_f64();
    stats.compute_seconds += took.as_secs_f64();
    if let Some(tl) = timeline {
        let stall_us = stall.as_secs_f64() * 1e6;
        if stall_us > 0.0 {
            tl.push(TraceKind::Stall, name, ts, stall_us);
        }
        tl.push(
            TraceKind::Compute,
            name,
            ts + stall_us,
            took.as_secs_f64() * 1e6,
        );
    }
}

/// A key equal for tensors that share storage.
pub(crate) fn storage_key(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const candle_core::Storage as usize
}

impl Slot {
    fn new(device: &Device, dtype: DType, elems: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let mut ptr = 0u64;
        let flat = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                let (t, p) = crate::cuda::alloc_flat(dev, dtype, elems)?;
                ptr = p;
                t
            }
            _ => Tensor::zeros(elems, dtype, device)?,
        };
        Ok(Self {
            flat,
            block: None,
            #[cfg(feature = "cuda")]
            ptr,
            #[cfg(feature = "cuda")]
            free: None,
            #[cfg(feature = "cuda")]
            ready: None,
            #[cfg(feature = "cuda")]
            compute: None,
            cpu_compute_start: None,
            #[cfg(feature = "cuda")]
            alias_vars: HashMap::new(),
            #[cfg(feature = "cuda")]
            stage: None,
            #[cfg(feature = "cuda")]
            casts: Vec::new(),
            #[cfg(feature = "cuda")]
            staged: Vec::new(),
            #[cfg(feature = "cuda")]
            written_back: Vec::new(),
            #[cfg(feature = "cuda")]
            stepped_copy_of: None,
        })
    }
}

/// Bytes a master takes in a staging buffer (256-byte aligned for the casts).
#[cfg(feature = "cuda")]
pub(crate) fn stage_len(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

#[cfg(feature = "cuda")]
impl CudaEngine {
    fn new(
        dev: &candle_core::CudaDevice,
        masters: &HostMasters,
        layouts: &[BlockLayout],
        cfg: &StreamConfig,
    ) -> Result<Self> {
        use cudarc::driver::sys::CUevent_flags;
        // The context's event tracking is left as the caller set it: the pool's
        // own ready/free events order its streams either way.
        let compute = dev.cuda_stream();
        if cfg.retain_device_memory {
            streamer_device::retain_freed_device_memory(&candle_core::Device::Cuda(dev.clone()))?;
        }
        let transfer = compute
            .context()
            .new_stream()
            .map_err(candle_core::Error::wrap)?;
        let master_dt = cfg.master_dtype();
        // The largest block's masters in their own dtype, 256-byte aligned pieces.
        let largest = layouts
            .iter()
            .map(|l| {
                l.unique
                    .iter()
                    .map(|&(m, _)| stage_len(masters.get(m).bytes()))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
            .max(1);
        let staging = if master_dt != cfg.dtype {
            if !crate::cuda::has_cast(master_dt, cfg.dtype) {
                candle_core::bail!(
                    "no device conversion from master dtype {master_dt:?} to compute dtype {:?}",
                    cfg.dtype
                );
            }
            let mut bufs = Vec::with_capacity(cfg.window());
            for _ in 0..cfg.window() {
                let s = dev.alloc_zeros::<u8>(largest)?;
                let p = {
                    use cudarc::driver::DevicePtr;
                    let (p, _g) = s.device_ptr(&compute);
                    p
                };
                bufs.push((s, p));
            }
            bufs
        } else {
            Vec::new()
        };
        let epoch = compute
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)?;
        let verifier = crate::reuse::Verifier::new(&transfer, largest)?;
        Ok(Self {
            dev: dev.clone(),
            compute,
            transfer,
            staging,
            epoch,
            pending: Vec::new(),
            bounce: crate::Offloader::new(&Device::Cuda(dev.clone()))?,
            bounce_bufs: HashMap::new(),
            bounce_pending: Vec::new(),
            verifier,
        })
    }

    fn event(stream: &cudarc::driver::CudaStream) -> Result<cudarc::driver::CudaEvent> {
        stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)
    }

    fn load(
        &mut self,
        block: usize,
        layout: &BlockLayout,
        masters: &HostMasters,
        slot: &mut Slot,
        dtype: DType,
        delay: Option<std::time::Duration>,
    ) -> Result<u64> {
        if let Some(free) = slot.free.take() {
            // The slot's previous block must have finished computing (device-side wait).
            self.transfer
                .wait(&free)
                .map_err(candle_core::Error::wrap)?;
        }
        let start = Self::event(&self.transfer)?;
        let mut bytes = 0u64;
        let es = dtype.size_in_bytes() as u64;
        let mut staged = 0u64;
        let mut casts = Vec::new();
        slot.casts.clear();
        slot.staged.clear();
        for &(m, off) in &layout.unique {
            let master = masters.get(m);
            let (src, n) = crate::host::host_bytes(master.var.as_tensor())?;
            bytes += n as u64;
            let dst = slot.ptr + off as u64 * es;
            match slot.stage {
                None => {
                    // SAFETY: dst lies in the slot (offset + size <= slot elems by layout);
                    // the master stays alive and unmodified until the transfer stream is
                    // synchronized (pool drop, or before optimizers write masters).
                    unsafe { crate::cuda::htod_async(dst, src, n, &self.transfer)? }
                }
                Some(stage) => {
                    let at = stage + staged;
                    staged += stage_len(n) as u64;
                    // SAFETY: the staging buffer holds the largest block's masters
                    // (sized in `new` with the same `stage_len` rounding); whatever
                    // read the previous load's staged data (its conversions, on this
                    // stream, and a device step, before `slot.free`) is ordered before.
                    unsafe { crate::cuda::htod_async(at, src, n, &self.transfer)? };
                    slot.staged.push((m, at));
                    casts.push((master.var.dtype(), at, dtype, dst, master.var.elem_count()));
                }
            }
        }
        if let Some(d) = delay {
            crate::cuda::delay(&self.dev, &self.transfer, d.as_nanos() as u64)?;
        }
        let end = Arc::new(Self::event(&self.transfer)?);
        // The conversions run on this stream behind the copies, so that they
        // overlap the previous block's compute instead of delaying this one's
        // (the copy's timing above ends before them).
        let converted = !casts.is_empty();
        for (from, src, to, dst, n) in casts {
            // SAFETY: src is this slot's staging, filled by the copies just
            // enqueued on this stream; dst lies in the slot (sized by layout),
            // whose previous block finished computing (`slot.free`, waited for).
            unsafe { crate::cuda::cast(&self.dev, &self.transfer, from, src, to, dst, n)? };
        }
        slot.ready = Some(if converted {
            Arc::new(Self::event(&self.transfer)?)
        } else {
            end.clone()
        });
        self.pending.push(PendingTiming::Load { block, start, end });
        Ok(bytes)
    }

    fn acquire(&mut self, slot: &mut Slot) -> Result<()> {
        let wait = Self::event(&self.compute)?;
        if let Some(ready) = &slot.ready {
            self.compute.wait(ready).map_err(candle_core::Error::wrap)?;
        }
        // The block's compute starts here: converting a lent block's weights
        // is work for it, not a wait for them (the stall statistic is the wait alone).
        let start = Self::event(&self.compute)?;
        for (from, src, to, dst, n) in slot.casts.drain(..) {
            // SAFETY: src is this slot's staging, whose masters a device step
            // changed on this stream (before this point); dst lies in the slot;
            // both sized by layout.
            unsafe { crate::cuda::cast(&self.dev, &self.compute, from, src, to, dst, n)? };
        }
        slot.compute = Some((wait, start));
        Ok(())
    }

    fn release(&mut self, block: usize, slot: &mut Slot) -> Result<()> {
        let end = Arc::new(Self::event(&self.compute)?);
        slot.free = Some(end.clone());
        if let Some((wait, start)) = slot.compute.take() {
            self.pending.push(PendingTiming::Compute {
                block,
                wait,
                start,
                end,
            });
        }
        Ok(())
    }

    /// Enqueues the copy of a device master copy into its host master: whole
    /// page-locked pages directly, the pageable rest through a bounce buffer
    /// (`synchronize` copies it into place).
    ///
    /// # Safety
    /// `host..host + n` is the master's memory, untouched until `synchronize`.
    unsafe fn write_back(
        &mut self,
        t: &DeviceMaster,
        host: *mut u8,
        n: usize,
        pinned: bool,
    ) -> Result<()> {
        let page = crate::pages::page_size();
        for (off, len, whole) in crate::pages::page_pieces(host as usize, n) {
            let src = t.address + off as u64;
            if whole && pinned {
                // SAFETY: a page-locked range of the master (this fn's contract).
                unsafe { crate::cuda::dtoh_async(host.add(off), src, len, &self.transfer)? };
                continue;
            }
            let size = if pinned { 2 * page } else { n };
            if !self.bounce_bufs.contains_key(&t.master) {
                let buf = self.bounce.host_buffer(&Shape::from(size), DType::U8)?;
                self.bounce_bufs.insert(t.master, buf);
            }
            let (b, _) = crate::host::host_bytes(&self.bounce_bufs[&t.master])?;
            // Head at 0 and tail at one page in; everything at its offset when
            // the master is not page-locked at all.
            let at = if !pinned {
                off
            } else if off == 0 {
                0
            } else {
                page
            };
            // SAFETY: `at + len <= size` (a head or tail is under one page); the
            // bounce buffer is page-locked whole and read only after the stream
            // passes this copy (`synchronize`).
            unsafe { crate::cuda::dtoh_async(b.add(at) as *mut u8, src, len, &self.transfer)? };
            self.bounce_pending
                .push((host as usize + off, b as usize + at, len));
        }
        Ok(())
    }

    /// Unresolved timing records.
    fn pending_len(&self) -> usize {
        self.pending.len()
    }

    fn resolve(
        &mut self,
        all: bool,
        stats: &mut StreamStats,
        mut timeline: Option<&mut Timeline>,
        names: &[String],
    ) -> Result<()> {
        let w = |e: cudarc::driver::DriverError| candle_core::Error::wrap(e);
        let mut keep = Vec::new();
        for p in self.pending.drain(..) {
            let last = match &p {
                PendingTiming::Load { end, .. } => end.clone(),
                PendingTiming::Compute { end, .. } => end.clone(),
            };
            if !all && !last.is_complete() {
                keep.push(p);
                continue;
            }
            last.synchronize().map_err(w)?;
            match p {
                PendingTiming::Load { block, start, end } => {
                    let secs = start.elapsed_ms(&end).map_err(w)? as f64 / 1e3;
                    let ts = self.epoch.elapsed_ms(&start).map_err(w)? as f64 * 1e3;
                    let tl = timeline.as_deref_mut();
                    account_transfer(
                        stats,
                        tl,
                        &names[block],
                        ts,
                        Duration::from_secs_f64(secs.max(0.0)),
                    );
                }
                PendingTiming::Compute {
                    block,
                    wait,
                    start,
                    end,
                } => {
                    let stall = wait.elapsed_ms(&start).map_err(w)? as f64 / 1e3;
                    let secs = start.elapsed_ms(&end).map_err(w)? as f64 / 1e3;
                    let ts_wait = self.epoch.elapsed_ms(&wait).map_err(w)? as f64 * 1e3;
                    // Clamped: `from_secs_f64` panics below zero.
                    let d = |x: f64| Duration::from_secs_f64(x.max(0.0));
                    let tl = timeline.as_deref_mut();
                    account_compute(stats, tl, &names[block], (ts_wait, d(stall), d(secs)));
                }
            }
        }
        self.pending = keep;
        Ok(())
    }
}
