//! The CUDA engine: copies on a transfer stream of their own, ordered against
//! the compute stream by events on the device (a block's `ready`, a slot's
//! `free`), so the host never blocks; masters in another dtype than the
//! compute dtype staged and converted on the device; device-stepped masters
//! written back, and lent to the next forward behind a check (`crate::reuse`).
use super::engine::{Engine, Parts, Timing};
use super::write_back::WriteBack;
use super::{storage_key, BlockLayout, DeviceMaster, Entry};
use crate::config::StreamConfig;
use crate::cuda::stage_len;
use crate::host::HostMasters;
use crate::reuse::{Copies, Verifier};
use crate::stats::StreamStats;
use candle_core::{CudaDevice, DType, Device, Result, Tensor, Var};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A conversion left for later: `(from, src, to, dst, elements)`.
type Cast = (DType, u64, DType, u64, usize);

/// What the engine keeps per slot, beside the pool's `Slot`.
#[derive(Default)]
struct CudaSlot {
    /// The slot's device address (stable for the slot's life).
    ptr: u64,
    /// Recorded at the end of the last block's compute: the next copy waits for it.
    free: Option<Arc<CudaEvent>>,
    /// Recorded after the block's copy (and conversions): compute waits for it.
    ready: Option<Arc<CudaEvent>>,
    /// The compute's wait and start events, from `acquire` to `release`.
    compute: Option<(CudaEvent, CudaEvent)>,
    /// Autograd variables aliasing this slot's memory, per block (see
    /// `acquire_vars`). Never dropped normally: they do not own their memory.
    alias_vars: HashMap<usize, Vec<(usize, Var)>>,
    /// u8 tensors aliasing this slot's packed masters, per `(block, master)`
    /// (see `packed_view`). Never dropped normally, as `alias_vars`.
    packed_views: HashMap<(usize, usize), Tensor>,
    /// Staging for a whole block's masters when their dtype differs from the
    /// compute dtype, and its address: the transfer stream only copies into
    /// it and converts behind the copies. (A conversion waits for SMs behind
    /// the compute stream's GEMMs; f32 masters converted on the compute
    /// stream instead streamed at 25 GB/s rather than 55.)
    stage: Option<(CudaSlice<u8>, u64)>,
    /// Conversions left for `acquire`: those of a block lent after a device
    /// step, whose staged masters the step changed on the compute stream.
    casts: Vec<Cast>,
    /// Where the last load staged each master in its own dtype: `(master,
    /// address)` (empty when masters are copied into the slot directly).
    staged: Vec<(usize, u64)>,
    /// Masters of the acquired block written back after a device step.
    written_back: Vec<usize>,
    /// A free slot that still holds this block's device-stepped masters, every
    /// one written back (see `crate::reuse`).
    stepped_copy_of: Option<usize>,
}

pub(super) struct CudaEngine {
    slots: Vec<CudaSlot>,
    dev: CudaDevice,
    compute: Arc<CudaStream>,
    transfer: Arc<CudaStream>,
    /// Time zero of the timeline, on the compute stream.
    epoch: CudaEvent,
    pending: Vec<PendingTiming>,
    /// Write-backs of device-stepped masters (`write_back_masters`).
    write_back: WriteBack,
    /// Checks blocks lent to the next forward as they are (`crate::reuse`).
    verifier: Verifier,
    /// `StreamConfig::transfer_delay`: a kernel that holds up each copy.
    delay: Option<Duration>,
    /// `StreamConfig::reuse_stepped_blocks`.
    reuse_enabled: bool,
    /// The next load may lend a stepped slot as it is (only the first load of
    /// a runner that asks for the verdict before returning: `crate::run_blocks_with`).
    reuse_open: bool,
}

enum PendingTiming {
    Load {
        block: usize,
        start: CudaEvent,
        end: Arc<CudaEvent>,
    },
    Compute {
        block: usize,
        wait: CudaEvent,
        start: CudaEvent,
        end: Arc<CudaEvent>,
    },
}

fn event(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(candle_core::Error::wrap)
}

