//! Keys and values of the positions already seen, per decoder layer, so that
//! generation feeds each new token alone instead of the whole prefix again.
//!
//! The cache belongs to the [`crate::Llama`] and is shared (an `Arc`) with every
//! decoder layer it builds, resident or streamed: a streamed model rebuilds its
//! layers on every call, so a layer cannot keep state itself. A layer uses its
//! slot only when a call asks for it (see [`crate::DecoderLayer`]'s extras), so
//! ordinary forwards and training never touch the cache.
use candle_core::{bail, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::batch_kv::{BatchKv, Packed, Step};

/// One layer's `(k, v)`, each `(batch, kv_heads, positions, head_dim)`, after
/// the rotary embedding; `None` before the first cached call.
type Slot = Option<(Tensor, Tensor)>;

/// A streamed model's embedding, final norm and head on the device.
type Outer = (Tensor, Tensor, Tensor);

pub(crate) struct KvCache {
    layers: Mutex<Vec<Slot>>,
    batched: Mutex<Option<BatchKv>>,
    /// The device copies of a streamed model's outer weights for the cached
    /// sequence: uploaded at its first call, not at every token (they are the
    /// size of several layers), and dropped with the cache.
    outer: Mutex<Option<Outer>>,
    /// Host-memory kv cache bytes copied up by the ended and current batches.
    host_copied: AtomicUsize,
}

impl KvCache {
    /// An empty cache for `layers` decoder layers.
    pub(crate) fn new(layers: usize) -> Self {
        Self {
            layers: Mutex::new(vec![None; layers]),
            batched: Mutex::new(None),
            outer: Mutex::new(None),
            host_copied: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Vec<Slot>>> {
        self.layers
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// Positions cached (those of layer 0; every layer holds the same number
    /// after a complete call).
    pub(crate) fn positions(&self) -> Result<usize> {
        match self.lock()?.first() {
            Some(Some((k, _))) => k.dim(2),
            _ => Ok(0),
        }
    }

    /// Forgets every cached position (and the outer weights' copies).
    pub(crate) fn clear(&self) -> Result<()> {
        self.lock()?.iter_mut().for_each(|s| *s = None);
        *self.lock_outer()? = None;
        Ok(())
    }

    fn lock_outer(&self) -> Result<MutexGuard<'_, Option<Outer>>> {
        self.outer
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// The outer weights' device copies of this cached sequence, made by
    /// `make` at its first call (no position cached yet).
    pub(crate) fn outer_or(&self, make: impl FnOnce() -> Result<Outer>) -> Result<Outer> {
        // A batch keeps its copies from `begin_batch` to `end_batch`.
        let fresh = self.positions()? == 0 && self.lock_batched()?.is_none();
        let mut outer = self.lock_outer()?;
        if fresh || outer.is_none() {
            *outer = Some(make()?);
        }
        Ok(outer.clone().expect("set above"))
    }

    /// Appends this call's `k`, `v` to layer `layer`'s slot and returns the keys
    /// and values of every position so far. On an error the slot is unchanged.
    pub(crate) fn extend(&self, layer: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let mut slots = self.lock()?;
        let Some(slot) = slots.get_mut(layer) else {
            bail!("kv cache has no slot for layer {layer}")
        };
        let (k, v) = match slot.as_ref() {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            None => (k, v),
        };
        *slot = Some((k.clone(), v.clone()));
        Ok((k, v))
    }

    fn lock_batched(&self) -> Result<MutexGuard<'_, Option<BatchKv>>> {
        self.batched
            .lock()
            .map_err(|_| candle_core::Error::Msg("kv cache poisoned by a panic".into()))
    }

    /// Runs `f` on the batched decode's cache (an error outside
    /// `begin_batch`/`end_batch`).
    fn with_batch<T>(&self, f: impl FnOnce(&mut BatchKv) -> Result<T>) -> Result<T> {
        match self.lock_batched()?.as_mut() {
            Some(b) => f(b),
            None => bail!("kv cache: batched decoding outside begin_batch/end_batch"),
        }
    }

    /// Starts batched decoding with `slots` empty sequence slots, the last
    /// `host_slots` of them in host memory (the single-sequence cache and the
    /// outer weights' copies are emptied).
    pub(crate) fn begin_batch(&self, slots: usize, host_slots: usize) -> Result<()> {
        self.clear()?;
        let layers = self.lock()?.len();
        *self.lock_batched()? = Some(BatchKv::new(layers, slots, host_slots)?);
        Ok(())
    }

    /// Ends batched decoding, dropping every slot.
    pub(crate) fn end_batch(&self) -> Result<()> {
        if let Some(b) = self.lock_batched()?.take() {
            self.host_copied
                .fetch_add(b.host_bytes_copied(), Ordering::Relaxed);
        }
        self.clear()
    }

    /// Host-memory kv cache bytes copied to the device by the batches so far.
    pub(crate) fn host_bytes_copied(&self) -> usize {
        let current = match self.lock_batched() {
            Ok(b) => b.as_ref().map_or(0, BatchKv::host_bytes_copied),
            Err(_) => 0,
        };
        self.host_copied.load(Ordering::Relaxed) + current
    }

    /// Makes room for `need` positions per slot, `hint` the longest the
    /// sequences in flight may grow ([`BatchKv::reserve`]).
    pub(crate) fn reserve(&self, need: usize, hint: usize) -> Result<()> {
        self.with_batch(|b| b.reserve(need, hint))
    }

    /// Starts a packed call writing `step`: `(slot, rows)` in row order.
    pub(crate) fn begin_step(&self, step: Step) -> Result<()> {
        self.with_batch(|b| b.begin_step(step))
    }

    /// Ends the packed call; `done`: it completed, so its rows count.
    pub(crate) fn end_step(&self, done: bool) -> Result<()> {
        self.with_batch(|b| {
            b.end_step(done);
            Ok(())
        })
    }

    /// The packed call in flight, if batched decoding is on and a call is.
    pub(crate) fn step(&self) -> Result<Option<Step>> {
        Ok(self.lock_batched()?.as_ref().and_then(BatchKv::step))
    }

    /// Positions cached for sequence slot `slot`.
    pub(crate) fn slot_positions(&self, slot: usize) -> Result<usize> {
        self.with_batch(|b| b.len(slot))
    }

    /// Empties sequence slot `slot` for the next sequence.
    pub(crate) fn clear_slot(&self, slot: usize) -> Result<()> {
        self.with_batch(|b| b.clear(slot))
    }

    /// Writes layer `layer`'s keys and values of the packed call in flight
    /// and returns the parts of the packed cache ([`BatchKv::extend`]).
    pub(crate) fn extend_packed(
        &self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<Packed>> {
        self.with_batch(|b| b.extend(layer, k, v))
    }
}
