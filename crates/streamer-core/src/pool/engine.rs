//! The one trait the pool drives a device through: copies into slots, the
//! compute's ordering after them, synchronisation and timing.
use super::{BlockLayout, DeviceMaster, Entry};
use crate::host::HostMasters;
use crate::stats::StreamStats;
use candle_core::{DType, Result, Tensor, Var};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One copy or one compute an engine measured, in µs on the timeline's axis:
/// the pool adds it to the statistics and the timeline (`account::add_timing`).
pub(super) enum Timing {
    /// A block's copy into its slot began at `ts` and took `took`.
    Transfer {
        block: usize,
        ts: f64,
        took: Duration,
    },
    /// A block's compute waited `stall` for its copy from `ts`, then took `took`.
    Compute {
        block: usize,
        ts: f64,
        stall: Duration,
        took: Duration,
    },
}

/// What an engine reads of the pool (borrowed beside the engine: [`parts!`]).
#[derive(Clone, Copy)]
pub(super) struct Parts<'a> {
    pub(super) masters: &'a HostMasters,
    pub(super) layouts: &'a [BlockLayout],
    /// Block names, for the CUDA engine's errors.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) names: &'a [String],
    pub(super) dtype: DType,
}

/// How one device fills slots and times the work: `cpu::CpuEngine` (memory
/// copies, measured as they happen) or `cuda::CudaEngine` (a transfer stream
/// and events). The pool keeps the window, the slots and the accounting and
/// calls this in the protocol's order: `copy_in` (`load`), `begin_compute`
/// (`acquire`), `end_compute` (`release`).
///
/// `Send + Sync`, as the pool was with both engines inline (models move
/// across threads).
///
/// The methods with defaults are the device copies of masters that an
/// optimizer steps in place, lends to the next forward or aliases as
/// variables; the defaults are an engine without any (the CPU's, whose
/// masters are the host tensors themselves).
pub(super) trait Engine: Send + Sync {
    /// Issues the copy of `target`'s block's masters into its slot: `(block,
    /// slot, the slot's memory)`; returns the bytes read and the copy's timing when it is known now.
    fn copy_in(
        &mut self,
        target: (usize, usize, &Tensor),
        p: Parts,
        stats: &mut StreamStats,
    ) -> Result<(u64, Option<Timing>)>;

    /// Orders the compute of the block in `slot` after its copy (`acquire`).
    fn begin_compute(&mut self, slot: usize) -> Result<()>;

    /// Marks that compute as issued: the slot's next copy waits for it
    /// (`release`). Returns its timing when it is known now.
    fn end_compute(&mut self, block: usize, slot: usize, p: Parts) -> Result<Option<Timing>>;

    /// Waits for every copy and compute issued.
    fn synchronize(&mut self) -> Result<()>;

    /// Hands the timings that have finished to `sink` (with `all`, waits for all).
    fn resolve(&mut self, all: bool, sink: &mut dyn FnMut(Timing)) -> Result<()>;

    /// Timings issued and not yet handed out.
    fn unresolved(&self) -> usize;

    /// A host instant and the timeline time (µs) it corresponds to.
    fn clock(&self) -> Result<(Instant, f64)>;

    /// Forgets the per-slot state of an emptied window (nothing in flight).
    fn reset(&mut self);

    /// Keeps an error that no caller will see (the pool's `Drop`).
    fn record_dropped(&self, err: &candle_core::Error);

    /// The packed master of entry `e` of the block in `slot` (whose memory
    /// is `flat`), as a u8 tensor of the master's bytes. This default copies
    /// the bytes out (the CPU's slots are host memory); an engine may alias
    /// the slot instead.
    fn packed_view(
        &mut self,
        (_block, _slot, flat): (usize, usize, &Tensor),
        e: &Entry,
        p: Parts,
    ) -> Result<Tensor> {
        let master = p.masters.get(e.master);
        let elems = master.slot_elems(p.dtype);
        crate::packed::as_bytes(&flat.narrow(0, e.offset, elems)?, master.bytes())
    }

    /// Whether the free `slot` holds a block's stepped copy, worth keeping.
    fn holds_stepped_copy(&self, _slot: usize) -> bool {
        false
    }

    /// Takes from `free` a slot that holds `block`'s stepped copy and lends
    /// it without a copy, when the runner allows it (`open_reuse`; every
    /// call closes it again).
    fn lend(&mut self, _block: usize, _free: &mut VecDeque<usize>, _p: Parts) -> Option<usize> {
        None
    }

    /// Lets the next `lend` lend, or not.
    fn open_reuse(&mut self, _open: bool) {}

    /// Whether a block lent since the last call differed from its masters.
    fn lent_stale(&mut self, _p: Parts, _stats: &mut StreamStats) -> Result<bool> {
        Ok(false)
    }

    /// Forgets the comparisons in flight and every stepped copy.
    fn drop_lent(&mut self) {}

    /// Variables aliasing `slot`'s copies of `block`'s masters (none: the
    /// pool copies the views instead).
    fn alias_vars(&mut self, _block: usize, _slot: usize, _p: Parts) -> Result<Vec<(usize, Var)>> {
        Ok(Vec::new())
    }

    /// Whether storage `key` ([`storage_key`]) is one of the alias variables'.
    fn aliases(&self, _key: usize) -> bool {
        false
    }

    /// The device copies of `which`, masters of `block` acquired in `slot`.
    fn device_masters(
        &self,
        (_block, _slot): (usize, usize),
        _which: &[usize],
        _p: Parts,
    ) -> Result<Vec<DeviceMaster>> {
        candle_core::bail!(
            "the CPU pool keeps no device copies of masters: step the host masters directly"
        )
    }

    /// Queues the copies of `targets` (of the block in `slot`) into their
    /// host masters, behind the compute issued so far.
    ///
    /// # Safety
    /// Nothing touches those masters until `synchronize` has returned.
    unsafe fn write_back(
        &mut self,
        _slot: usize,
        _targets: &[DeviceMaster],
        _p: Parts,
        _stats: &mut StreamStats,
    ) -> Result<()> {
        Ok(())
    }
}