impl CudaEngine {
    /// The engine and its `cfg.window()` slots of `elems` elements each.
    pub(super) fn new(
        dev: &CudaDevice,
        masters: &HostMasters,
        layouts: &[BlockLayout],
        cfg: &StreamConfig,
        elems: usize,
    ) -> Result<(Self, Vec<Tensor>)> {
        let w = candle_core::Error::wrap;
        // The context's event tracking is left as the caller set it: the pool's
        // own ready/free events order its streams either way.
        let compute = dev.cuda_stream();
        if cfg.retain_device_memory {
            streamer_device::retain_freed_device_memory(&Device::Cuda(dev.clone()))?;
        }
        let transfer = compute.context().new_stream().map_err(w)?;
        // The largest block's masters in their own dtype, 256-byte aligned pieces.
        let largest = layouts
            .iter()
            .map(|l| {
                (l.unique.iter())
                    .filter(|&&(m, _)| !masters.get(m).is_packed())
                    .map(|&(m, _)| stage_len(masters.get(m).bytes()))
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
            .max(1);
        let mut staging = staging_buffers(dev, &compute, cfg, largest)?.into_iter();
        let epoch = event(&compute)?;
        let verifier = Verifier::new(&transfer, largest)?;
        let write_back = WriteBack::new(dev)?;
        let (mut flats, mut slots) = (Vec::new(), Vec::new());
        for _ in 0..cfg.window() {
            let (flat, ptr) = crate::cuda::alloc_flat(dev, cfg.dtype, elems)?;
            flats.push(flat);
            let stage = staging.next();
            slots.push(CudaSlot {
                ptr,
                stage,
                ..Default::default()
            });
        }
        // Slots are stream-ordered allocations (and zero fills) on the compute
        // stream: the transfer stream must not touch them before those happen.
        transfer.join(&compute).map_err(w)?;
        let engine = Self {
            slots,
            dev: dev.clone(),
            compute,
            transfer,
            epoch,
            pending: Vec::new(),
            write_back,
            verifier,
            delay: cfg.transfer_delay,
            reuse_enabled: cfg.reuse_stepped_blocks,
            reuse_open: false,
        };
        Ok((engine, flats))
    }

    /// Queues the copy of `block`'s masters into `slot` on the transfer
    /// stream, after the slot's previous compute, and the conversions of
    /// staged masters behind it; returns the bytes copied.
    fn copy_block(&mut self, block: usize, slot: usize, p: Parts) -> Result<u64> {
        let s = &mut self.slots[slot];
        if let Some(free) = s.free.take() {
            // The slot's previous block must have finished computing (device-side wait).
            (self.transfer.wait(&free)).map_err(candle_core::Error::wrap)?;
        }
        let start = event(&self.transfer)?;
        let (mut bytes, mut staged) = (0u64, 0u64);
        let es = p.dtype.size_in_bytes() as u64;
        let mut casts = Vec::new();
        s.casts.clear();
        s.staged.clear();
        for &(m, off) in &p.layouts[block].unique {
            let master = p.masters.get(m);
            let (src, n) = crate::host::host_bytes(master.var.as_tensor())?;
            bytes += n as u64;
            let dst = s.ptr + off as u64 * es;
            match &s.stage {
                // A master in another dtype than the compute dtype: staged, and
                // converted on the device after the copy.
                Some((_, stage)) if !master.is_packed() => {
                    let at = stage + staged;
                    staged += stage_len(n) as u64;
                    // SAFETY: the staging buffer holds the largest block's masters
                    // (sized in `new` with the same `stage_len` rounding); whatever
                    // read the previous load's staged data (its conversions, on this
                    // stream, and a device step, before `s.free`) is ordered before.
                    unsafe { crate::cuda::htod_async(at, src, n, &self.transfer)? };
                    s.staged.push((m, at));
                    let elems = master.var.elem_count();
                    casts.push((master.var.dtype(), at, p.dtype, dst, elems));
                }
                // In the compute dtype, or packed (raw bytes): into the slot.
                // SAFETY: dst lies in the slot (offset + size <= slot elems by
                // layout, which sizes it for a packed master's bytes); the master
                // stays alive and unmodified until the transfer stream is
                // synchronized (pool drop, or before optimizers write masters).
                _ => unsafe { crate::cuda::htod_async(dst, src, n, &self.transfer)? },
            }
        }
        if let Some(d) = self.delay {
            crate::cuda::delay(&self.dev, &self.transfer, d.as_nanos() as u64)?;
        }
        let end = Arc::new(event(&self.transfer)?);
        // The conversions run on this stream behind the copies, so that they
        // overlap the previous block's compute instead of delaying this one's
        // (the copy's timing above ends before them).
        let converted = !casts.is_empty();
        for (from, src, to, dst, n) in casts {
            // SAFETY: src is this slot's staging, filled by the copies just
            // enqueued on this stream; dst lies in the slot (sized by layout),
            // whose previous block finished computing (`s.free`, waited for).
            unsafe { crate::cuda::cast(&self.dev, &self.transfer, from, src, to, dst, n)? };
        }
        s.ready = Some(if converted {
            Arc::new(event(&self.transfer)?)
        } else {
            end.clone()
        });
        self.pending.push(PendingTiming::Load { block, start, end });
        Ok(bytes)
    }

    /// Where the device copy of master `m` of the block in `slot` is, in the
    /// master's dtype: its staging piece, or its place in the slot.
    fn copy_address(&self, slot: usize, block: usize, m: usize, p: Parts) -> Option<u64> {
        let s = &self.slots[slot];
        let staged = s.staged.iter().find(|(k, _)| *k == m).map(|x| x.1);
        // Unstaged: in the slot (no staging, or a packed master).
        staged.or_else(|| {
            (p.layouts[block].unique.iter())
                .find(|(k, _)| *k == m)
                .map(|&(_, off)| s.ptr + (off * p.dtype.size_in_bytes()) as u64)
        })
    }

    /// A finished timing record as the pool accounts it.
    fn timing(&self, p: PendingTiming) -> Result<Timing> {
        let w = |e: DriverError| candle_core::Error::wrap(e);
        // Clamped: `from_secs_f64` panics below zero.
        let d = |ms: f32| Duration::from_secs_f64((ms as f64 / 1e3).max(0.0));
        Ok(match p {
            PendingTiming::Load { block, start, end } => Timing::Transfer {
                block,
                ts: self.epoch.elapsed_ms(&start).map_err(w)? as f64 * 1e3,
                took: d(start.elapsed_ms(&end).map_err(w)?),
            },
            PendingTiming::Compute {
                block,
                wait,
                start,
                end,
            } => Timing::Compute {
                block,
                ts: self.epoch.elapsed_ms(&wait).map_err(w)? as f64 * 1e3,
                stall: d(wait.elapsed_ms(&start).map_err(w)?),
                took: d(start.elapsed_ms(&end).map_err(w)?),
            },
        })
    }
}

/// Per slot, staging for a whole block's masters (`largest` bytes) when the
/// masters' dtype differs from the compute dtype; none otherwise.
fn staging_buffers(
    dev: &CudaDevice,
    compute: &Arc<CudaStream>,
    cfg: &StreamConfig,
    largest: usize,
) -> Result<Vec<(CudaSlice<u8>, u64)>> {
    let master_dt = cfg.master_dtype();
    if master_dt == cfg.dtype {
        return Ok(Vec::new());
    }
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
            let (p, _g) = s.device_ptr(compute);
            p
        };
        bufs.push((s, p));
    }
    Ok(bufs)
}

impl Engine for CudaEngine {
    fn copy_in(
        &mut self,
        (block, slot, _flat): (usize, usize, &Tensor),
        p: Parts,
        stats: &mut StreamStats,
    ) -> Result<(u64, Option<Timing>)> {
        let s = &mut self.slots[slot];
        s.stepped_copy_of = None;
        s.written_back.clear();
        let (dev, transfer) = (&self.dev, &self.transfer);
        // A comparison of this slot's lent copy goes first (the copy waits).
        stats.verify_bytes += self.verifier.issue(dev, transfer, p.masters, Some(slot))?;
        self.verifier.before_refill(slot, transfer)?;
        let bytes = self
            .copy_block(block, slot, p)
            .map_err(|err| err.context(format!("copying block {:?}'s weights", p.names[block])))?;
        // Comparisons' host copies queue behind this copy, which the
        // next compute may be waiting for (kernels: `crate::reuse`).
        let (dev, transfer) = (&self.dev, &self.transfer);
        stats.verify_bytes += self.verifier.issue(dev, transfer, p.masters, None)?;
        Ok((bytes, None))
    }

    fn begin_compute(&mut self, slot: usize) -> Result<()> {
        let s = &mut self.slots[slot];
        let wait = event(&self.compute)?;
        if let Some(ready) = &s.ready {
            (self.compute.wait(ready)).map_err(candle_core::Error::wrap)?;
        }
        // The block's compute starts here: converting a lent block's weights
        // is work for it, not a wait for them (the stall statistic is the wait alone).
        let start = event(&self.compute)?;
        for (from, src, to, dst, n) in s.casts.drain(..) {
            // SAFETY: src is this slot's staging, whose masters a device step
            // changed on this stream (before this point); dst lies in the slot;
            // both sized by layout.
            unsafe { crate::cuda::cast(&self.dev, &self.compute, from, src, to, dst, n)? };
        }
        s.compute = Some((wait, start));
        Ok(())
    }

    fn end_compute(&mut self, block: usize, slot: usize, p: Parts) -> Result<Option<Timing>> {
        let s = &mut self.slots[slot];
        let end = Arc::new(event(&self.compute)?);
        s.free = Some(end.clone());
        if let Some((wait, start)) = s.compute.take() {
            let (block, end) = (block, end);
            (self.pending).push(PendingTiming::Compute {
                block,
                wait,
                start,
                end,
            });
        }
        // Every master stepped and written back: the slot equals the host
        // masters once that copy lands, and may be lent.
        let all = !s.written_back.is_empty()
            && (p.layouts[block].unique.iter()).all(|(m, _)| s.written_back.contains(m));
        s.stepped_copy_of = all.then_some(block);
        s.written_back.clear();
        Ok(None)
    }

    fn synchronize(&mut self) -> Result<()> {
        // Driver errors stay `Error::Cuda`, so `Drop` can record their code.
        let w = |e: DriverError| candle_core::Error::Cuda(Box::new(e));
        self.transfer.synchronize().map_err(w)?;
        self.compute.synchronize().map_err(w)?;
        // Comparisons of lent slots read slot and scratch memory.
        self.verifier.synchronize()?;
        // SAFETY: the transfer stream has passed every write-back (above).
        unsafe { self.write_back.finish() };
        Ok(())
    }

    fn resolve(&mut self, all: bool, sink: &mut dyn FnMut(Timing)) -> Result<()> {
        let mut keep = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            let last = match &p {
                PendingTiming::Load { end, .. } => end.clone(),
                PendingTiming::Compute { end, .. } => end.clone(),
            };
            if !all && !last.is_complete() {
                keep.push(p);
                continue;
            }
            last.synchronize().map_err(candle_core::Error::wrap)?;
            sink(self.timing(p)?);
        }
        self.pending = keep;
        Ok(())
    }

    fn unresolved(&self) -> usize {
        self.pending.len()
    }

    fn clock(&self) -> Result<(Instant, f64)> {
        let w = candle_core::Error::wrap;
        let now = event(&self.compute)?;
        now.synchronize().map_err(w)?;
        let host = Instant::now();
        let us = self.epoch.elapsed_ms(&now).map_err(w)? as f64 * 1e3;
        Ok((host, us))
    }

    fn reset(&mut self) {
        for s in &mut self.slots {
            s.free = None;
            s.ready = None;
            s.compute = None;
            s.casts.clear();
            s.written_back.clear();
            s.stepped_copy_of = None;
        }
    }

    fn record_dropped(&self, err: &candle_core::Error) {
        streamer_device::cuda::record_dropped_error(self.compute.context(), err);
    }

    fn holds_stepped_copy(&self, slot: usize) -> bool {
        self.slots[slot].stepped_copy_of.is_some()
    }

    fn lend(&mut self, block: usize, free: &mut VecDeque<usize>, p: Parts) -> Option<usize> {
        // Only a runner's first load may lend: that block's copy is the one
        // nothing hides, while lending a later one would only add its
        // check's copy to the call's.
        let open = std::mem::replace(&mut self.reuse_open, false);
        if !(self.reuse_enabled && open) {
            return None;
        }
        let pos = (free.iter()).position(|&s| self.slots[s].stepped_copy_of == Some(block))?;
        let slot = free.remove(pos).expect("a position in the free list");
        let copies: Copies = (p.layouts[block].unique.iter())
            .map(|&(m, _)| {
                let addr = (self.copy_address(slot, block, m, p)).expect("a master of the block");
                (m, addr, p.masters.get(m).bytes())
            })
            .collect();
        let es = p.dtype.size_in_bytes() as u64;
        let s = &mut self.slots[slot];
        s.stepped_copy_of = None;
        s.written_back.clear();
        s.ready = None;
        // With staging, the step changed the staged masters, not the slot's
        // compute-dtype weights: acquire converts them again.
        s.casts.clear();
        for &(m, off) in &p.layouts[block].unique {
            if let Some(&(_, at)) = s.staged.iter().find(|(k, _)| *k == m) {
                let var = &p.masters.get(m).var;
                let dst = s.ptr + off as u64 * es;
                (s.casts).push((var.dtype(), at, p.dtype, dst, var.elem_count()));
            }
        }
        self.verifier.pending.push((slot, copies));
        Some(slot)
    }

    fn open_reuse(&mut self, open: bool) {
        self.reuse_open = open;
    }

    fn lent_stale(&mut self, p: Parts, stats: &mut StreamStats) -> Result<bool> {
        let (dev, transfer) = (&self.dev, &self.transfer);
        stats.verify_bytes += self.verifier.issue(dev, transfer, p.masters, None)?;
        if self.verifier.verdict()? {
            stats.stale_reuses += 1;
            self.slots.iter_mut().for_each(|s| s.stepped_copy_of = None);
            return Ok(true);
        }
        Ok(false)
    }

    fn drop_lent(&mut self) {
        self.verifier.pending.clear();
        self.slots.iter_mut().for_each(|s| s.stepped_copy_of = None);
    }

    fn alias_vars(&mut self, block: usize, slot: usize, p: Parts) -> Result<Vec<(usize, Var)>> {
        let s = &mut self.slots[slot];
        if !s.alias_vars.contains_key(&block) {
            let mut made = Vec::new();
            let float =
                (p.layouts[block].unique.iter()).filter(|(m, _)| !p.masters.get(*m).is_packed());
            for &(m, off) in float {
                let shape = p.masters.get(m).shape().clone();
                let ptr = s.ptr + (off * p.dtype.size_in_bytes()) as u64;
                // SAFETY: [ptr, ptr + shape bytes) lies inside the slot, which
                // outlives the variable (forgotten in Drop, never freed by it).
                let v = unsafe { crate::cuda::alias_var(&self.dev, ptr, p.dtype, &shape)? };
                made.push((m, v));
            }
            s.alias_vars.insert(block, made);
        }
        Ok(s.alias_vars[&block].clone())
    }

    fn packed_view(
        &mut self,
        (block, slot, _flat): (usize, usize, &Tensor),
        e: &Entry,
        p: Parts,
    ) -> Result<Tensor> {
        let s = &mut self.slots[slot];
        if let Some(t) = s.packed_views.get(&(block, e.master)) {
            return Ok(t.clone());
        }
        let ptr = s.ptr + (e.offset * p.dtype.size_in_bytes()) as u64;
        let len = p.masters.get(e.master).bytes();
        // SAFETY: the layout places the master's bytes at this offset inside
        // the slot, which outlives the tensor (forgotten in Drop, never freed
        // by it).
        let t = unsafe { crate::cuda::alias_bytes(&self.dev, ptr, len)? };
        s.packed_views.insert((block, e.master), t.clone());
        Ok(t)
    }

    fn aliases(&self, key: usize) -> bool {
        let mut vars = self
            .slots
            .iter()
            .flat_map(|s| s.alias_vars.values().flatten());
        vars.any(|(_, v)| storage_key(v.as_tensor()) == key)
    }

    fn device_masters(
        &self,
        (block, slot): (usize, usize),
        which: &[usize],
        p: Parts,
    ) -> Result<Vec<DeviceMaster>> {
        if self.slots[slot].compute.is_none() {
            candle_core::bail!(
                "block {:?} is loaded but not acquired: its device copies are complete only after acquire",
                p.names[block]
            );
        }
        (which.iter())
            .map(|&m| {
                let Some(address) = self.copy_address(slot, block, m, p) else {
                    candle_core::bail!(
                        "weight {m} is not one of block {:?}'s masters",
                        p.names[block]
                    );
                };
                let var = &p.masters.get(m).var;
                Ok(DeviceMaster {
                    master: m,
                    address,
                    dtype: var.dtype(),
                    elems: var.elem_count(),
                })
            })
            .collect()
    }

    unsafe fn write_back(
        &mut self,
        slot: usize,
        targets: &[DeviceMaster],
        p: Parts,
        stats: &mut StreamStats,
    ) -> Result<()> {
        let ready = event(&self.compute)?;
        (self.transfer.wait(&ready)).map_err(candle_core::Error::wrap)?;
        for t in targets {
            let master = p.masters.get(t.master);
            let (host, n) = crate::host::host_bytes(master.var.as_tensor())?;
            // SAFETY: `t.address` holds this master's device copy (n bytes,
            // its dtype); the host side is the master itself, untouched until
            // `synchronize` (this fn's contract), or a bounce buffer.
            let to = (host as *mut u8, n, master.is_pinned());
            unsafe { (self.write_back).enqueue(t, to, &self.transfer)? };
            stats.d2h_bytes += n as u64;
        }
        let written = targets.iter().map(|t| t.master);
        self.slots[slot].written_back.extend(written);
        Ok(())
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        // Alias variables point into slot memory they do not own: dropping them
        // would free it a second time, so they are forgotten (a few bytes each).
        // A forgotten clone also keeps the variable's reference count above zero
        // for good, so a clone someone else still holds never frees it either.
        for s in self.slots.iter_mut() {
            for (_, vars) in s.alias_vars.drain() {
                vars.into_iter().for_each(std::mem::forget);
            }
            s.packed_views
                .drain()
                .for_each(|(_, t)| std::mem::forget(t));
        }
    }
}
